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

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

from flamed.model import Profile, Stack, task_frame
from flamed.sampling.cgroups import CgroupIdentity

#: (tgid, tid, comm, stack) -> sample count
CountKey = tuple[int, int, str, Stack]

#: Root frames naming the task (at most one of them in a root spec).
TASK_ROOTS = ("comm", "pid", "tid")
#: Root frames naming the task's cgroup owner (see CgroupIdentity.root_frame).
CGROUP_ROOTS = ("unit", "container", "cgroup")
#: The root frame of a task whose cgroup is not known (no cgroup v2, or an id
#: that did not resolve): distinct from "[no unit]" and "[host]", which are facts.
UNKNOWN_CGROUP_FRAME = "[unknown cgroup]"
ROOT_SYNTAX = ("'none', or a comma-separated list of frames, root first, of unit, container, cgroup "
               "and at most one of comm, pid, tid (e.g. 'pid', 'container,pid', 'unit,comm')")


def parse_root(spec: str) -> tuple[str, ...]:
    """The root frames a root spec asks for, root first; ValueError saying what to write.

    ``none`` -> ``()``; ``pid`` -> ``("pid",)``; ``container,pid`` -> a
    container frame above the comm-PID frame.
    """
    text = spec.strip()
    if text == "none":
        return ()
    parts = tuple(p.strip() for p in text.split(","))
    if "none" in parts:
        raise ValueError(f"root {spec!r}: 'none' stands alone; expected {ROOT_SYNTAX}")
    bad = [p for p in parts if p not in TASK_ROOTS + CGROUP_ROOTS]
    if not text or bad:
        raise ValueError(f"root {spec!r}: {'unknown frame ' + repr(bad[0]) if bad and bad[0] else 'empty frame'}; "
                         f"expected {ROOT_SYNTAX}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"root {spec!r}: a frame is repeated; expected {ROOT_SYNTAX}")
    if sum(p in TASK_ROOTS for p in parts) > 1:
        raise ValueError(f"root {spec!r}: comm, pid and tid each name the task, give one; expected {ROOT_SYNTAX}")
    return parts


def canonical_root(spec: str) -> str:
    """A valid root spec in its canonical spelling (``"container, pid"`` -> ``"container,pid"``); ValueError."""
    return ",".join(parse_root(spec)) or "none"


def root_frames(kinds: tuple[str, ...], tgid: int, tid: int, comm: str,
                identity: CgroupIdentity | None) -> Stack:
    """The frames above a task's stack for the parsed root spec ``kinds``."""
    out: list[str] = []
    for kind in kinds:
        if kind == "pid":
            out.append(task_frame(comm, tgid))
        elif kind == "tid":
            out.append(task_frame(comm, tgid, tid))
        elif kind == "comm":
            out.append(task_frame(comm))
        elif identity is None:
            out.append(UNKNOWN_CGROUP_FRAME)
        else:
            out.append(identity.root_frame(cast(Literal["unit", "container", "cgroup"], kind)))
    return tuple(out)


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
    #: A dict, or (a daemon's BPF drain) a PackedBuilder numbered in the
    #: snapshot ring's table (flamed/sampling/packed.py): a mapping either way.
    counts: MutableMapping[CountKey, int] = field(default_factory=dict)
    events: list[SampleEvent] = field(default_factory=list)
    samples: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    sample_rate: float | None = None
    #: tgid -> the cgroup v2 id of its samples in the window (the one with
    #: most samples if it moved); empty from samplers that do not read it.
    cgroups: dict[int, int] = field(default_factory=dict)
    #: tgid -> who owns that cgroup (unit, container, pod), for the ids that
    #: resolved; empty without a cgroup v2 hierarchy.
    identities: dict[int, CgroupIdentity] = field(default_factory=dict)
    #: Off-CPU time (samplers measuring it: ``BpfSamplerOptions.offcpu``):
    #: (tgid, tid, comm, stack) -> nanoseconds the task spent off the CPU in
    #: that stack, whose leaf frame says why (``[off-cpu: blocked]``,
    #: ``[off-cpu: preempted]`` or ``[gil wait]``); each wait is counted in the window it ended in.
    offcpu: dict[CountKey, int] = field(default_factory=dict)
    #: Off-CPU waits recorded in ``offcpu`` whose stack was lost at their
    #: switch off the CPU, by the reasons of ``lost`` (which counts samples
    #: only): each shows as a placeholder frame in ``offcpu``.  Stacks that
    #: failed for waits shorter than the threshold are not losses: nothing
    #: was recorded for them.
    offcpu_lost: dict[str, int] = field(default_factory=dict)
    #: Every counted sample with its time (CLOCK_MONOTONIC ns) and its whole
    #: stack, as in ``counts`` (samplers asked for it:
    #: ``BpfSamplerOptions.timeline``); a sample is in ``counts`` as well.
    timeline: list[tuple[SampleEvent, Stack]] = field(default_factory=list)

    def to_profile(self, root: str = "comm", labels: dict[str, str] | None = None) -> Profile:
        """Counts (not events) as a Profile whose root frames name the task (see :func:`counts_to_profile`)."""
        return counts_to_profile(self.counts, root, start_ns=self.start_ns, end_ns=self.end_ns,
                                 sample_rate=self.sample_rate, labels=labels, identities=self.identities)


def counts_to_profile(
    counts: Mapping[CountKey, int],
    root: str,
    *,
    start_ns: int | None = None,
    end_ns: int | None = None,
    sample_rate: float | None = None,
    labels: dict[str, str] | None = None,
    identities: Mapping[int, CgroupIdentity] | None = None,
) -> Profile:
    """Task-keyed counts as a Profile whose root frames name the task.

    ``root`` (see :func:`parse_root`): ``comm`` (``python3``), ``pid``
    (``python3-1234``), ``tid`` (``python3-1234/1240``), ``none``, or a
    comma-separated list adding ``unit`` (``nginx.service``), ``container``
    (name or short id, ``[host]`` outside containers) and ``cgroup`` (its
    path) from ``identities`` (tgid -> identity; ``[unknown cgroup]`` for a
    tgid not in it).
    """
    kinds = parse_root(root)
    idents = identities or {}
    p = Profile(start_ns=start_ns, end_ns=end_ns, sample_rate=sample_rate, labels=dict(labels or {}))
    stacks = p.stacks
    prefixes: dict[tuple[int, int, str], Stack] = {}
    for (tgid, tid, comm, stack), n in counts.items():
        task = (tgid, tid, comm)
        prefix = prefixes.get(task)
        if prefix is None:
            prefix = prefixes[task] = root_frames(kinds, tgid, tid, comm, idents.get(tgid))
        key = prefix + stack
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
