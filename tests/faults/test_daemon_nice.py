"""[sampling] nice: start-up at the nice the daemon was started with, every thread at
``nice`` once it is ready (docs/configuration.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.concurrent


def _nices(pid: int) -> dict[int, int]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{t}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        # Field 19 is the nice value; the comm (field 2) may hold spaces.
        out[int(t)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_every_thread_takes_the_nice_once_ready(daemon_factory: Any) -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(start + 7, 19)
    d = daemon_factory(sampling={"sampler": "fake", "nice": want})
    d.wait_for(lambda: d.status()["windows"] >= 1, 30, "a first window")
    nices = _nices(d.pid)
    assert len(nices) > 1, nices  # the daemon runs threads: each has its own nice
    assert set(nices.values()) == {want}, nices
    assert "sampling.nice" not in d.log()  # no warning


def test_a_bad_nice_is_a_config_error(daemon_factory: Any) -> None:
    d = daemon_factory(start=False, sampling={"sampler": "fake", "nice": 25})
    d.start(wait=False)
    assert d.wait_exit(30) == 2
    assert "sampling.nice" in d.log()
