"""Fixtures of the fault and security suite: daemons that are always killed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import DaemonProc, base_config

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
