"""Which drain closes a rotation period: the drain loop with the fake sampler on a
clock the test moves, so that scheduled and forced drains (snapshots, ``flamed
record`` through the daemon) fall at chosen times; the files are real."""

from __future__ import annotations

import json
from pathlib import Path

from flamed.daemon.config import DaemonConfig, OutputConfig, SamplingConfig
from flamed.daemon.fake import FakeSampler
from flamed.daemon.loop import DrainLoop
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.notify import Notifier
from flamed.daemon.ring import WindowRing
from flamed.daemon.store import ProfileStore

S = 1_000_000_000
T0 = 1_699_999_980 * S  # 2023-11-14T22:13:00Z, a multiple of 30 s


class Clock:
    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make_loop(tmp_path: Path, clock: Clock, *, drain: float, rotate: float) -> tuple[DrainLoop, FakeSampler]:
    cfg = DaemonConfig(
        sampling=SamplingConfig(sampler="fake", frequency=100, drain_interval=drain),
        output=OutputConfig(state_dir=str(tmp_path / "p"), rotate_interval=rotate, host="h1", fsync=False),
    )
    metrics = DaemonMetrics(process=False)
    store = ProfileStore(cfg.output, cfg.retention, metrics, clock_ns=clock)
    store.ensure_dir()
    ring = WindowRing(600.0, 1 << 20, clock_ns=clock)
    loop = DrainLoop(cfg, store=store, ring=ring, metrics=metrics, notifier=Notifier(), clock_ns=clock)
    sampler = FakeSampler(100, clock_ns=clock)
    sampler.start()
    loop.sampler = sampler
    return loop, sampler


def drains_at(loop: DrainLoop, clock: Clock, times: list[float]) -> None:
    for t in times:
        clock.t = T0 + int(t * S)
        loop.drain_once()


def files(tmp_path: Path) -> list[tuple[str, float, float, int]]:
    """(name, start s, end s after T0, samples) of each file written, oldest first."""
    out = []
    for side in sorted((tmp_path / "p").glob("h1-*.json")):
        meta = json.loads(side.read_text())
        out.append((meta["file"], (meta["start_ns"] - T0) / S, (meta["end_ns"] - T0) / S, meta["samples"]))
    return out


def test_a_forced_drain_just_before_the_boundary_does_not_split_the_period(tmp_path: Path) -> None:
    """Drains every 2 s, files every 10 s: a snapshot's drain at 9.5 s (and at
    19.6 and 19.9 s) leaves the closing to the scheduled drain at the boundary,
    so each file spans its 10 s, named by its round start, and no sample is
    in two files or none."""
    clock = Clock(T0)
    loop, sampler = make_loop(tmp_path, clock, drain=2.0, rotate=10.0)
    drains_at(loop, clock, [2, 4, 6, 8, 9.5, 10, 12, 14, 16, 18, 19.6, 19.9, 20, 22])
    got = files(tmp_path)
    assert [(name, start, end) for name, start, end, _ in got] == [
        ("h1-20231114T221300Z.folded", 0.0, 10.0),
        ("h1-20231114T221310Z.folded", 10.0, 20.0),
    ]
    assert sum(n for *_, n in got) + loop.store.period.samples == sampler.produced


def test_without_a_drain_at_the_boundary_the_nearest_drain_closes_the_period(tmp_path: Path) -> None:
    """Drains every 10 s, files every 15 s: no scheduled drain falls on 15 s or
    45 s, so the one nearest closes the period (10 s, 40 s); a forced drain at
    44 s, nearer to 45 s than the scheduled one at 50 s, closes it there; one
    at 29 s leaves it to the scheduled drain at the boundary (30 s)."""
    clock = Clock(T0)
    loop, _ = make_loop(tmp_path, clock, drain=10.0, rotate=15.0)
    drains_at(loop, clock, [10, 20, 29, 30, 40, 44, 50, 52])
    assert [(start, end) for _, start, end, _ in files(tmp_path)] == [
        (0.0, 10.0), (10.0, 20.0), (20.0, 30.0), (30.0, 40.0), (40.0, 44.0), (44.0, 50.0)]


def test_the_wall_clock_going_back_does_not_stop_drains_or_files(tmp_path: Path) -> None:
    """Drains are on a wall-clock grid: after the clock stepped back an hour (NTP,
    date -s) the loop waited for the grid point planned before, an hour away,
    with no drain (the BPF maps filling) and no file meanwhile.  Now the grid
    follows the clock, and the period whose start is now in the future closes."""
    import threading
    import time

    offset = [0]
    clock = lambda: time.time_ns() + offset[0]  # noqa: E731 - the real clock, stepped by the test
    loop, sampler = make_loop(tmp_path, clock, drain=0.1, rotate=0.5)  # type: ignore[arg-type]
    t = threading.Thread(target=loop.run, args=(lambda: None,), daemon=True)
    t.start()
    try:
        def wait_drains(n: int) -> None:
            target = loop.metrics.drains._value.get() + n
            deadline = time.monotonic() + 30
            while loop.metrics.drains._value.get() < target:
                assert time.monotonic() < deadline, "no drains after the clock went back"
                time.sleep(0.02)

        wait_drains(3)
        offset[0] = -3600 * S
        wait_drains(3)
        written = loop.store.files_written
        deadline = time.monotonic() + 30
        while loop.store.files_written < written + 2:  # the period begun before the step, then a new one
            assert time.monotonic() < deadline, "no file after the clock went back"
            time.sleep(0.02)
    finally:
        loop.request_stop()
        t.join(30)
    assert not t.is_alive()
    got = files(tmp_path)
    assert sum(n for *_, n in got) + loop.store.period.samples == sampler.produced
