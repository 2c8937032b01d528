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


def write_busy_state_dir(path: Path, files: int, *, stacks_per_file: int = 700, population: int = 20_000,
                         functions: int = 3000, towers: int = 2, tower_depth: int = 905, t0: int = T0,
                         window_s: int = 10, seed: int = 22) -> list[Path]:
    """``files`` one-minute files shaped like a busy host's (issue 22: 219 files, 149 MB):
    each holds ``stacks_per_file`` stacks drawn from a ``population`` of a few
    dozen processes' stacks (depth 5..40 over ``functions`` names, about 600
    KB of folded text a file), plus ``towers`` stacks ``tower_depth`` frames
    deep (a recursion); each minute draws anew, so files share some stacks
    and the union grows with the range.  Written by the daemon's own store.
    """
    import random

    rng = random.Random(seed)
    names = [f"pkg{i % 37}.mod{i % 101}.func_{i} (pkg{i % 37}/mod{i % 101}.py:{10 + i % 900})" for i in range(functions)]
    procs = [(1000 + i, f"svc{i}") for i in range(40)]
    pop: list[tuple[int, str, tuple[str, ...]]] = []
    for _ in range(population):
        pid, comm = rng.choice(procs)
        base = pid % len(names)
        depth = rng.randint(5, 40)
        # a process's stacks share their first frames, as real ones do
        frames = tuple(names[(base + k) % len(names)] if k < 3 else rng.choice(names) for k in range(depth))
        pop.append((pid, comm, frames))
    tower = tuple(f"recurse (app/tree.py:{40 + k % 3})" for k in range(tower_depth))
    store = ProfileStore(OutputConfig(state_dir=str(path), fsync=False, host="busyhost", compress=False),
                         RetentionConfig(max_files=0, max_bytes=0, max_age=0), DaemonMetrics(process=False),
                         clock_ns=lambda: t0)
    written = []
    for i in range(files):
        chosen = rng.sample(pop, stacks_per_file)
        for j in range(0, 60, window_s):
            start = t0 + (i * 60 + j) * NS
            counts: dict[tuple[int, int, str, tuple[str, ...]], int] = {}
            for pid, comm, frames in chosen[j // window_s::60 // window_s]:
                counts[(pid, pid, comm, frames)] = rng.randint(1, 30)
            for k in range(towers):
                counts[(7000 + k, 7000 + k, "deep", ("main",) + tower + (f"leaf_{k}",))] = 50
            store.add(start, start + window_s * NS, counts, sum(counts.values()), {}, 99.0)
        p = store.rotate()
        assert p is not None
        written.append(Path(p))
    return written
