"""Compiled programs kept on disk (flamed/sampling/bpfimage.py), with the real
compiler, the real verifier and real sampling.

The same sampler (CPU walker, Python walker, unwinder, off-CPU) is started
from a compile and then from the cache; both must sample a Python workload
with its Python and native frames.  An image made in a child process must be
the image made here (the map references are indices, not fds); a damaged or
untrusted cache is said and compiled around.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions
from flamed.sampling.program import bpf_program, task_fsbase_offset, task_pid_offset
from flamed.sampling.bpfimage import Image, ImageCache, ImageError, _map_refs, compile_in_child, image_key, image_of
from support import have_bcc, have_root, need

pytestmark = pytest.mark.bpf

SPIN = (
    "import time, sys\n"
    "def spin_in_image_test():\n"
    "    t = time.time()\n"
    "    while time.time() - t < 20: pass\n"
    "print('ready', flush=True)\n"
    "spin_in_image_test()\n"
)


def _options(cache: Path | None, **kw: object) -> BpfSamplerOptions:
    return BpfSamplerOptions(frequency=199, python=True, unwind=True, offcpu=True, bpf_cache_dir=cache,
                             **kw)  # type: ignore[arg-type]


def _cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _sample_spinner(opts: BpfSamplerOptions) -> tuple[str, int, int, float]:
    """Start a sampler, let it sample a spinning Python process 1.5 s: (how
    the program was had, samples of the process, of them under the spin
    function, the CPU seconds the process had meanwhile)."""
    p = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE)
    s = BpfSampler(opts)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        s.start()
        how = s.stats().program
        # the process described to the unwinder and the Python walker first (a loaded host takes a while)
        deadline = time.monotonic() + 30
        while not (s.unwind_ready(p.pid) and s.python_claim(p.pid)[0]) and time.monotonic() < deadline:
            s.drain()
            time.sleep(0.2)
        s.drain()
        cpu0 = _cpu_seconds(p.pid)
        time.sleep(1.5)
        w = s.drain()
        cpu = _cpu_seconds(p.pid) - cpu0
        # every map still open: nothing closed one of its fds meanwhile (bcc's symbol
        # cache did, before flamed named processes itself)
        for name in ("counts0", "uw_procs", "uw_rows", "pyprocs", "offcpu_start"):
            assert "bpf-map" in os.readlink(f"/proc/self/fd/{s._program.bpf[name].map_fd}"), name
        mine = {k: n for k, n in w.counts.items() if k[0] == p.pid}
        named = sum(n for (_p, _t, _c, st), n in mine.items() if any(f.startswith("spin_in_image_test (") for f in st))
        return how, sum(mine.values()), named, cpu
    finally:
        s.close()
        p.kill()
        p.wait(timeout=10)


@pytest.fixture
def bpf_ok() -> None:
    need(have_root(), "root (BPF and perf events need CAP_BPF/CAP_PERFMON)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")


def test_a_cached_program_samples_as_the_compiled_one(bpf_ok: None, tmp_path: Path) -> None:
    cache = tmp_path / "bpf"
    how1, n1, named1, cpu1 = _sample_spinner(_options(cache))
    files = list(cache.glob("*.bpfimg"))
    assert how1 == "compiled" and len(files) == 1, (how1, files)
    assert files[0].stat().st_mode & 0o077 == 0  # root's cache: nobody else reads or writes it
    how2, n2, named2, cpu2 = _sample_spinner(_options(cache))
    assert how2 == "cache"
    for n, named, cpu in ((n1, named1, cpu1), (n2, named2, cpu2)):
        # 199 Hz of the CPU time the process got (a shared host gives it less than 1.5 s)
        assert n >= max(20, 0.6 * 199 * cpu), f"{n} samples of a process that ran {cpu:.2f} s at 199 Hz"
        assert named / n >= 0.9, f"{named}/{n} samples under spin_in_image_test"


def test_an_image_from_a_child_is_the_image_made_here(bpf_ok: None) -> None:
    from bcc import BPF

    opts = _options(None)
    prog = bpf_program(opts, fsbase_offset=task_fsbase_offset(), pid_offset=task_pid_offset())
    # fds of this process differ from the child's: a held fd moves this one's numbers
    spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(7)]
    try:
        b = BPF(text=prog.source.encode(), cflags=list(prog.cflags))
        try:
            here = image_of(b)
        finally:
            b.cleanup()
    finally:
        for fd in spare:
            os.close(fd)
    there = compile_in_child(prog.source, prog.cflags)
    assert here == there
    assert {"flamed_sample", "flamed_unwind", "flamed_finish", "flamed_offcpu"} <= set(here.funcs)
    refs = sum(len(_map_refs(code, len(here.maps), name)) for name, code in here.funcs.items())
    assert refs > 10, f"only {refs} map references in the whole program"
    assert Image.from_bytes(here.to_bytes()) == here


def test_a_damaged_image_is_said_and_compiled_again(bpf_ok: None, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "bpf"
    opts = BpfSamplerOptions(frequency=99, bpf_cache_dir=cache)
    s = BpfSampler(opts)
    try:
        s.start()
        assert s.stats().program == "compiled"
    finally:
        s.close()
    (f,) = cache.glob("*.bpfimg")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # a disk-full write, say
    caplog.set_level(logging.WARNING, logger="flamed.bpf")
    s = BpfSampler(opts)
    try:
        s.start()
        assert s.stats().program == "compiled"
        s.drain()
    finally:
        s.close()
    assert any("digest mismatch" in r.getMessage() and "compiling again" in r.getMessage() for r in caplog.records)
    assert f.read_bytes() == data  # stored again, whole


def test_an_untrusted_cache_is_not_loaded(bpf_ok: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "bpf"
    opts = BpfSamplerOptions(frequency=99, bpf_cache_dir=cache)
    s = BpfSampler(opts)
    try:
        s.start()
    finally:
        s.close()
    cache.chmod(0o777)  # anyone could have put a program here
    caplog.set_level(logging.WARNING, logger="flamed.bpf")
    s = BpfSampler(opts)
    try:
        s.start()
        assert s.stats().program == "compiled"
    finally:
        s.close()
    assert any("writable by others" in r.getMessage() for r in caplog.records)


def test_what_an_image_cannot_carry_is_refused() -> None:
    ld_map = bytes([0x18, 0x11, 0, 0]) + (3).to_bytes(4, "little") + bytes(8)  # r1 = map #3
    ld_value = bytes([0x18, 0x21, 0, 0]) + (0).to_bytes(4, "little") + bytes(8)  # r1 = &map value
    exit_ = bytes([0x95, 0, 0, 0, 0, 0, 0, 0])
    assert _map_refs(ld_map + exit_, 4, "f") == [0]
    with pytest.raises(ImageError, match="out of range"):
        _map_refs(ld_map + exit_, 3, "f")
    with pytest.raises(ImageError, match="kind 2"):
        _map_refs(ld_value + exit_, 4, "f")
    with pytest.raises(ImageError, match="whole instructions"):
        _map_refs(exit_[:5], 4, "f")


def test_the_key_follows_every_input() -> None:
    k = image_key("int x;", ["-DA=1"])
    assert k == image_key("int x;", ["-DA=1"])
    assert k != image_key("int x; ", ["-DA=1"])
    assert k != image_key("int x;", ["-DA=2"])


def test_a_cache_dir_that_cannot_be_made_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ImageCache(blocker / "bpf")
    img = Image(maps=(), funcs={"f": bytes([0x95, 0, 0, 0, 0, 0, 0, 0])}, license="GPL", kern_version=0)
    caplog.set_level(logging.WARNING, logger="flamed.bpf")
    assert cache.put("k", img) is False
    assert cache.put("k2", img) is False
    assert cache.get("k") is None
    assert len([r for r in caplog.records if "cannot store" in r.getMessage()]) == 1


def _truncating_python(tmp: Path, good_after: int) -> Path:
    """An interpreter whose standard output is cut after 100 bytes for its first
    ``good_after`` runs (its exit status kept: the child says it succeeded),
    whole after that; each run is counted in ``runs``."""
    wrapper = tmp / "python-cut"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo run >> "{tmp}/runs"\n'
        f'"{os.path.realpath(sys.executable)}" "$@" > "{tmp}/out.$$"; rc=$?\n'
        f'if [ "$(wc -l < "{tmp}/runs")" -le {good_after} ]; then head -c 100 "{tmp}/out.$$"; '
        f'else cat "{tmp}/out.$$"; fi\n'
        f'rm -f "{tmp}/out.$$"; exit $rc\n')
    wrapper.chmod(0o755)
    return wrapper


_AS_THE_DAEMON = """
import sys
from flamed.sampling.bpfimage import runtime_only
assert runtime_only()  # as the daemon: this process cannot compile, every compile is a child's
sys.executable = sys.argv[1]
"""


def test_a_truncated_image_from_the_compiler_child_is_compiled_again(bpf_ok: None, tmp_path: Path) -> None:
    """The compiler child's output cut short on the pipe (exit 0) was taken for a
    damaged cache file and ended the daemon with exit 3, which systemd never
    restarts.  Now it is said, and compiled again in a new child."""
    wrapper = _truncating_python(tmp_path, good_after=1)
    code = _AS_THE_DAEMON + (
        "from flamed.sampling.bpfimage import load_bpf\n"
        "b, info = load_bpf('int f(void *ctx) { return 0; }', [], cache_dir=None, isolated=True)\n"
        "print(info.how)\n")
    r = subprocess.run([sys.executable, "-c", code, str(wrapper)], capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).resolve().parents[2]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "child"
    assert (tmp_path / "runs").read_text().count("run") == 2
    assert "exited 0 but its output (100 bytes) is not a whole image" in r.stderr, r.stderr
    assert "compiling again in a new process" in r.stderr


def test_a_compiler_child_that_never_hands_over_its_image_is_a_transient_error(bpf_ok: None,
                                                                               tmp_path: Path) -> None:
    """Cut short every time: the sampler's start fails with exit 1 (a restart may
    compile it), not 3 (CapabilityError: kernel headers, privileges), and says what happened."""
    wrapper = _truncating_python(tmp_path, good_after=1000)
    code = _AS_THE_DAEMON + (
        "from flamed.errors import CapabilityError, FlamedError\n"
        "from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions\n"
        "s = BpfSampler(BpfSamplerOptions(frequency=19, python=False, unwind=False, bpf_cache_dir=None,\n"
        "                                 bpf_compile_isolated=True))\n"
        "try:\n"
        "    s.start()\n"
        "except FlamedError as e:\n"
        "    print(type(e).__name__, e.exit_code, e)\n"
        "finally:\n"
        "    s.close()\n")
    r = subprocess.run([sys.executable, "-c", code, str(wrapper)], capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).resolve().parents[2]))
    assert r.returncode == 0, r.stderr
    kind, exit_code, message = r.stdout.split(" ", 2)
    assert (kind, exit_code) == ("FlamedError", "1"), r.stdout
    assert "is not a whole image" in message and "attempt 2 of 2" in message, message
    assert "kernel headers" not in message
    assert (tmp_path / "runs").read_text().count("run") == 2
