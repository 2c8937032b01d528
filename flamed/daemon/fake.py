"""A sampler that invents stacks: for tests, demos and machines without BPF.

``sampler = "fake"`` in ``[sampling]`` selects it.  It honours the Sampler
contract exactly: every drain returns what "was sampled" since the previous
drain, exactly once -- ``frequency`` samples per second per fake CPU spread
round-robin over a fixed set of tasks and stacks -- and ``produced`` is the
total it ever handed out, the analogue of the BPF program's own counter.
With ``offcpu`` it also invents off-CPU time (``Window.offcpu``, ns): fixed
shares of each window's wall time in :data:`OFFCPU_STACKS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from flamed.errors import CapabilityError
from flamed.model import Stack
from flamed.sampling.contract import CountKey, SampleEvent, Window

#: The invented tasks' ids are above PID_MAX_LIMIT (2^22), which no process of
#: any Linux host can have: with small ones, a real process given the same pid
#: (on a host just booted, pids are small) was taken for the invented one, so
#: ``flamed record`` of it through a fake daemon got the invented samples.
FAKE_PID_BASE = 1 << 22
#: The busy process (two threads: itself and BUSY_PID + 1) and the idle one.
BUSY_PID = FAKE_PID_BASE + 4242
IDLE_PID = FAKE_PID_BASE + 777

#: (tgid, tid, comm, stack) the fake sampler cycles through, root first.
DEFAULT_STACKS: tuple[CountKey, ...] = (
    (BUSY_PID, BUSY_PID, "fake-busy", ("_start", "main", "busy_loop", "spin")),
    (BUSY_PID, BUSY_PID + 1, "fake-busy", ("_start", "main", "busy_loop", "hash_block")),
    (BUSY_PID, BUSY_PID + 1, "fake-busy", ("_start", "main", "write_out", "write", "entry_SYSCALL_64_[k]",
                                            "ksys_write_[k]", "vfs_write_[k]")),
    (IDLE_PID, IDLE_PID, "fake-idle", ("_start", "poll", "entry_SYSCALL_64_[k]", "do_sys_poll_[k]")),
)


#: (task and stack, share of the window's wall time spent off the CPU there).
OFFCPU_STACKS: tuple[tuple[CountKey, float], ...] = (
    ((IDLE_PID, IDLE_PID, "fake-idle", ("_start", "poll", "entry_SYSCALL_64_[k]", "do_sys_poll_[k]",
                                        "schedule_[k]", "[off-cpu: blocked]")), 0.75),
    ((BUSY_PID, BUSY_PID + 1, "fake-busy", ("_start", "main", "write_out", "write", "entry_SYSCALL_64_[k]",
                                            "[off-cpu: preempted]")), 0.125),
)


@dataclass(frozen=True)
class FakeOptions:
    """What the loop reads of a sampler's options (BpfSamplerOptions has the same field)."""

    offcpu: bool = False


class FakeSampler:
    def __init__(
        self,
        frequency: float = 19.0,
        *,
        cpus: int = 1,
        stacks: tuple[CountKey, ...] = DEFAULT_STACKS,
        clock_ns: Callable[[], int] = time.time_ns,
        fail_start: str | None = None,
        fail_drain: Exception | None = None,
        offcpu: bool = False,
    ) -> None:
        self.options = FakeOptions(offcpu=offcpu)
        self.frequency = frequency
        self.cpus = cpus
        self.stacks = stacks
        self._clock_ns = clock_ns
        self.fail_start = fail_start
        self.fail_drain = fail_drain
        self.started = False
        self.closed = False
        self.watched: set[int] = set()
        self.produced = 0
        self.drains = 0
        self._last_ns = 0
        self._carry = 0.0
        self._cursor = 0

    def start(self) -> None:
        if self.fail_start is not None:
            raise CapabilityError(self.fail_start)
        self.started = True
        self._last_ns = self._clock_ns()

    def drain(self, *, close_waits: bool = False) -> Window:
        """``close_waits``: the daemon's last drain with off-CPU time on (the fake's
        invented waits are all closed already: nothing more to count)."""
        del close_waits
        if self.fail_drain is not None:
            raise self.fail_drain
        now = self._clock_ns()
        start = self._last_ns
        self._last_ns = now
        # a window the wall clock went back in has no samples (not a negative number of them)
        exact = max(0, now - start) / 1e9 * self.frequency * self.cpus + self._carry
        n = int(exact)
        self._carry = exact - n
        w = Window(start_ns=start, end_ns=now, sample_rate=float(self.frequency))
        step = (now - start) // max(n, 1)
        mono0 = time.monotonic_ns() - (now - start)
        for i in range(n):
            tgid, tid, comm, stack = self.stacks[self._cursor % len(self.stacks)]
            self._cursor += 1
            if tgid in self.watched:
                user: Stack = tuple(f for f in stack if not f.endswith("_[k]"))
                kernel: Stack = tuple(f for f in stack if f.endswith("_[k]"))
                w.events.append(SampleEvent(mono0 + i * step, tgid, tid, comm, user, kernel))
            else:
                key = (tgid, tid, comm, stack)
                w.counts[key] = w.counts.get(key, 0) + 1
        w.samples = n
        if self.options.offcpu:
            for key, share in OFFCPU_STACKS:
                w.offcpu[key] = int((now - start) * share)
        self.produced += n
        self.drains += 1
        return w

    def watch(self, tgid: int) -> None:
        self.watched.add(tgid)

    def unwatch(self, tgid: int) -> None:
        self.watched.discard(tgid)

    def close(self) -> None:
        self.closed = True
