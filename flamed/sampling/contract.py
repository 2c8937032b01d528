"""The contract between a stack sampler (the BPF one, or a fake in tests) and
its consumers (the daemon, mixed mode, ``flamed record``).

A sampler counts stacks per task between drains.  ``drain()`` returns one
:class:`Window`: everything counted since the previous drain, exactly once.
For pids that are *watched* (Python processes in mixed mode) it returns
individual timestamped :class:`SampleEvent` records instead of counts, so they
can be joined with Python frames by time; those samples are not also counted.

Stacks are root first.  Kernel frames carry the ``_[k]`` suffix.  A frame that
could not be symbolized is ``[unknown]`` or ``[unknown] (module)`` when the
module is known.  A sample whose stack could not be walked keeps a visible
placeholder (``[missing user stack]``, ``[missing kernel stack]``,
``[lost stack: ENOMEM]``...), never silently disappears.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from flamed.model import Profile, Stack, task_frame

#: (tgid, tid, comm, stack) -> sample count
CountKey = tuple[int, int, str, Stack]


@dataclass(frozen=True, slots=True)
class SampleEvent:
    """One sample of a watched task. ``ktime_ns`` is CLOCK_MONOTONIC (bpf_ktime_get_ns)."""

    ktime_ns: int
    tgid: int
    tid: int
    comm: str
    user_stack: Stack  # root first, symbolized
    kernel_stack: Stack  # root first, each frame ending in _[k]
    cpu: int = -1


@dataclass
class Window:
    """What one drain returns.

    ``start_ns``/``end_ns``: wall-clock ns since the epoch of the previous and
    this drain.  ``samples``: how many samples the BPF program took in the
    window (the sum of ``counts`` plus ``len(events)`` when nothing was lost).
    ``lost``: samples or stacks lost, by reason (the BPF sampler's are
    ``flamed.sampling.bpf.LOST_REASONS``: ``map_full`` -- the only one that
    drops a sample --, ``ringbuf_full``, ``kernel_stack_eexist``,
    ``user_stack_eexist``, ``*_enomem``, ``*_error``, ``*_missing``...).
    """

    start_ns: int
    end_ns: int
    counts: dict[CountKey, int] = field(default_factory=dict)
    events: list[SampleEvent] = field(default_factory=list)
    samples: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    sample_rate: float | None = None

    def to_profile(self, root: str = "comm", labels: dict[str, str] | None = None) -> Profile:
        """Counts (not events) as a Profile whose root frame names the task.

        ``root``: ``comm`` (``python3``), ``pid`` (``python3-1234``), ``tid``
        (``python3-1234/1240``) or ``none``.
        """
        return counts_to_profile(self.counts, root, start_ns=self.start_ns, end_ns=self.end_ns,
                                 sample_rate=self.sample_rate, labels=labels)


def counts_to_profile(
    counts: dict[CountKey, int],
    root: str,
    *,
    start_ns: int | None = None,
    end_ns: int | None = None,
    sample_rate: float | None = None,
    labels: dict[str, str] | None = None,
) -> Profile:
    """Task-keyed counts as a Profile whose root frame names the task.

    ``root``: ``comm`` (``python3``), ``pid`` (``python3-1234``), ``tid``
    (``python3-1234/1240``) or ``none``.
    """
    p = Profile(start_ns=start_ns, end_ns=end_ns, sample_rate=sample_rate, labels=dict(labels or {}))
    stacks = p.stacks
    for (tgid, tid, comm, stack), n in counts.items():
        key: Stack
        if root == "none":
            key = stack
        elif root == "pid":
            key = (task_frame(comm, tgid),) + stack
        elif root == "tid":
            key = (task_frame(comm, tgid, tid),) + stack
        else:
            key = (task_frame(comm),) + stack
        stacks[key] = stacks.get(key, 0) + n
    return p


class Sampler(Protocol):
    def start(self) -> None:
        """Attach and start sampling. Raises CapabilityError with an actionable message."""

    def drain(self) -> Window:
        """Everything sampled since the last drain (or start), exactly once."""

    def watch(self, tgid: int) -> None:
        """Emit timestamped events for this process instead of counting it."""

    def unwatch(self, tgid: int) -> None:
        """Stop emitting events for this process; count it again."""

    def close(self) -> None:
        """Detach; idempotent."""
