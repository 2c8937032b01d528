"""Waiting on a process pool's results without hanging when a worker dies.

``multiprocessing.Pool`` replaces a worker that dies (killed by the OOM
killer, or by hand) but not the task it was running: that task's result
never arrives, and ``AsyncResult.get()`` or ``Pool.map`` waits for ever.
:func:`wait_result` waits in slices and, while the result is still missing,
checks the workers the pool started with; with no ``maxtasksperchild`` none
of them ends before the pool is stopped, so one that has an exit code died.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from flamed.errors import FlamedError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Seconds between checks of the workers while a result is missing.
POLL = 0.5


class _Result(Protocol[T_co]):  # multiprocessing.pool.AsyncResult / MapResult
    def ready(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> None: ...
    def get(self, timeout: float | None = None) -> T_co: ...


def pool_workers(pool: Any) -> list[Any]:
    """The worker processes ``pool`` has now (call it right after starting the pool)."""
    return list(getattr(pool, "_pool", ()))


def wait_result(result: _Result[T], workers: Sequence[Any], *, what: str = "worker process") -> T:
    """``result.get()``, or :class:`FlamedError` as soon as one of ``workers`` has died
    while the result is still missing (its task is lost with it)."""
    while not result.ready():
        result.wait(POLL)
        if result.ready():
            break
        dead = [w for w in workers if w.exitcode is not None]
        if dead:
            code = dead[0].exitcode
            how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
            raise FlamedError(
                f"a {what} died ({how}; out of memory?) and its part of the input is lost; "
                "nothing was written: run again, or with --jobs 1"
            )
    return result.get()


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"
