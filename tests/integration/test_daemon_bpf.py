"""The daemon with the real BPF sampler, as a real process, against real workloads.

One daemon (bcc compiles once) serves the tests of this module in order; the
last one stops it with SIGTERM and checks that the last partial window is in
the files and that the files hold exactly what the BPF program counted.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flamed import outputs
from flamed.daemon.client import DaemonError, request
from flamed.errors import FlamedError
from flamed.fileio import open_input
from flamed.folded import read_folded
from flamed.model import Profile
from flamed.procstat import child_pids
from support import ROOT, have_bcc, have_root, need, wait_daemon_answers, write_config

pytestmark = pytest.mark.bpf

BUSY = ["busy_outer", "busy_middle", "busy_leaf"]


@dataclass
class Running:
    proc: subprocess.Popen[str]
    dir: Path
    sock: str
    busy_pid: int
    busy: subprocess.Popen[bytes]


def _build_busy(out: Path) -> Path:
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev) to build the C workload")
    assert gcc is not None
    exe = out / "flamed_busy"
    subprocess.run([gcc, "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(exe),
                    str(ROOT / "tests" / "workloads" / "busy.c")], check=True, timeout=120)
    return exe


def _config(d: Path) -> Path:
    cfg = d / "flamed.toml"
    cfg.write_text(f"""
[sampling]
frequency = 99
drain_interval = 1.0
[output]
state_dir = "{d / 'profiles'}"
rotate_interval = 60.0
host = "itest"
[metrics]
address = "127.0.0.1:0"
[control]
socket = "{d / 'flamed.sock'}"
[log]
target = "stderr"
[processors.python]
enabled = false
""")
    return cfg


def _wait_socket(p: subprocess.Popen[str], sock: Path, timeout: float = 90.0) -> None:
    # The path exists from bind() on, before the daemon listens: wait for an answer.
    wait_daemon_answers(sock, p, timeout)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    need(have_root(), "root (BPF and perf events need CAP_BPF/CAP_PERFMON)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    d = tmp_path_factory.mktemp("bpfdaemon")
    exe = _build_busy(d)
    busy = subprocess.Popen([str(exe), "busy", "300"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(_config(d))],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == b"ready"
        _wait_socket(p, d / "flamed.sock")
        yield Running(p, d, str(d / "flamed.sock"), busy.pid, busy)
    finally:
        busy.kill()
        busy.wait(timeout=10)
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _snapshot(r: Running, **req: object) -> tuple[dict, bytes]:
    buf = io.BytesIO()
    head = request(r.sock, {"request": "snapshot", **req}, buf, timeout=60)
    return head, buf.getvalue()


def _wait_samples(sock: str, pid: int, least: int, timeout: float = 60.0, seconds: float = 60) -> Profile:
    """Snapshot the last ``seconds`` of ``pid`` until it has ``least`` samples (a loaded CI
    machine gives the workload only a slice of a CPU)."""
    deadline = time.monotonic() + timeout
    while True:
        buf = io.BytesIO()
        request(sock, {"request": "snapshot", "seconds": seconds, "pid": pid}, buf, timeout=60)
        prof = read_folded(io.BytesIO(buf.getvalue()))
        if prof.total() >= least or time.monotonic() > deadline:
            return prof
        time.sleep(0.5)


def _writes_profiles(fmt: str) -> bool:
    try:
        outputs.get(fmt).write(Profile({("a", "b"): 1}, start_ns=0, end_ns=1), io.BytesIO())
    except FlamedError:
        return False
    return True


def test_busy_workload_in_a_snapshot_in_every_format(daemon: Running) -> None:
    # Wait on the window asked for next, for as many samples as asserted: one drain on a
    # loaded machine can hold exactly the number waited for, and no later one may have come.
    _wait_samples(daemon.sock, daemon.busy_pid, 51, seconds=30)
    head, data = _snapshot(daemon, seconds=30, pid=daemon.busy_pid)
    p = read_folded(io.BytesIO(data))
    task = f"flamed_busy-{daemon.busy_pid}"
    assert p.total() > 50 and {s[0] for s in p.stacks} == {task}
    busiest = max(p.stacks.items(), key=lambda kv: kv[1])[0]
    assert [f for f in busiest if f in BUSY] == BUSY, busiest
    assert head["weight"] == p.total() and head["end_ns"] > head["start_ns"]
    served = 0
    for fmt in outputs.names():
        if not _writes_profiles(fmt):
            with pytest.raises(DaemonError):
                _snapshot(daemon, seconds=30, pid=daemon.busy_pid, format=fmt)
            continue
        h, payload = _snapshot(daemon, seconds=30, pid=daemon.busy_pid, format=fmt, root="comm")
        assert h["length"] == len(payload) > 0 and h["stacks"] >= 1, fmt
        if fmt in ("svg", "json", "speedscope", "folded"):
            assert b"busy_leaf" in payload, fmt
        served += 1
    assert served >= 3


def test_the_daemon_holds_no_compiler(daemon: Running) -> None:
    """bcc runs over its runtime library in the daemon (the compile ran in a
    child process or came from the cache): neither LLVM nor clang is mapped."""
    _wait_samples(daemon.sock, daemon.busy_pid, 10)
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libbcc_bpf.so" in maps
    assert "libLLVM" not in maps and "libclang" not in maps and "libbcc.so" not in maps


def test_next_snapshot_of_a_syscall_heavy_workload_has_kernel_frames(daemon: Running) -> None:
    dd = subprocess.Popen(["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=4000000000"],
                          stderr=subprocess.DEVNULL)
    try:
        head, data = _snapshot(daemon, next=3.0, pid=dd.pid, frames="kernel")
    finally:
        dd.kill()
        dd.wait(timeout=10)
    p = read_folded(io.BytesIO(data))
    assert p.total() >= 10  # dd gets only a slice of a CPU on a loaded machine
    assert all(f.endswith("_[k]") for s in p.stacks for f in s[1:])
    assert any(re.search(r"(read|write)", f) for s in p.stacks for f in s)
    assert head["end_ns"] - head["start_ns"] >= 2.9e9


def test_snapshot_has_whole_stacks_of_a_program_without_frame_pointers(daemon: Running, tmp_path: Path) -> None:
    """The daemon's default config unwinds from .eh_frame: main -> level_a ->
    level_b -> level_c -> leaf built -O2 -fomit-frame-pointer, whole in a snapshot."""
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev) to build the C workload")
    assert gcc is not None
    exe = tmp_path / "chain"
    subprocess.run([gcc, "-O2", "-fomit-frame-pointer", "-o", str(exe),
                    str(ROOT / "tests" / "workloads" / "unwind" / "chain.c")], check=True, timeout=120)
    chain = subprocess.Popen([str(exe), "60"])
    try:
        time.sleep(1.0)  # past its first ~0.1 s, sampled before it was described
        _head, data = _snapshot(daemon, next=4.0, pid=chain.pid, root="none")
        prof = read_folded(io.BytesIO(data))
        _head, data = _snapshot(daemon, seconds=30, pid=chain.pid, root="none")
        early = read_folded(io.BytesIO(data))
    finally:
        chain.kill()
        chain.wait(timeout=10)
    # From its start: the samples taken before it was described may be
    # frame-pointer stacks, and they say so -- never a short stack that looks whole.
    assert all(st[0] in ("_start", "[truncated: no table]") for st in early.stacks
               if [f for f in st if not f.endswith("_[k]")][-1:] == ["leaf"]), list(early.stacks)
    user = {}
    for st, n in prof.stacks.items():
        key = tuple(f for f in st if not f.endswith("_[k]"))
        user[key] = user.get(key, 0) + n
    leaf = {st: n for st, n in user.items() if st and st[-1] == "leaf"}
    whole = sum(n for st, n in leaf.items()
                if st[0] == "_start" and [f for f in st if f in ("main", "level_a", "level_b", "level_c", "leaf")]
                == ["main", "level_a", "level_b", "level_c", "leaf"])
    assert sum(leaf.values()) >= 50, user
    assert whole / sum(leaf.values()) >= 0.95, sorted(user.items(), key=lambda kv: -kv[1])[:4]


def test_metrics_over_http_match_the_files(daemon: Running) -> None:
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool (Debian prometheus)")
    def written() -> tuple[int, int, int]:
        """(files, their bytes with sidecars, samples in their sidecars)"""
        files = [f for f in (daemon.dir / "profiles").glob("itest-*.folded") if not f.is_symlink()]
        size = sum(f.stat().st_size + f.with_suffix(".json").stat().st_size for f in files)
        return len(files), size, sum(json.loads(f.with_suffix(".json").read_text())["samples"] for f in files)

    # The daemon keeps draining (every second) and may rotate (each minute) while we look:
    # the scrape must lie between what the files held at a flush before it and a flush after it.
    assert request(daemon.sock, {"request": "flush"})["file"]  # a drain at least, even if this test runs alone
    assert request(daemon.sock, {"request": "flush"})["file"]
    before = written()
    st = request(daemon.sock, {"request": "status"})["status"]
    with urllib.request.urlopen(f"http://{st['metrics']}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert request(daemon.sock, {"request": "flush"})["file"]
    after = written()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            values[k] = float(v)
    assert before[0] <= values["flamed_files_written_total"] == values["flamed_disk_files"] <= after[0] - 1
    assert before[1] <= values["flamed_disk_bytes"] <= after[1]
    # every sample the daemon counted is in a file (up to the drains after the scrape)
    assert before[2] <= values["flamed_samples_total"] <= after[2]
    # a gauge of the last drain, which may have been the flush's drain a moment ago
    assert 0 <= values['flamed_bpf_map_fill_ratio{map="counts"}'] <= 1
    assert values["flamed_drains_total"] >= 2
    assert values["flamed_symbolize_duration_seconds_count"] >= 1
    # every process it sampled had its memory map read at its first sample
    assert values['flamed_processes_primed_total{result="primed"}'] >= 1
    assert 'flamed_processes_primed_total{result="gone"}' in values
    # user stacks unwound from .eh_frame tables (the default), with their memory reported
    assert values['flamed_unwind_stacks_total{result="complete"}'] >= 1
    assert 0 < values['flamed_unwind_table_rows{state="used"}'] <= values['flamed_unwind_table_rows{state="capacity"}']
    assert values["flamed_unwind_binaries"] >= 1 and values["flamed_unwind_processes"] >= 1
    assert 'flamed_unwind_stacks_total{result="depth_limit"}' in values
    # ... and in `flamed status`
    assert st["unwind"]["stacks"]["complete"] >= 1 and st["unwind"]["rows"]["used"] >= 1
    out = subprocess.run([sys.executable, "-m", "flamed", "status", "--socket", daemon.sock], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert re.search(r"^unwind +\d+\.\d % complete", out.stdout, re.M), out.stdout
    # Start-up by phase and memory by part, in status and metrics.
    su = st["startup"]
    for part in ("state_dir_s", "sampler_s", "sampler_compile_s", "sampler_attach_s", "processors_s", "servers_s"):
        assert 0 <= su[part] <= su["ready_s"], su
        assert values[f'flamed_startup_seconds{{part="{part.removesuffix("_s")}"}}'] == pytest.approx(su[part], abs=1e-3)
    assert su["sampler_compile_s"] > 0.01, su  # the verifier at least: never free
    assert su["sampler_s"] + su["processors_s"] + su["servers_s"] + su["state_dir_s"] <= su["ready_s"] + 0.01, su
    mem = st["memory"]
    assert mem["rss"] >= mem["anon"] + mem["compiler"] > 0, mem
    assert mem["bpf_maps"] > 0, mem  # its count, stack and Python maps
    for part in ("rss", "anon", "compiler", "files", "bpf_maps"):
        assert values[f'flamed_memory_bytes{{part="{part}"}}'] > 0 or part == "compiler", values
    assert re.search(r"^start-up +ready in \d+\.\d\d s \(.*BPF program (from the cache|compiled in a child) \d",
                     out.stdout, re.M), out.stdout
    assert st["program_from"] in ("cache", "child"), st["program_from"]  # never compiled in the daemon
    assert re.search(r"^memory +\d+ MB resident: \d+ MB anonymous", out.stdout, re.M), out.stdout


def test_sigterm_writes_the_last_partial_window_and_nothing_is_lost(daemon: Running) -> None:
    time.sleep(1.5)
    t_stop = time.time_ns()
    daemon.proc.send_signal(signal.SIGTERM)
    _, err = daemon.proc.communicate(timeout=60)
    assert daemon.proc.returncode == 0, err
    files = sorted(f for f in (daemon.dir / "profiles").glob("itest-*.folded") if not f.is_symlink())
    assert len(files) >= 3  # two flushes, and the partial window written at SIGTERM
    weight = samples = 0
    for f in files:
        meta = json.loads(f.with_suffix(".json").read_text())
        with open_input(f) as fh:
            prof = read_folded(fh)
        assert prof.total() == meta["weight"]
        weight += meta["weight"]
        samples += meta["samples"] - meta["lost"].get("map_full", 0)
    metas = {f: json.loads(f.with_suffix(".json").read_text()) for f in files}
    newest = max(files, key=lambda f: metas[f]["end_ns"])
    assert metas[newest]["end_ns"] >= t_stop
    m = re.search(r"the BPF program counted (\d+) samples since start; (\d+) went into windows", err)
    assert m is not None, err
    # drain totals equal the BPF program's own counter; the files hold every counted sample
    assert int(m.group(1)) == int(m.group(2)) == samples + sum(
        json.loads(f.with_suffix(".json").read_text())["lost"].get("map_full", 0) for f in files)
    assert weight == samples
    with open_input(newest) as fh:
        assert any(f"flamed_busy-{daemon.busy_pid}" == s[0] for s in read_folded(fh).stacks)


def test_runs_with_exactly_the_units_capabilities(tmp_path: Path) -> None:
    need(have_root(), "root")
    need(have_bcc(), "bcc")
    need(shutil.which("setpriv") is not None, "setpriv (util-linux)")
    unit = (ROOT / "systemd" / "flamed.service").read_text()
    m = re.search(r"^CapabilityBoundingSet=(.*)$", unit, re.M)
    assert m is not None
    caps = ",".join("+" + c.lower().removeprefix("cap_") for c in m.group(1).split())
    exe = _build_busy(tmp_path)
    busy = subprocess.Popen([str(exe), "busy", "300"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    # root's uid with only the unit's bounding set, no new privileges: what systemd gives the service
    p = subprocess.Popen(["setpriv", f"--bounding-set=-all,{caps}", "--inh-caps=-all", "--no-new-privs",
                          sys.executable, "-m", "flamed", "daemon", "--config", str(_config(tmp_path))],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == b"ready"
        _wait_socket(p, tmp_path / "flamed.sock")
        status = Path(f"/proc/{p.pid}/status").read_text()
        bnd = int(re.search(r"^CapBnd:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]
        ours = int(re.search(r"^CapBnd:\s*([0-9a-f]+)$", Path("/proc/self/status").read_text(), re.M)
                   .group(1), 16)  # type: ignore[union-attr]
        bits = {"CAP_CHOWN": 0, "CAP_SYS_PTRACE": 19, "CAP_SYS_RESOURCE": 24, "CAP_SYSLOG": 34, "CAP_PERFMON": 38,
                "CAP_BPF": 39, "CAP_CHECKPOINT_RESTORE": 40}
        # exactly the unit's set (minus what this machine's own bounding set lacks)
        assert bnd == sum(1 << bits[c] for c in m.group(1).split()) & ours
        prof = _wait_samples(str(tmp_path / "flamed.sock"), busy.pid, 50)
        assert prof.total() >= 50
        assert any([f for f in s if f in BUSY] == BUSY for s in prof.stacks)
    finally:
        busy.kill()
        busy.wait(timeout=10)
        p.send_signal(signal.SIGTERM)
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
    assert p.returncode == 0


def test_status_before_the_first_drain_says_unwinding_is_on(tmp_path: Path) -> None:
    """`flamed status` right after start (what `make run` prints first): with
    unwinding on (the default) and no drain yet, the row said "off
    (frame-pointer user stacks)"."""
    need(have_root(), "root (BPF)")
    need(have_bcc(), "bcc (python3-bpfcc)")
    cfg = tmp_path / "flamed.toml"
    sock = tmp_path / "flamed.sock"
    cfg.write_text(f"""
[sampling]
drain_interval = 3600.0
unwind_cache_dir = ""
[output]
state_dir = "{tmp_path / 'profiles'}"
rotate_interval = 3600.0
[snapshot]
ring_seconds = 3600.0
[metrics]
address = ""
[control]
socket = "{sock}"
[log]
target = "stderr"
[processors.python]
enabled = false
""")
    proc = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        st = wait_daemon_answers(sock, proc)
        assert st["windows"] == 0 and st["unwind"] is None
        out = subprocess.run([sys.executable, "-m", "flamed", "status", "--socket", str(sock)], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert re.search(r"^unwind +on, no drain yet$", out.stdout, re.M), out.stdout
        assert st["unwind_configured"] is True  # what the row is told by (status --json)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _daemon_tables(sock: str, sampling: dict[str, Any], output: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A daemon's config: ``sampling`` and ``output``, metrics on an ephemeral port,
    the control socket at ``sock``, the log on stderr, mixed mode off."""
    return {"sampling": sampling, "output": output, "metrics": {"address": "127.0.0.1:0"},
            "control": {"socket": sock}, "log": {"target": "stderr"}, "processors.python": {"enabled": False}}


def _compiler_children(pid: int) -> list[int]:
    """Processes of ``pid`` running the BPF compile (python -m flamed.sampling.bpfimage)."""
    out = []
    for child in child_pids(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"flamed.sampling.bpfimage" in cmd:
            out.append(child)
    return out


def _wait_for(what: str, cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)


def test_sampling_reload_keeps_draining_the_old_sampler_while_the_new_one_compiles(tmp_path: Path) -> None:
    """A [sampling] reload compiles the new program while the old one keeps being drained:
    with the compile held (its child process stopped), windows and files keep coming,
    and once it is done the files still hold exactly what the BPF programs counted."""
    need(have_root(), "root (BPF and perf events need CAP_BPF/CAP_PERFMON)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    cfg = tmp_path / "flamed.toml"
    state = tmp_path / "profiles"
    sock = str(tmp_path / "flamed.sock")

    def write(freq: int) -> None:
        # bpf_cache_dir empty: every program is compiled, in a child process
        write_config(cfg, _daemon_tables(
            sock, {"frequency": freq, "drain_interval": 0.5, "bpf_cache_dir": "",
                   "unwind_cache_dir": str(tmp_path / "uw")},
            {"state_dir": str(state), "rotate_interval": 60.0, "host": "reload", "fsync": False}))

    write(99)
    log = (tmp_path / "daemon.log").open("w+")
    p = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)],
                         stderr=log, text=True, cwd=ROOT)
    stopped: list[int] = []
    try:
        wait_daemon_answers(sock, p, 120)

        def status() -> dict:
            return request(sock, {"request": "status"}, timeout=30)["status"]

        def logged() -> str:
            return (tmp_path / "daemon.log").read_text()

        # The reload's compile, caught in its child and held there (a few tries: a
        # compile that ends before it is seen leaves nothing to hold).
        for attempt, freq in enumerate((49, 99, 49)):
            reloads = logged().count("reloaded configuration")
            write(freq)
            p.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 120
            while not stopped and time.monotonic() < deadline and logged().count("reloaded configuration") == reloads:
                for child in _compiler_children(p.pid):
                    os.kill(child, signal.SIGSTOP)
                    stopped.append(child)
                time.sleep(0.005)
            if stopped:
                break
            _wait_for("the reload", lambda: logged().count("reloaded configuration") > reloads, 120)
        assert stopped, "the reload's compile ended before it could be held, three times"
        # while the new program cannot be ready: the old sampler is drained on its grid,
        # and a flush writes its file
        w0 = status()["windows"]
        _wait_for("windows of the old sampler during the compile", lambda: status()["windows"] >= w0 + 3, 30)
        head = request(sock, {"request": "flush"}, timeout=30)
        assert head.get("file"), head
        for child in stopped:
            os.kill(child, signal.SIGCONT)
        stopped.clear()
        _wait_for("the reload to finish", lambda: logged().count("reloaded configuration") > reloads, 120)
        assert status()["frequency"] == freq
        request(sock, {"request": "flush"}, timeout=30)
        text = urllib.request.urlopen(f"http://{status()['metrics']}/metrics", timeout=30).read().decode()
        written = sum(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("flamed_samples_written_total "))
        samples = weight = 0
        for meta_path in state.glob("reload-*.json"):
            meta = json.loads(meta_path.read_text())
            samples += meta["samples"]
            weight += meta["weight"]
        assert samples == weight == written > 0, (samples, weight, written)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        out = logged()
        m = re.search(r"the BPF program counted (\d+) samples since start; (\d+) went into windows", out)
        assert m and m.group(1) == m.group(2), out[-3000:]
        assert "this is a bug" not in out, out[-3000:]
    finally:
        for child in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        log.close()


SWITCHY = textwrap.dedent("""
    import random, sys, threading, time

    def make(i):
        def f(depth):
            if depth:
                return fns[(i + depth) % len(fns)](depth - 1)
            time.sleep(0.0002)  # off the CPU, at the end of a Python stack of its own
        f.__name__ = f.__qualname__ = f"switchy_{i}"
        return f

    fns = [make(i) for i in range(8)]
    end = time.monotonic() + float(sys.argv[1])

    def run(seed):
        rnd = random.Random(seed)
        while time.monotonic() < end:
            fns[rnd.randrange(8)](rnd.randrange(30))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
""")


def test_python_map_full_with_off_cpu_is_a_share_of_its_walks(tmp_path: Path) -> None:
    """With off_cpu on, the Python walker runs at each switch off the CPU too, and its full
    map counts those walks: the log gives them as a share of all the walks (it gave them
    as a share of the CPU samples alone: "247% of the last window's samples")."""
    need(have_root(), "root (BPF and perf events need CAP_BPF/CAP_PERFMON)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    comm = "flamedswitchy"
    interp = tmp_path / comm
    os.symlink(os.path.realpath(sys.executable), interp)
    script = tmp_path / "switchy.py"
    script.write_text(SWITCHY)
    cfg = tmp_path / "flamed.toml"
    sock = str(tmp_path / "flamed.sock")
    write_config(cfg, _daemon_tables(
        sock, {"frequency": 99, "drain_interval": 0.5, "comms": [comm], "off_cpu": True, "off_cpu_min_us": 0,
               "python_stack_map_size": 16, "unwind_cache_dir": str(tmp_path / "uw")},
        {"state_dir": str(tmp_path / "profiles"), "rotate_interval": 60.0, "fsync": False}))
    log_path = tmp_path / "daemon.log"
    with log_path.open("w") as log:
        p = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)],
                             stderr=log, text=True, cwd=ROOT)
        try:
            wait_daemon_answers(sock, p, 120)
            work = subprocess.run([str(interp), str(script), "4"], timeout=120)
            assert work.returncode == 0
            _wait_for("the map-full warning", lambda: "Python stacks is full" in log_path.read_text(), 30)
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
    lines = [ln for ln in log_path.read_text().splitlines() if "Python stacks is full" in ln]
    assert lines
    for ln in lines:
        m = re.search(r"full: (\d+) Python stack walks \(([\d.]+)% of the last window's (\d+), at samples and "
                      r"at switches off the CPU\)", ln)
        assert m, ln
        n, share, walks = int(m.group(1)), float(m.group(2)), int(m.group(3))
        assert 0 < n <= walks and share <= 100.0, ln
