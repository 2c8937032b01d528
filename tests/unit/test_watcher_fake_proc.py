"""Python recognition and filters of the process watcher, on a fake /proc tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from cpython_support import need_debian_311

from flamed.errors import ConfigError
from flamed.pyspy.watcher import ProcessWatcher, ProcReader, PyProcess, WatchOptions, python_identity
from flamed.sampling.cpython import elf

LIBPY = "7f0000000000-7f0000100000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libpython{ver}.so.1.0\n"


def make_proc(root: Path, pid: int, *, exe: str, comm: str, maps: str = "", uid: int = 0,
              cgroup: str = "/system.slice/app.service", ppid: int = 1) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    os.symlink(exe, d / "exe")
    (d / "comm").write_text(comm + "\n")
    (d / "maps").write_text(maps)
    (d / "status").write_text(f"Name:\t{comm}\nTgid:\t{pid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "cgroup").write_text(f"0::{cgroup}\n")
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 0 0\n")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    make_proc(root, 100, exe="/usr/bin/python3.12", comm="python3.12")
    make_proc(root, 101, exe="/usr/bin/python3", comm="python3", maps=LIBPY.format(ver="3.11"))
    make_proc(root, 102, exe="/usr/local/bin/uwsgi", comm="uwsgi", maps=LIBPY.format(ver="3.10"), uid=33,
              cgroup="/system.slice/uwsgi.service")
    make_proc(root, 103, exe="/usr/bin/bash", comm="bash")
    make_proc(root, 104, exe="/usr/bin/python2.7", comm="python2.7")
    make_proc(root, 105, exe="/opt/gunicorn-bin", comm="gunicorn", maps=LIBPY.format(ver="3.14"), ppid=102)
    make_proc(root, 106, exe="/usr/bin/python3.13t", comm="python3.13t")
    make_proc(root, 107, exe="/usr/bin/python3.7", comm="python3.7")
    make_proc(root, 108, exe="/usr/bin/python3.2", comm="python3.2")
    make_proc(root, 109, exe="/usr/sbin/apache2", comm="apache2",
              maps=LIBPY.replace(".so.1.0", "m.so.1.0").format(ver="3.7"))
    make_proc(root, 110, exe="/opt/old/bin/python2.2", comm="python2.2")
    return root


def test_identity_by_exe_and_libpython(proc: Path) -> None:
    r = ProcReader(str(proc))
    assert python_identity(r, 100) == ("exe", "3.12")
    assert python_identity(r, 101) == ("exe", "3.11")
    assert python_identity(r, 102) == ("libpython", "3.10")
    assert python_identity(r, 103) is None
    assert python_identity(r, 105) == ("libpython", "3.14")
    assert python_identity(r, 106) == ("exe", "3.13")
    assert python_identity(r, 104) == ("exe", "2.7")
    assert python_identity(r, 109) == ("libpython", "3.7")  # libpython3.7m.so: the ABI flag of 3.7 and older


def scan(proc: Path, **kw: object) -> tuple[ProcessWatcher, list[PyProcess]]:
    found: list[PyProcess] = []
    w = ProcessWatcher(WatchOptions(use_connector=False, **kw), on_start=found.append,  # type: ignore[arg-type]
                       proc_root=str(proc))
    w.start()
    return w, found


def test_scan_finds_supported_pythons_only(proc: Path) -> None:
    # 2.7 and 3.7 are read by py-spy (the BPF walker reads 3.8-3.13); 3.2 and 2.2 by neither.
    w, found = scan(proc)
    assert sorted(p.pid for p in found) == [100, 101, 102, 104, 105, 106, 107, 109]
    assert w.stats.unsupported == 2
    assert w.stats.unsupported_versions == {"3.2": 1, "2.2": 1}
    m = w.metrics()
    assert m["unsupported"] == 2
    assert m["unsupported_version:3.2"] == 1 and m["unsupported_version:2.2"] == 1


@pytest.mark.parametrize("kw,expected", [
    ({"include_comm": r"^python"}, [100, 101, 104, 106, 107]),
    ({"exclude_comm": r"uwsgi|gunicorn"}, [100, 101, 104, 106, 107, 109]),
    ({"uids": frozenset({33})}, [102]),
    ({"include_cgroup": r"uwsgi\.service$"}, [102]),
    ({"exclude_cgroup": r"uwsgi"}, [100, 101, 104, 105, 106, 107, 109]),
    ({"pids": frozenset({102}), "descendants": True}, [102, 105]),
    ({"pids": frozenset({102}), "descendants": False}, [102]),
])
def test_filters(proc: Path, kw: dict[str, object], expected: list[int]) -> None:
    _, found = scan(proc, **kw)
    assert sorted(p.pid for p in found) == expected


def test_bound_counts_left_out_and_frees_slots(proc: Path) -> None:
    exits: list[int] = []
    found: list[PyProcess] = []
    w = ProcessWatcher(WatchOptions(use_connector=False, max_watched=2), on_start=found.append,
                       on_exit=exits.append, proc_root=str(proc))
    w.start()
    assert len(w.watched) == 2 and w.stats.left_out == 6  # 8 readable Pythons
    first = sorted(w.watched)[0]
    # the process exits: the next scan notices, frees the slot and takes a left-out one
    for f in (proc / str(first)).iterdir():
        f.unlink()
    (proc / str(first)).rmdir()
    w.scan()
    assert exits == [first] and len(w.watched) == 2 and len(found) == 3
    assert w.stats.left_out == 6  # counted once per process, not per scan


def _remove(proc: Path, pid: int) -> None:
    for f in (proc / str(pid)).iterdir():
        f.unlink()
    (proc / str(pid)).rmdir()


def _pids_held(w: ProcessWatcher) -> set[int]:
    """Every pid kept in a per-process dict or set of the watcher, whatever its name."""
    held: set[int] = set()
    for v in vars(w).values():
        if isinstance(v, (dict, set)) and not isinstance(v, Counter):
            held |= {k for k in v if isinstance(k, int)}
    return held


def test_unsupported_processes_leave_no_state_after_exit(proc: Path) -> None:
    # A daemon sees processes of a Python nothing reads come and go: once each has
    # exited the watcher holds nothing about it (it used to keep pid -> version for
    # ever), while the count by version behind flamed_python_unsupported_total and
    # record's "Python X is not supported" remains.
    w, _ = scan(proc)
    assert {108, 110} <= _pids_held(w)
    _remove(proc, 108)  # its exit event arrives
    w._event({"event": "PROC_EVENT_EXIT", "process_tgid": 108, "process_pid": 108, "timestamp_ns": 1})
    _remove(proc, 110)  # its exit is missed: the next scan notices
    w.scan()
    for pid in range(200, 260):  # more come and go, half seen exiting by event, half by scan
        make_proc(proc, pid, exe="/usr/bin/python3.2", comm="python3.2")
        w.scan()
        _remove(proc, pid)
        if pid % 2:
            w._event({"event": "PROC_EVENT_EXIT", "process_tgid": pid, "process_pid": pid, "timestamp_ns": 1})
        else:
            w.scan()
    held = _pids_held(w)
    assert not held & ({108, 110} | set(range(200, 260))), sorted(held)
    assert held <= {100, 101, 102, 104, 105, 106, 107, 109}  # the supported ones, still running
    assert w.stats.unsupported_versions == {"3.2": 61, "2.2": 1}
    m = w.metrics()
    assert m["unsupported_version:3.2"] == 61 and m["unsupported"] == 62


def test_bad_regex_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="include_comm"):
        WatchOptions(include_comm="(")


def test_parse_proc_events_decodes_connector_datagrams() -> None:
    import struct

    from flamed.pyspy.watcher import parse_proc_events

    def msg(what: int, ts: int, body: bytes) -> bytes:
        payload = struct.pack("=IIIIHH", 1, 1, 0, 0, 16 + len(body), 0) + struct.pack("=IIQ", what, 0, ts) + body
        return struct.pack("=IHHII", 16 + len(payload), 3, 0, 0, 0) + payload

    data = (msg(0x1, 10, struct.pack("=IIII", 5, 5, 6, 6))
            + msg(0x2, 11, struct.pack("=II", 6, 6))
            + msg(0x200, 12, struct.pack("=II16s", 6, 6, b"x"))  # comm: skipped
            + msg(0x80000000, 13, struct.pack("=IIIIII", 6, 6, 0, 17, 5, 5)))
    evs = list(parse_proc_events(data))
    assert [e["event"] for e in evs] == ["PROC_EVENT_FORK", "PROC_EVENT_EXEC", "PROC_EVENT_EXIT"]
    assert evs[0]["child_tgid"] == 6 and evs[0]["parent_tgid"] == 5 and evs[0]["timestamp_ns"] == 10
    assert evs[2]["process_tgid"] == 6 and evs[2]["timestamp_ns"] == 13
    # truncated input: no exception, nothing beyond what is complete
    assert [e["event"] for e in parse_proc_events(data[:-10])] == ["PROC_EVENT_FORK", "PROC_EVENT_EXEC"]


def test_exec_event_after_follow_of_the_same_image_keeps_the_process(proc: Path) -> None:
    # A vfork parent (Popen) resumes before the kernel stamps the exec event, so
    # flamed record may follow the new image first; that late event must not
    # restart the process (a second py-spy), while a later exec must.
    (proc / "100" / "auxv").write_bytes(b"\x21\0\0\0\0\0\0\0\x00\xd0\xff\xf7\xff\x7f\0\0")
    exits: list[int] = []
    found: list[PyProcess] = []
    w = ProcessWatcher(WatchOptions(use_connector=False, pids=frozenset()), on_start=found.append,
                       on_exit=exits.append, proc_root=str(proc), clock=lambda: 1_000)
    assert w.follow(100)
    assert [p.pid for p in found] == [100]
    w._event({"event": "PROC_EVENT_EXEC", "process_tgid": 100, "timestamp_ns": 1_500})
    assert exits == [] and 100 in w.watched and len(found) == 1
    (proc / "100" / "auxv").write_bytes(b"\x21\0\0\0\0\0\0\0\x00\x90\xaa\xf1\xff\x7f\0\0")  # exec'd again
    w._event({"event": "PROC_EVENT_EXEC", "process_tgid": 100, "timestamp_ns": 2_000})
    assert exits == [100] and 100 in w.watched and len(found) == 2


def _started(cmd: list[str]) -> subprocess.Popen[bytes]:
    """``cmd`` started, once its executable is mapped.  (The exe link names the
    new image before exec maps it: in between the watcher rightly says "not
    mapped yet", and keeps no verdict.)"""
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE)
    for _ in range(500):
        if (" " + cmd[0] + "\n") in Path(f"/proc/{p.pid}/maps").read_text():
            break
        time.sleep(0.01)
    return p


def test_a_static_interpreter_under_another_name_is_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's python3.11 is one static executable: copied as ``myservice``
    (as an application that links libpython statically is), neither its name
    nor a mapped libpython says Python; CPython's symbols in it do."""
    static = need_debian_311()
    renamed = tmp_path / "myservice"
    shutil.copy(static, renamed)
    plain = tmp_path / "mytool"
    shutil.copy("/bin/cat", plain)  # an executable without CPython in it
    procs = [_started([str(renamed), "-c", "import sys; sys.stdin.read()"]), _started([str(plain)])]
    try:
        r = ProcReader()
        assert python_identity(r, procs[0].pid) == ("exe", "3.11")
        assert python_identity(r, procs[1].pid) is None
        # What every scan does for every process: the same answers, and their files are not
        # opened again (counted in this thread: elf.CACHE is the whole process's).
        opened: list[str] = []
        real_get = elf.CACHE.get
        me = threading.get_ident()

        def get(path: str, st: os.stat_result | None = None) -> elf.ElfFacts:
            if threading.get_ident() == me:
                opened.append(str(path))
            return real_get(path, st)

        monkeypatch.setattr(elf.CACHE, "get", get)
        for _ in range(3):
            assert python_identity(r, procs[0].pid) == ("exe", "3.11")
            assert python_identity(r, procs[1].pid) is None
        assert opened == [], opened
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # A file that is not ELF (or no longer readable) is not Python, and raises nothing.
    junk = tmp_path / "proc" / "7"
    junk.mkdir(parents=True)
    os.symlink(tmp_path / "not-elf", junk / "exe")
    (tmp_path / "not-elf").write_bytes(b"\x7fELF" + b"\xff" * 100)
    (junk / "maps").write_text(f"00400000-00401000 r-xp 00000000 ff:fe 987654321 {tmp_path / 'not-elf'}\n")
    assert python_identity(ProcReader(str(tmp_path / "proc")), 7) is None
