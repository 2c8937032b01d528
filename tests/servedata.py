"""A daemon state directory written by the daemon's own store (flamed.daemon.store),
with a workload that changes function half-way: ``func_a`` first, ``func_b`` after."""

from __future__ import annotations

from pathlib import Path

from flamed.daemon.config import OutputConfig, RetentionConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.store import ProfileStore

NS = 1_000_000_000
T0 = 1_700_000_040 * NS - (1_700_000_040 * NS) % (60 * NS)  # a minute boundary


def write_state_dir(path: Path, files: int = 10, *, per_window: int = 97, t0: int = T0,
                    stacks_per_phase: int = 1, root_frame: str = "pid", window_s: int = 1) -> list[Path]:
    """``files`` one-minute files of ``window_s`` windows; the first half runs func_a, the rest func_b.

    Thread 4242 runs the function, thread 4243 of the same process ``common``.
    """
    store = ProfileStore(OutputConfig(state_dir=str(path), fsync=False, host="testhost", root_frame=root_frame),
                         RetentionConfig(max_files=0, max_bytes=0, max_age=0), DaemonMetrics(process=False),
                         clock_ns=lambda: t0)
    written = []
    for i in range(files):
        func = "func_a" if i < files // 2 else "func_b"
        for j in range(0, 60, window_s):
            start = t0 + (i * 60 + j) * NS
            counts = {}
            for k in range(stacks_per_phase):
                counts[(4242, 4242, "work", ("main", "run", f"{func}_{k}" if k else func, "sys_read_[k]"))] = per_window
                counts[(4242, 4243, "work", ("main", "loop (app/loop.py:12)", "common"))] = 3
            store.add(start, start + window_s * NS, counts, sum(counts.values()), {}, 99.0)
        p = store.rotate()
        assert p is not None
        written.append(Path(p))
    return written
