"""Faults the daemon must survive with nothing lost: a real daemon, real BPF, real files.

SIGTERM mid-window, SIGKILL at random points (also mid-write and mid-snapshot),
a full disk, BPF map pressure and an invalid config on SIGHUP.  Every wait is
bounded; every daemon and workload is killed in ``finally`` (fixtures).
``FLAMED_FAULT_SCALE`` scales the number of runs (1 = the issue's figures).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import scaled, write_config
from daemonproc import BUSY, check_state_dir, metric_value, profile_files, tmpfs, workload

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

FIGURES = Path(os.environ.get("FLAMED_FIGURES_DIR", Path(__file__).resolve().parents[2] / "tests" / "artifacts"))


def record_figure(name: str, value: Any) -> None:
    """Keep a measured figure for docs/reliability.md (tests/artifacts/reliability.json).
    Tests on several workers write it at once: under a lock, replaced whole."""
    import fcntl

    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / "reliability.json"
    with open(FIGURES / ".reliability.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            data = {}
        data[name] = value
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


def bpf_total_from_log(text: str) -> int | None:
    m = re.findall(r"BPF program counted (\d+) samples since start", text)
    return int(m[-1]) if m else None


# ---------------------------------------------------------------------------
# SIGTERM


def test_sigterm_mid_window_loses_nothing(require_bpf: None, daemon_factory: Any) -> None:
    with workload(BUSY, 2):
        d = daemon_factory()
        # Let two files rotate, then stop in the middle of a window (drain grid is 1 s).
        d.wait_for(lambda: d.status()["files"]["count"] >= 1, 20, "a first file")
        frac = time.time() % 1.0
        time.sleep((1.5 - frac) % 1.0 or 0.5)  # ~half a second into a window
        t_stop = time.time_ns()
        d.signal(signal.SIGTERM)
        rc = d.wait_exit(60)
    log = d.log()
    assert rc == 0, log[-3000:]
    tot = check_state_dir(d.state_dir)
    assert tot["temps"] == [], f"temp files left: {tot['temps']}"
    assert tot["weight"] > 0
    # Per window, the program's own sample counter equals what was written (+ samples it could not key).
    assert tot["samples"] == tot["weight"] + tot["lost"].get("map_full", 0), tot
    # The last file holds the partial window up to the signal.
    last = max(profile_files(d.state_dir), key=lambda p: p.stat().st_mtime)
    meta = json.loads(last.with_name(re.sub(r"\.folded(\.gz)?$", ".json", last.name)).read_text())
    assert meta["end_ns"] >= t_stop - 50_000_000, (meta["end_ns"], t_stop)
    # And the never-reset counter of the BPF program (all samples since attach) is all in the files.
    bpf_total = bpf_total_from_log(log)
    assert bpf_total is not None, "the daemon must log 'BPF program counted N samples' when it stops:\n" + log[-2000:]
    assert bpf_total == tot["samples"], (bpf_total, tot)
    record_figure("sigterm", {"bpf_samples": bpf_total, "written_weight": tot["weight"],
                              "map_full": tot["lost"].get("map_full", 0), "difference": bpf_total - tot["samples"]})


# ---------------------------------------------------------------------------
# SIGKILL at random points


def _kill_when_temp_file_appears(d: Any, timeout: float) -> bool:
    """Spin on the state directory; SIGKILL the moment a write is in flight (a .tmp exists)."""
    deadline = time.monotonic() + timeout
    state = str(d.state_dir)
    while time.monotonic() < deadline:
        try:
            names = os.listdir(state)
        except FileNotFoundError:
            names = []
        if any(n.endswith(".tmp") for n in names):
            os.kill(d.pid, signal.SIGKILL)
            return True
    return False


def _older_than(state_dir: Any, names: list[str], t: float) -> list[str]:
    """The temp files among ``names`` last written before ``t`` (before the
    restart: left by the killed daemon); one that is gone already is not."""
    out = []
    for n in names:
        try:
            if os.stat(Path(state_dir) / n).st_mtime < t:
                out.append(n)
        except FileNotFoundError:
            pass
    return out


@pytest.mark.timeout(120 + 45 * scaled(20, 4))  # a BPF daemon start takes 5-20 s on a loaded machine
def test_sigkill_random_points_then_restart(require_bpf: None, daemon_factory: Any) -> None:
    runs = scaled(20, 4)
    rng = random.Random(int(os.environ.get("FLAMED_FAULT_SEED", "20261202")))
    modes = ["random", "mid_write", "mid_snapshot", "at_rotation"]
    kept = 4
    d = daemon_factory(
        start=False,
        sampling={"frequency": 99, "drain_interval": 0.5},
        output={"rotate_interval": 1.0, "fsync": True},
        retention={"max_files": kept, "max_bytes": 0, "max_age": 0},
    )
    stats: dict[str, int] = {m: 0 for m in modes}
    stats.update(hit_mid_write=0, temps_after_kill=0, orphans_after_kill=0)
    files_before: list[int] = []
    with workload(BUSY, 1):
        for run in range(runs):
            mode = modes[run % len(modes)]
            restarted = time.time()
            d.start()
            # After a restart: every file parses, sidecars agree, retention holds.
            tot = check_state_dir(d.state_dir)
            left = _older_than(d.state_dir, tot["temps"], restarted)
            assert left == [], f"run {run}: temp files survived recovery: {left}"
            assert tot["files"] <= kept, f"run {run}: {tot['files']} files, retention keeps {kept}"
            files_before.append(d.status()["files"]["count"])
            # The daemon carries on: it writes a new file after the restart.
            written0 = d.status()["files"]["latest"]
            d.wait_for(lambda: d.status()["files"]["latest"] not in (None, written0), 10, f"run {run}: a new file")
            stats[mode] += 1
            if mode == "random":
                time.sleep(rng.uniform(0.0, 1.5))
                d.kill9()
            elif mode == "mid_write":
                hit = _kill_when_temp_file_appears(d, 5.0)
                stats["hit_mid_write"] += hit
                if not hit:
                    d.kill9()
                d.proc.wait(30)
            elif mode == "mid_snapshot":
                errs: list[BaseException] = []

                def snap() -> None:
                    try:
                        d.request({"request": "snapshot", "next": 1.0, "format": "svg"}, timeout=10)
                    except BaseException as e:  # noqa: BLE001 - the daemon dies under it
                        errs.append(e)

                t = threading.Thread(target=snap)
                t.start()
                time.sleep(rng.uniform(0.2, 1.2))
                d.kill9()
                t.join(15)
                assert not t.is_alive(), "the snapshot client hung after the daemon died"
            else:  # at_rotation: within a few ms of a file boundary (1 s grid)
                time.sleep(1.0 - time.time() % 1.0 + rng.uniform(0.0, 0.02))
                d.kill9()
            d.log_fh.close()
            # The crash state itself: only temp files or an orphan sidecar may be incomplete;
            # every complete-looking file is complete.
            crash = check_state_dir(d.state_dir, allow_orphans=True)
            stats["temps_after_kill"] += len(crash["temps"])
            stats["orphans_after_kill"] += len(crash["orphans"])
        # A last restart proves the state directory of the final kill is clean, and the daemon works.
        restarted = time.time()
        d.start()
        tot = check_state_dir(d.state_dir)
        # the new daemon writes a file a second: a temp it is writing now is not the crash's
        assert _older_than(d.state_dir, tot["temps"], restarted) == []
        assert tot["files"] <= kept
        # Something on a CPU to sample: a quiet host may give the new daemon
        # nothing in its first second (the daemon leaves itself out).
        with workload(BUSY, 1):
            time.sleep(1.5)
            head, payload = d.request({"request": "snapshot", "seconds": 5, "format": "folded"})
        assert head["ok"] and payload
    log = d.log()
    assert "Traceback" not in log, log[-3000:]
    record_figure("sigkill", {"runs": runs, "modes": stats, "corrupt_files": 0})


# ---------------------------------------------------------------------------
# Disk full


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    mnt = tmp_path / "state"
    mnt.mkdir()
    with tmpfs(mnt, "96k"):
        yield mnt


def test_disk_full_keeps_sampling_and_writes_again(require_bpf: None, daemon_factory: Any,
                                                   small_tmpfs: Path) -> None:
    budget = 256 * 1024
    with workload(BUSY, 2):
        d = daemon_factory(
            sampling={"frequency": 99, "drain_interval": 0.5},
            output={"state_dir": str(small_tmpfs), "rotate_interval": 1.0, "backlog_max_bytes": budget},
            retention={"max_files": 0, "max_bytes": 0, "max_age": 0},
        )
        # Fill what is left of the filesystem with a ballast file, as another program would.
        ballast = small_tmpfs / "ballast"
        with open(ballast, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        d.wait_for(lambda: d.metric("flamed_write_errors_total", {"errno": "ENOSPC"}) > 0, 20, "an ENOSPC write error")
        s0 = d.status()
        assert s0["write_error"] and "space" in s0["write_error"].lower(), s0["write_error"]
        # Keeps sampling while the disk is full; memory stays within the backlog budget.
        rss0 = d.rss_bytes()
        d.wait_for(lambda: d.status()["samples"] > s0["samples"] + 100, 20, "samples while the disk is full")
        time.sleep(4)
        s1 = d.status()
        assert s1["backlog"]["files"] >= 1 and s1["backlog"]["bytes"] <= budget + 128 * 1024, s1["backlog"]
        rss1 = d.rss_bytes()
        # Snapshots come from memory.
        head, payload = d.request({"request": "snapshot", "seconds": 3, "format": "folded"})
        assert head["ok"] and head["weight"] > 0 and payload.count(b"\n") == head["stacks"]
        # Nothing half-written on the full disk.
        tot = check_state_dir(small_tmpfs)
        assert tot["temps"] == [], tot["temps"]
        log_full = d.log()
        assert re.search(r"No space left on device", log_full), log_full[-2000:]
        # Space returns (ballast deleted, filesystem grown): the backlog is written and the error clears.
        ballast.unlink()
        subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)
        d.wait_for(lambda: d.status()["backlog"]["files"] == 0 and d.status()["write_error"] is None, 20,
                   "the backlog to be written once space returned")
        s2 = d.status()
        dropped = d.metric("flamed_backlog_dropped_files_total")
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
    tot = check_state_dir(small_tmpfs)
    assert tot["temps"] == []
    # Whatever the budget had to drop is counted; everything else is on disk, exactly.
    assert tot["samples"] == tot["weight"] + tot["lost"].get("map_full", 0)
    record_figure("disk_full", {
        "backlog_budget": budget, "backlog_bytes_max_seen": s1["backlog"]["bytes"],
        "rss_growth_bytes": rss1 - rss0, "files_after_recovery": s2["files"]["count"],
        "files_dropped_over_budget": dropped,
    })


# ---------------------------------------------------------------------------
# BPF pressure: more unique stacks than the maps hold

MANY_STACKS_C = r"""
/* Every sample lands in a different call path: f0..f3 chosen by the bits of
   a pseudo-random number at each of 14 levels (4^14 paths). */
volatile unsigned long sink;
void f0(int d, unsigned x); void f1(int d, unsigned x); void f2(int d, unsigned x); void f3(int d, unsigned x);
#define BODY(n) __attribute__((noinline)) void f##n(int d, unsigned x) { \
    if (d == 0) { for (volatile int i = 0; i < 20000; i++) sink += i; return; } \
    switch (x & 3) { case 0: f0(d - 1, x >> 2); break; case 1: f1(d - 1, x >> 2); break; \
                     case 2: f2(d - 1, x >> 2); break; default: f3(d - 1, x >> 2); } \
    sink++; }
BODY(0) BODY(1) BODY(2) BODY(3)
int main(void) { unsigned x = 1; for (long i = 0; i < 400000000L; i++) { x = x * 1103515245u + 12345u; f0(14, x >> 3); } return 0; }
"""


@pytest.fixture
def many_stacks_binary(tmp_path: Path) -> Path:
    import shutil

    from support import need  # tests/conftest.py

    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev) to build the C workload")
    src = tmp_path / "manystacks.c"
    src.write_text(MANY_STACKS_C)
    out = tmp_path / "manystacks"
    subprocess.run([str(gcc), "-O0", "-fno-omit-frame-pointer", "-o", str(out), str(src)], check=True, timeout=60)
    return out


def test_a_few_stack_collisions_are_reported_without_advice(require_bpf: None, daemon_factory: Any,
                                                             many_stacks_binary: Path) -> None:
    """The issue's idle host: hundreds of stacks a window in the default 16,384-entry stack map.
    Collisions (EEXIST) happen, a bigger map would not cure them: no "raise" advice, one report."""
    p = subprocess.Popen([str(many_stacks_binary)], start_new_session=True)
    try:
        # Collisions are those of the stack-trace map, where user stacks go without unwinding
        # (unwound stacks are keyed by a 64-bit hash of their own and do not collide).
        d = daemon_factory(sampling={"frequency": 499, "drain_interval": 1.0, "unwind": False})
        # ~500 samples a window on the workload's CPU, nearly all distinct stacks: a few collide
        d.wait_for(lambda: d.metric("flamed_samples_lost_total", {"reason": "user_stack_eexist"}) > 0, 60,
                   "a stack-map collision")
        d.wait_for(lambda: d.status()["windows"] >= 4, 30, "four windows")
        assert p.poll() is None, "the workload died"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    log = d.log()
    assert "raise sampling.stack_map_size" not in log, log[-3000:]
    assert "maps are too small" not in log and "stack map is full" not in log, log[-3000:]
    reports = [ln for ln in log.splitlines() if "hash collisions (EEXIST" in ln]
    info = [ln for ln in reports if " INFO " in ln]
    assert reports and len(info) <= 1, log[-3000:]  # as information: once an hour
    # A window made long by a late drain (a loaded host) holds more distinct stacks, and
    # above 5 % of its samples the report becomes a warning: only then.
    for ln in reports:
        if ln not in info:
            m = re.search(r"\((\d+\.\d)% of the last window's (\d+) samples\)", ln)
            assert " WARNING " in ln and m is not None and float(m[1]) > 5.0, ln


def test_bpf_map_pressure_counts_losses_and_names_the_setting(require_bpf: None, daemon_factory: Any,
                                                              many_stacks_binary: Path) -> None:
    p = subprocess.Popen([str(many_stacks_binary)], start_new_session=True)
    try:
        d = daemon_factory(
            # The stack-trace map under pressure: user stacks go there without unwinding.
            sampling={"frequency": 499, "drain_interval": 1.0, "stack_map_size": 64, "counts_map_size": 64,
                      "unwind": False},
        )
        d.wait_for(lambda: d.status()["windows"] >= 6, 30, "six windows under pressure")
        text = d.metrics_text()
        st = d.status()
        assert p.poll() is None, "the workload died"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    lost = {r: metric_value(text, "flamed_samples_lost_total", {"reason": r}) for r in
            ("map_full", "kernel_stack_eexist", "user_stack_eexist", "kernel_stack_enomem", "user_stack_enomem")}
    stack_lost = sum(v for k, v in lost.items() if k != "map_full")
    assert stack_lost > 0, lost
    assert lost["map_full"] > 0, lost
    assert st["lost"], st["lost"]
    log = d.log()
    # The warning says which setting to raise.
    assert "sampling.stack_map_size" in log, log[-2000:]
    assert "sampling.counts_map_size" in log, log[-2000:]
    # It keeps its schedule and does not crash: drains on time, fast.
    drains = metric_value(text, "flamed_drains_total")
    assert drains >= 6
    late_sum = metric_value(text, "flamed_drain_lateness_seconds_sum")
    late_n = metric_value(text, "flamed_drain_lateness_seconds_count")
    dur_sum = metric_value(text, "flamed_drain_duration_seconds_sum")
    assert dur_sum / drains < 1.0, "a drain took longer than the drain interval"
    assert "Traceback" not in log, log[-3000:]
    # The accounting still holds: every sample is a count or a counted loss.
    assert d.alive()
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    tot = check_state_dir(d.state_dir)
    assert tot["samples"] == tot["weight"] + tot["lost"].get("map_full", 0)
    record_figure("bpf_pressure", {"lost_by_reason": lost, "drains": drains,
                                   "mean_drain_lateness_s": late_sum / max(late_n, 1),
                                   "mean_drain_s": dur_sum / drains, "samples_written": tot["weight"]})


#: Python with many distinct stacks: 30 functions (distinct code objects) calling
#: each other at random, 5 deep.
MANY_PY_STACKS = """
import random
def make(i):
    def f(d):
        if d == 0:
            return sum(range(3000))
        return FUNCS[random.randrange(len(FUNCS))](d - 1)
    f.__code__ = f.__code__.replace(co_name=f"f{i}")
    return f
FUNCS = [make(i) for i in range(30)]
while True:
    FUNCS[0](5)
"""


def test_a_full_python_stack_map_names_its_setting(require_bpf: None, daemon_factory: Any) -> None:
    import sys

    p = subprocess.Popen([sys.executable, "-c", MANY_PY_STACKS], start_new_session=True)
    try:
        d = daemon_factory(sampling={"frequency": 199, "drain_interval": 1.0, "python_stack_map_size": 16},
                           processors__python={"enabled": True, "source": "bpf"})
        d.wait_for(lambda: "raise sampling.python_stack_map_size" in d.log(), 60,
                   "the warning naming sampling.python_stack_map_size")
        text = d.metrics_text()
        assert p.poll() is None, "the workload died"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    line = next(ln for ln in d.log().splitlines() if "raise sampling.python_stack_map_size" in ln)
    assert "the BPF map of Python stacks is full" in line and "(now 16)" in line, line
    assert metric_value(text, "flamed_python_bpf_samples_total", {"result": "stacks_full"}) > 0


# ---------------------------------------------------------------------------
# Config errors on SIGHUP


def test_invalid_config_on_sighup_keeps_running_config(require_bpf: None, daemon_factory: Any) -> None:

    d = daemon_factory(sampling={"frequency": 49, "drain_interval": 1.0})
    good = d.status()
    assert good["frequency"] == 49
    bad_cases = [
        ("sampling.frequency", lambda c: c["sampling"].update(frequency=100000)),
        ("output.rotatte_interval", lambda c: c["output"].update(rotatte_interval=5)),
        ("retention.max_bytes", lambda c: c.setdefault("retention", {}).update(max_bytes="lots")),
    ]
    import copy

    for i, (key, mutate) in enumerate(bad_cases, 1):
        cfg = copy.deepcopy(d.config)
        mutate(cfg)
        write_config(d.cfg_path, cfg)
        n0 = d.log().count("keeping the running one")
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: d.log().count("keeping the running one") > n0, 15, f"the reload error for {key}")
        line = [ln for ln in d.log().splitlines() if "keeping the running one" in ln][-1]
        assert key.split(".")[-1] in line, f"the log line does not name {key}: {line}"
        st = d.status()
        assert st["frequency"] == 49 and st["config"] == good["config"]
        assert d.metric("flamed_config_reloads_total", {"result": "error"}) == i
        # Still sampling after the refused reload.
        w0 = st["windows"]
        d.wait_for(lambda: d.status()["windows"] > w0, 10, "a drain after the refused reload")
    # A valid change then applies.
    cfg = copy.deepcopy(d.config)
    cfg["sampling"]["frequency"] = 29
    write_config(d.cfg_path, cfg)
    d.signal(signal.SIGHUP)
    # The control thread may answer between the new config taking effect and the
    # reload being counted (the daemon gives back compiler memory in between).
    d.wait_for(lambda: d.status()["frequency"] == 29
               and d.metric("flamed_config_reloads_total", {"result": "ok"}) == 1, 60, "the valid reload")
    assert d.metric("flamed_config_reloads_total", {"result": "error"}) == len(bad_cases)
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    tot = check_state_dir(d.state_dir)
    assert tot["samples"] == tot["weight"] + tot["lost"].get("map_full", 0)


def test_a_burst_of_signals_never_hangs_the_loop(require_bpf: None, daemon_factory: Any) -> None:
    """SIGHUPs sent as fast as a script can (a config tool in a loop, a flapping
    reload unit): every one lands between two bytecodes of the main loop, its
    sleep included.  The handler once set a threading.Event there; landing while
    the loop held that Event's lock, it waited on it forever, and the daemon
    stopped draining (within 600 and 2,000 signals in two runs).  Now the loop
    keeps answering, and a SIGTERM at the end stops it cleanly."""
    d = daemon_factory(sampling={"frequency": 19, "drain_interval": 1.0})
    import copy

    cfg = copy.deepcopy(d.config)
    cfg["sampling"]["frequency"] = 100000  # refused: each reload is quick and logs one line
    write_config(d.cfg_path, cfg)
    rng = random.Random(7)

    def refused() -> int:
        return d.log().count("keeping the running one")

    sent = 0
    for _ in range(12):
        for _ in range(250):
            d.signal(signal.SIGHUP)
            sent += 1
            time.sleep(rng.random() * 0.003)
        # The loop still turns: one more reload is logged (the burst's own may coalesce).
        n0 = refused()
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: refused() > n0, 15, f"a reload after {sent} SIGHUPs (the main loop hung)")
    assert d.alive()
    w0 = d.status()["windows"]
    d.wait_for(lambda: d.status()["windows"] > w0, 15, "a drain after the burst")
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    assert "SIGTERM: draining and writing the last window" in d.log()
