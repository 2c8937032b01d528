"""Fixtures of the fault and security suite: daemons that are always killed."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import DaemonProc, base_config

#: Scale of the fault runs: 1.0 is the issue's figure (20 kills, 1,000 churn
#: processes...); CI may lower it, a bench run raise it.
SCALE = float(os.environ.get("FLAMED_FAULT_SCALE", "0.25"))


def need(condition: bool, what: str) -> None:
    """tests/conftest.py's need(), reachable from here (both files are named conftest)."""
    if condition:
        return
    if os.environ.get("FLAMED_REQUIRE_BPF") == "1":
        pytest.fail(f"required capability missing: {what}", pytrace=False)
    pytest.skip(f"missing: {what}")


def scaled(n: int, minimum: int = 1) -> int:
    return max(minimum, int(round(n * SCALE)))


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    made: list[DaemonProc] = []

    def make(name: str = "daemon", start: bool = True, **over: Any) -> DaemonProc:
        kw = {k: over.pop(k) for k in ("argv_prefix", "env", "preexec_fn") if k in over}
        d = DaemonProc(tmp_path, base_config(tmp_path, **over), name=name, **kw)
        made.append(d)
        if start:
            d.start()
        return d

    try:
        yield make
    finally:
        for d in made:
            d.cleanup()
