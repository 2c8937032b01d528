"""Helpers to run a daemon inside a test process (used by flamed's own tests).

:func:`running_daemon` starts a :class:`~flamed.daemon.core.Daemon` in a
thread, waits for READY, yields it, then stops it and waits (bounded) for the
last window to be written.  Signals are not installed (they need the main
thread); call ``daemon.request_stop()``/``request_reload()`` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flamed.daemon.config import (
    ControlConfig,
    DaemonConfig,
    MetricsConfig,
    OutputConfig,
    SamplingConfig,
    SnapshotConfig,
)
from flamed.daemon.core import Daemon


def fast_config(tmp: Path, **sections: dict[str, Any]) -> DaemonConfig:
    """A config for a fast daemon under ``tmp``: fake sampler at 100 Hz, drain 0.1 s, files every 0.5 s."""
    base = DaemonConfig(
        sampling=SamplingConfig(sampler="fake", frequency=100, drain_interval=0.1),
        output=OutputConfig(state_dir=str(tmp / "profiles"), rotate_interval=0.5, host="testhost", fsync=False),
        snapshot=SnapshotConfig(ring_seconds=60.0),
        metrics=MetricsConfig(address="127.0.0.1:0"),
        control=ControlConfig(socket=str(tmp / "flamed.sock"), client_timeout=2.0),
    )
    repl = {name: dataclasses.replace(getattr(base, name), **values) for name, values in sections.items()}
    return dataclasses.replace(base, **repl)


@contextlib.contextmanager
def running_daemon(config: DaemonConfig, timeout: float = 60.0, **kwargs: Any) -> Iterator[Daemon]:
    d = Daemon(config, **kwargs)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            d.run()
        except BaseException as e:  # surfaced to the test below
            errors.append(e)
            d.ready.set()

    t = threading.Thread(target=run, name="test-daemon", daemon=True)
    t.start()
    if not d.ready.wait(timeout):
        d.request_stop()
        raise TimeoutError("daemon did not become ready")
    if errors:
        raise errors[0]
    try:
        yield d
    finally:
        d.request_stop()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("daemon did not stop in time")
    if errors:
        raise errors[0]
