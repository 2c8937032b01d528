"""flamed.sampling.symbols against a fake /proc and fake resolvers (the real bcc path is
covered by tests/integration/test_bpf_sampler.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flamed.sampling.symbols import ProcessIdentity, Symbolizer, read_identity

LIBC = b"/usr/lib/x86_64-linux-gnu/libc.so.6"
APP = b"/opt/app/bin/app"


def write_proc(proc: Path, pid: int, *, start: int, code: int = 0x400000, stack: int = 0x7FFF0000,
               comm: str = "app", maps: str | None = None, inode: int = 11) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    # Fields 3.. after "(comm)"; field 22 starttime, 26 startcode, 28 startstack.
    rest = ["S"] + ["0"] * 49
    rest[22 - 3] = str(start)
    rest[26 - 3] = str(code)
    rest[28 - 3] = str(stack)
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(rest) + "\n")
    if maps is None:
        maps = (
            f"00400000-00500000 r-xp 00000000 08:01 {inode} /opt/app/bin/app\n"
            f"00600000-00601000 rw-p 00000000 08:01 {inode} /opt/app/bin/app\n"
            "7f0000000000-7f0000100000 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        )
    (d / "maps").write_text(maps)


class FakeResolver:
    """Symbols: app 0x400000.. as app_fn_<n> (per 0x100), libc named only below 0x7f0000080000."""

    instances: list[FakeResolver] = []

    def __init__(self, pid: int, table: dict[int, tuple[bytes | None, bytes | None]] | None = None) -> None:
        self.pid = pid
        self.calls = 0
        self.closed = False
        self.refreshed = 0
        self.extra: dict[int, tuple[bytes | None, bytes | None]] = {}
        FakeResolver.instances.append(self)

    def resolve(self, addr: int) -> tuple[bytes | None, bytes | None]:
        self.calls += 1
        if self.pid < 0:
            return (b"kfn_%x" % (addr >> 8), b"kernel") if addr >= 0xFFFF800000000000 else (None, None)
        if self.refreshed and addr in self.extra:
            return self.extra[addr]
        if 0x400000 <= addr < 0x500000:
            return b"app_fn_%d" % ((addr - 0x400000) >> 8), APP
        if 0x7F0000000000 <= addr < 0x7F0000080000:
            return b"libc_fn", LIBC
        if 0x7F0000080000 <= addr < 0x7F0000100000:
            return None, LIBC
        return None, None

    def refresh(self) -> None:
        self.refreshed += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    FakeResolver.instances.clear()
    p = tmp_path / "proc"
    p.mkdir()
    return p


def make(proc: Path) -> Symbolizer:
    return Symbolizer(resolver_factory=FakeResolver, proc=proc)


def test_read_identity_survives_parentheses_and_spaces_in_comm(proc: Path) -> None:
    write_proc(proc, 42, start=777, code=0x1000, stack=0x2000, comm="we ird) (x")
    assert read_identity(42, proc) == ProcessIdentity(42, 777, 0x1000, 0x2000)
    assert read_identity(43, proc) is None


def test_user_stack_is_root_first_and_cached(proc: Path) -> None:
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    leaf_first = [0x400210, 0x400105, 0x7F0000000100]
    assert s.user_stack(10, leaf_first) == ("libc_fn", "app_fn_1", "app_fn_2")
    r = FakeResolver.instances[0]
    calls = r.calls
    s.end_drain()
    s.begin_drain()
    assert s.user_stack(10, leaf_first) == ("libc_fn", "app_fn_1", "app_fn_2")
    assert r.calls == calls  # every address answered from the cache
    assert len(FakeResolver.instances) == 1


def test_unknown_with_module_and_broken_walks(proc: Path) -> None:
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    # In libc but no symbol: the module is named.
    assert s.user_stack(10, [0x7F0000090000]) == ("[unknown] (libc.so.6)",)
    # The walk leaves every executable mapping at the third address: the rest
    # (towards the root) is garbage and becomes one [unknown] frame.
    got = s.user_stack(10, [0x400100, 0x400200, 0xDEAD0000, 0x400300, 0x12345])
    assert got == ("[unknown]", "app_fn_2", "app_fn_1")


def test_broken_walk_cut_is_the_same_from_the_cache_and_expires_with_the_drain(proc: Path) -> None:
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    walk = [0x400100, 0x400200, 0x7E0000000010, 0x400300, 0x12345]
    want = ("[unknown]", "app_fn_2", "app_fn_1")
    assert s.user_stack(10, walk) == want
    # Every address is cached now (the outside one as "cut" for this drain):
    # the same answer without the resolver, also when the cut is elsewhere.
    r = FakeResolver.instances[0]
    calls = r.calls
    assert s.user_stack(10, walk) == want
    assert s.user_stack(10, [0x400100, 0x7E0000000010]) == ("[unknown]", "app_fn_1")
    assert s.user_stack(10, [0x7E0000000010]) == ("[unknown]",)
    assert s.user_stack(10, [0x12345, 0x400300, 0x7E0000000010, 0x400100]) == ("[unknown]",)
    assert r.calls == calls
    s.end_drain()
    # A library mapped there later: the next drain reads the maps again and names it.
    write_proc(proc, 10, start=1, maps=(
        "00400000-00500000 r-xp 00000000 08:01 11 /opt/app/bin/app\n"
        "7e0000000000-7e0000001000 r-xp 00000000 08:01 13 /opt/app/lib/plugin.so\n"
    ))
    r.extra[0x7E0000000010] = (b"plugin_fn", b"/opt/app/lib/plugin.so")
    s.begin_drain()
    assert s.user_stack(10, [0x400100, 0x7E0000000010]) == ("plugin_fn", "app_fn_1")


def test_pid_reuse_and_exec_get_new_symbols(proc: Path) -> None:
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    s.user_stack(10, [0x400100])
    first = FakeResolver.instances[-1]
    s.end_drain()
    # Same pid, new process (start time differs), another program.
    write_proc(proc, 10, start=2, inode=21)
    s.begin_drain()
    s.user_stack(10, [0x400100])
    assert len(FakeResolver.instances) == 2 and first.closed
    s.end_drain()
    # exec: same start time, new image (ASLR moved the stack).
    write_proc(proc, 10, start=2, stack=0x7FFE0000, inode=31)
    s.begin_drain()
    s.user_stack(10, [0x400100])
    assert len(FakeResolver.instances) == 3
    assert s.stats.invalidations == 2


def test_exited_process_keeps_its_symbols_until_forgotten_after_a_drain(proc: Path) -> None:
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    assert s.user_stack(10, [0x400100]) == ("app_fn_1",)
    s.end_drain()
    for f in (proc / "10").iterdir():
        f.unlink()
    (proc / "10").rmdir()
    s.begin_drain()
    # Gone from /proc, but its samples of the last interval still resolve.
    assert s.user_stack(10, [0x400100, 0x400200]) == ("app_fn_2", "app_fn_1")
    s.forget(10)
    # forget() waits for the drain in progress to finish.
    assert s.user_stack(10, [0x400100]) == ("app_fn_1",)
    s.end_drain()
    assert FakeResolver.instances[0].closed
    s.begin_drain()
    assert s.user_stack(10, [0x400100]) == ("[unknown]",)


def test_a_zombie_keeps_the_symbols_of_the_process_it_was(proc: Path) -> None:
    """A process that exited but is not reaped yet shows start_code and
    start_stack 0 in /proc/PID/stat: that is not a new image (`flamed record
    -- CMD` named ~35 % of a short C program's samples [unknown] this way)."""
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    assert s.user_stack(10, [0x400100]) == ("app_fn_1",)
    s.end_drain()
    stat = proc / "10" / "stat"
    fields = stat.read_text().split(" ")
    fields[2] = "Z"  # state, field 3
    fields[25] = fields[27] = "0"  # start_code, start_stack
    stat.write_text(" ".join(fields))
    (proc / "10" / "maps").write_text("")
    s.begin_drain()
    assert s.user_stack(10, [0x400100, 0x400200]) == ("app_fn_2", "app_fn_1")


def test_library_loaded_later_refreshes_the_resolver(proc: Path) -> None:
    write_proc(proc, 10, start=1)
    s = make(proc)
    s.begin_drain()
    s.user_stack(10, [0x400100])
    s.end_drain()
    # dlopen: a new mapping appears in /proc/PID/maps; the resolver only
    # knows it after a refresh.
    write_proc(proc, 10, start=1, maps=(
        "00400000-00500000 r-xp 00000000 08:01 11 /opt/app/bin/app\n"
        "7e0000000000-7e0000001000 r-xp 00000000 08:01 13 /opt/app/lib/plugin.so\n"
    ))
    r = FakeResolver.instances[0]
    r.extra[0x7E0000000010] = (b"plugin_fn", b"/opt/app/lib/plugin.so")
    s.begin_drain()
    assert s.user_stack(10, [0x7E0000000010, 0x400100]) == ("app_fn_1", "plugin_fn")
    assert r.refreshed == 1 and s.stats.refreshes == 1


def test_kernel_frames_carry_the_suffix(proc: Path) -> None:
    s = make(proc)
    s.begin_drain()
    assert s.kernel_stack([0xFFFFFFFF81000100, 0xFFFFFFFF81000200]) == ("kfn_ffffffff810002_[k]", "kfn_ffffffff810001_[k]")
    assert s.kernel_stack([0x10]) == ("[unknown]_[k]",)
    s.close()
    assert FakeResolver.instances[0].closed


def test_processes_of_the_same_program_share_symbols(proc: Path) -> None:
    for pid in (10, 11, 12):
        write_proc(proc, pid, start=pid)
    s = make(proc)
    s.begin_drain()
    for pid in (10, 11, 12):
        assert s.user_stack(pid, [0x400100, 0x7F0000000010]) == ("libc_fn", "app_fn_1")
    # Only the first process needed a resolver: same files, same offsets.
    assert len(FakeResolver.instances) == 1
    # Another build of the program (another inode) is resolved on its own.
    write_proc(proc, 13, start=13, inode=99)
    assert s.user_stack(13, [0x400100]) == ("app_fn_1",)
    assert len(FakeResolver.instances) == 2


def test_real_elf_symbols_of_this_process() -> None:
    """The shared ELF tables against libc as this very process maps it."""
    import ctypes as ct
    import os

    from support import have_bcc, need

    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc)")
    addr = ct.cast(ct.CDLL("libc.so.6").getpid, ct.c_void_p).value
    assert addr is not None
    s = Symbolizer()
    try:
        s.begin_drain()
        # Root first: the frame is the function the address lies in, by its plain name.
        assert s.user_stack(os.getpid(), [addr + 1]) == ("getpid",)
        assert s.stats.elf_files == 1 and s.stats.resolver_calls == 0
    finally:
        s.close()


class StubElf:
    """An ELF loader that names every offset and records the paths it opened."""

    opened: list[str] = []

    def __init__(self, path: str) -> None:
        import os

        if not os.path.isfile(path):
            raise OSError(f"{path}: no such file")
        StubElf.opened.append(path)

    def __len__(self) -> int:
        return 1

    def lookup(self, file_offset: int) -> bytes | None:
        return b"stub_fn_%x" % file_offset


def test_process_primed_before_it_exits_keeps_its_frames(proc: Path, tmp_path: Path) -> None:
    import os
    import shutil

    exe = tmp_path / "app"
    exe.write_bytes(b"\x7fELF not really")
    st = os.stat(exe)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    maps = f"00400000-00500000 r-xp 00000000 {dev} {st.st_ino} {exe}\n"
    StubElf.opened.clear()
    s = Symbolizer(resolver_factory=FakeResolver, proc=proc, elf_loader=StubElf)
    for pid in (10, 11):
        write_proc(proc, pid, start=pid, maps=maps)
    prepared = s.prepare(10)
    assert prepared is not None
    s.prime(10, prepared)
    assert s.stats.primed == 1
    # Both exit before the drain: /proc/PID (and /proc/PID/root with it) is gone.
    for pid in (10, 11):
        shutil.rmtree(proc / str(pid))
    assert s.prepare(10) is None
    s.begin_drain()
    # The primed one is named from the file at its path (same device and inode) ...
    assert s.user_stack(10, [0x400100]) == ("stub_fn_100",)
    assert StubElf.opened == [str(exe)]
    # ... the other one lost its maps with its life.
    assert s.user_stack(11, [0x400100]) == ("[unknown]",)
    s.end_drain()


def test_priming_ignores_a_file_replaced_at_the_same_path(proc: Path, tmp_path: Path) -> None:
    import os
    import shutil

    exe = tmp_path / "app"
    exe.write_bytes(b"old")
    st = os.stat(exe)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    write_proc(proc, 10, start=1, maps=f"00400000-00500000 r-xp 00000000 {dev} {st.st_ino} {exe}\n")
    StubElf.opened.clear()
    s = Symbolizer(resolver_factory=FakeResolver, proc=proc, elf_loader=StubElf)
    prepared = s.prepare(10)
    assert prepared is not None
    s.prime(10, prepared)
    shutil.rmtree(proc / "10")
    # An upgrade put another file (another inode) at the path: not the code that ran.
    keep = tmp_path / "keep"
    os.rename(exe, keep)
    exe.write_bytes(b"new")
    s.begin_drain()
    frames = s.user_stack(10, [0x400100])
    assert StubElf.opened == []
    assert "stub_fn" not in frames[0]
    s.end_drain()


def test_bcc_cache_of_an_exited_process_is_refused_without_printing() -> None:
    """bcc printed "Opening /proc/PID/root failed" on fd 2 for a process that had
    exited by the drain (a `flamed record` whose target ended first)."""
    import subprocess
    import sys

    from support import have_bcc, need

    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    code = (
        "import sys\n"
        "from flamed.sampling.symbols import BccResolver\n"
        "try:\n"
        f"    BccResolver({dead.pid})\n"
        "except OSError:\n"
        "    print('refused')\n"
        "else:\n"
        "    print('made')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "refused"
    assert r.stderr == ""


def _file_map(path: Path | str, real: Path, at: str = "00400000-00500000") -> str:
    import os

    st = os.stat(real)
    return f"{at} r-xp 00000000 {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} {path}\n"


def test_chrooted_process_file_is_opened_through_its_root(proc: Path, tmp_path: Path) -> None:
    """A chroot (RootDirectory=): maps name the file by the host's path to the
    root plus the path inside; files bind-mounted into the root exist only in
    the process's mount namespace, so only /proc/PID/root + the inside path
    opens them."""
    import os

    croot = tmp_path / "croot"
    (croot / "lib").mkdir(parents=True)
    (croot / "lib" / "app").write_bytes(b"code")
    view = tmp_path / "srv"  # the root as the host names it
    os.symlink(croot, view)
    write_proc(proc, 10, start=1, maps=_file_map(f"{view}/lib/app", croot / "lib" / "app"))
    os.symlink(view, proc / "10" / "root")
    StubElf.opened.clear()
    s = Symbolizer(resolver_factory=FakeResolver, proc=proc, elf_loader=StubElf)
    s.begin_drain()
    assert s.user_stack(10, [0x400100]) == ("stub_fn_100",)
    assert StubElf.opened == [f"{proc}/10/root/lib/app"]


def test_a_file_one_process_cannot_reach_is_still_read_for_others(proc: Path, tmp_path: Path) -> None:
    """A process whose view of a file fails (a chroot, an exit mid-read) must
    not leave that file unnamed for every other process mapping it: before,
    the failure was cached for the file, and a daemon named no frame of the
    host's libc once a chrooted process had been sampled first."""
    import os

    lib = tmp_path / "libc.so"
    lib.write_bytes(b"code")
    empty = tmp_path / "empty-root"
    empty.mkdir()
    at = "7f0000000000-7f0000100000"
    write_proc(proc, 10, start=1, maps=_file_map("/srv/gone/lib/libc.so", lib, at))
    os.symlink(empty, proc / "10" / "root")
    write_proc(proc, 11, start=2, maps=_file_map(lib, lib, at))
    os.symlink("/", proc / "11" / "root")
    StubElf.opened.clear()
    s = Symbolizer(resolver_factory=FakeResolver, proc=proc, elf_loader=StubElf)
    s.begin_drain()
    # bcc's resolver, the fallback, cannot name it either: only its module.
    assert s.user_stack(10, [0x7F0000080100]) == ("[unknown] (libc.so.6)",)
    assert s.user_stack(11, [0x7F0000080100]) == ("stub_fn_80100",)
    assert StubElf.opened == [f"{proc}/11/root{lib}"]
    s.end_drain()
