"""Churn: 200 short-lived Python processes under mixed mode (real BPF, watcher, py-spy).

Every process that lives longer than a drain interval must come out with
Python frames, and no py-spy child may remain afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.model import Stack
from flamed.pyspy.mixed import MixedMode, MixedOptions
from flamed.pyspy.supervisor import PySpyOptions
from flamed.pyspy.watcher import PyProcess, WatchOptions
from flamed.sampling.contract import SampleEvent
from support import ROOT

pytestmark = [pytest.mark.bpf, pytest.mark.pyspy, pytest.mark.slow]

DRAIN_S = 1.0


def pyspy_children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if comm == "py-spy" and ppid == pid:
            out.append(int(d.name))
    return out


def test_churn_200_processes(tmp_path: Path, require_bpf: None, require_pyspy: str) -> None:
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions

    sampler = BpfSampler(BpfSamplerOptions(frequency=99, pids=frozenset()))
    sampler.start()
    joined: list[tuple[SampleEvent, Stack]] = []
    found: list[PyProcess] = []
    mixed: MixedMode | None = None
    churn: subprocess.Popen[bytes] | None = None
    log = tmp_path / "churn.log"
    max_running = 0
    try:
        def on_process(p: PyProcess) -> None:
            found.append(p)
            sampler.add_pid(p.pid)

        mixed = MixedMode(sampler, MixedOptions(
            pyspy=PySpyOptions(binary=require_pyspy, window_s=DRAIN_S, max_children=32),
            watch=WatchOptions(pids=frozenset(), descendants=True, scan_interval_s=1.0)), on_process=on_process)
        mixed.start()
        churn = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workloads" / "churn.py"), str(log),
                                  "200", "20", "2.5", "6"])
        mixed.follow(churn.pid)
        deadline = time.monotonic() + 150
        while churn.poll() is None and time.monotonic() < deadline:
            time.sleep(DRAIN_S / 2)
            joined += mixed.process(sampler.drain().events)
            max_running = max(max_running, mixed.metrics()["pyspy_running"])
        assert churn.poll() is not None, "churn workload did not finish in time"
        time.sleep(0.3)
        joined += mixed.process(sampler.drain().events)
    finally:
        if churn is not None and churn.poll() is None:
            churn.kill()
            churn.wait()
        if mixed is not None:
            joined += mixed.close()
        sampler.close()
    assert pyspy_children_of(os.getpid()) == []
    children = [ln.split() for ln in log.read_text().splitlines()]
    assert len(children) == 200
    # Lifetimes seen by the loaded parent are not exact; the long ones spend
    # 2.5 s in long_lived_work, more than two drain intervals.
    long_lived = [int(pid) for pid, kind, t0, t1 in children if kind == "long"]
    assert len(long_lived) >= 10
    seen = {p.pid for p in found}
    with_python = {ev.tgid for ev, stack in joined
                   if any(f.startswith("long_lived_work (") for f in stack)}
    missing = [pid for pid in long_lived if pid not in with_python]
    assert not missing, (missing, [pid in seen for pid in missing], mixed.metrics() if mixed else None)
    assert set(long_lived) <= seen
    # Children that were gone before they could be looked at are simply not
    # watched; those that died under py-spy count as target_exited, not as faults.
    assert mixed is not None
    m = mixed.supervisor.metrics()
    assert m["failed_crash"] == 0 and m["failed_timeout"] == 0, m
    assert max_running <= 32
