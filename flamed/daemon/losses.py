"""What the daemon logs about a window's losses, and how often.

Each loss reason has its own cure, and only the cure is advised:

* ``map_full`` -- the count hash was full, samples were dropped: raise
  ``sampling.counts_map_size`` (or drain more often).
* ``*_stack_enomem`` -- the stack map had no free element: raise
  ``sampling.stack_map_size``.
* ``*_stack_eexist`` -- ``bpf_get_stackid`` hashed a new stack into a bucket
  that holds another one.  Collisions start far below full (n distinct stacks
  in b buckets: about n/2b of them collide), so a bigger map only makes them
  rarer.  An idle host with 500 stacks in 16,384 buckets has a few per
  window: reported as information once an hour.  Only when they cost more
  than ``collision_share`` of a window's samples is it a warning (as often as
  a full map), and then a larger map is what lowers the share.

* ``python_stack_map_size`` / ``unwind_stack_map_size`` -- the program's map
  of Python stacks (or of unwound native stacks) was full: those samples kept
  their other frames but lost their Python frames (or fell back to the
  frame-pointer stack).  Raise the setting named.

Every message says what was lost: samples, their share of the window, and how
many stacks of the window show the placeholder instead of frames.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from flamed.model import KERNEL_SUFFIX, Stack

#: The placeholder frames of lost stacks (flamed/sampling/bpf.py), by errno name.
PLACEHOLDERS = {f"[lost stack: {e}]{s}": e for e in ("EEXIST", "ENOMEM") for s in ("", KERNEL_SUFFIX)}


@dataclass(frozen=True)
class LossAdviceOptions:
    """How often each kind of loss is logged."""

    #: Seconds between two warnings of a loss a setting cures (map full, stack map out of memory),
    #: and of collisions above ``collision_share``.
    warn_interval: float = 60.0
    #: Seconds between two reports of collisions below ``collision_share``.
    collision_interval: float = 3600.0
    #: Share of a window's samples lost to collisions above which they are a warning (0.05: 5 %).
    collision_share: float = 0.05
    #: A share is judged only over windows of at least this many samples: one
    #: collision in the 18 samples of a short last window is no trend (5.6 %).
    collision_min_samples: int = 200


@dataclass(frozen=True)
class Advice:
    level: int  #: logging level
    message: str


def placeholder_stacks(stacks: Iterable[Stack]) -> dict[str, int]:
    """Stacks of a window shown as a lost-stack placeholder, by errno name.

    The user placeholder replaces the whole user side (the root end of a
    stack), the kernel one the kernel side (the leaf end), so only the two
    ends are looked at: cheap on a window of 100,000 stacks.
    """
    out = {"EEXIST": 0, "ENOMEM": 0}
    for st in stacks:
        if not st:
            continue
        hit = PLACEHOLDERS.get(st[0]) or PLACEHOLDERS.get(st[-1])
        if hit is not None:
            out[hit] += 1
    return out


def _share(n: int, samples: int) -> str:
    return f"{n / samples:.1%}" if samples > 0 else "all"


class LossAdvisor:
    """Turns a window's losses into log lines, each kind rate-limited on its own."""

    def __init__(self, options: LossAdviceOptions = LossAdviceOptions(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.clock = clock
        self._last: dict[str, float] = {}

    def _due(self, kind: str, interval: float, now: float) -> bool:
        last = self._last.get(kind)
        if last is not None and now - last < interval:
            return False
        self._last[kind] = now
        return True

    def advise(self, samples: int, lost: Mapping[str, int], stacks: Mapping[str, int],
               settings: Mapping[str, object], *, offcpu_waits: int | None = None) -> list[Advice]:
        """Log lines for one window: ``samples`` taken, ``lost`` by reason, ``stacks``
        shown as placeholders (:func:`placeholder_stacks`), ``settings`` the current
        ``sampling.counts_map_size`` and ``sampling.stack_map_size``.
        ``offcpu_waits``: off-CPU time is measured too, and this many off-CPU
        waits were recorded in the window with the stacks they took from the
        same stack map when they left the CPU, so the stack losses count those
        of the recorded waits as well (``Window.offcpu_lost``; and ``stacks``
        their placeholders): a stack loss's share is of the samples and those
        waits together.  Switches whose wait ended below the threshold lost
        nothing, whatever became of their stacks: they are not counted."""
        o = self.options
        now = self.clock()
        out: list[Advice] = []
        offcpu = offcpu_waits is not None
        taken = "samples and off-CPU waits" if offcpu else "samples"
        # What was recorded with a stack from the stack map in the window, and how it is said.
        fetches = samples + (offcpu_waits or 0)
        of_what = (f"{samples} samples and {offcpu_waits} off-CPU waits recorded" if offcpu
                   else f"{samples} samples")
        full = lost.get("map_full", 0)
        if full > 0 and self._due("map_full", o.warn_interval, now):
            out.append(Advice(logging.WARNING, (
                f"the BPF count map is full: {full} samples ({_share(full, samples)} of the last window's "
                f"{samples}) were dropped; raise sampling.counts_map_size (now "
                f"{settings.get('sampling.counts_map_size', '?')}) or drain more often")))
        enomem = lost.get("kernel_stack_enomem", 0) + lost.get("user_stack_enomem", 0)
        if enomem > 0 and self._due("enomem", o.warn_interval, now):
            out.append(Advice(logging.WARNING, (
                f"the BPF stack map is full: {enomem} {taken} ({_share(enomem, fetches)} of the last window's "
                f"{of_what}) found no free stack entry (ENOMEM) and show as {stacks.get('ENOMEM', 0)} "
                f"'[lost stack: ENOMEM]' stacks; raise sampling.stack_map_size (now "
                f"{settings.get('sampling.stack_map_size', '?')})")))
        eexist = lost.get("kernel_stack_eexist", 0) + lost.get("user_stack_eexist", 0)
        if eexist > 0:
            what = (f"{eexist} {taken} ({_share(eexist, fetches)} of the last window's {of_what}) lost their stack "
                    f"to stack-map hash collisions (EEXIST: the bucket holds another stack) and show as "
                    f"{stacks.get('EEXIST', 0)} '[lost stack: EEXIST]' stacks")
            size = settings.get("sampling.stack_map_size", "?")
            if fetches >= o.collision_min_samples and eexist / fetches > o.collision_share:
                if self._due("eexist_high", o.warn_interval, now):
                    out.append(Advice(logging.WARNING, (
                        f"{what}; above {o.collision_share:.0%}, a larger sampling.stack_map_size (now {size}) "
                        f"makes them rarer (n distinct stacks in b buckets collide for about n/2b of them)")))
            elif self._due("eexist", o.collision_interval, now):
                out.append(Advice(logging.INFO, (
                    f"{what}; expected below {o.collision_share:.0%} for a stack map of {size} entries "
                    f"(reported at most once every {o.collision_interval / 60:g} min)")))
        return out

    #: What each map's samples lose when it is full.
    _MAP_LOSS = {
        "sampling.python_stack_map_size": ("the BPF map of Python stacks", "kept their native and kernel frames "
                                           "but lost their Python frames"),
        "sampling.unwind_stack_map_size": ("the BPF map of unwound native stacks", "fell back to their "
                                           "frame-pointer stack (callers missing where there are no frame "
                                           "pointers)"),
    }

    def advise_maps(self, full: Mapping[str, int], samples: int, settings: Mapping[str, object], *,
                    walks: Mapping[str, int] | None = None) -> list[Advice]:
        """Log lines for maps of the program found full in the last window: ``full`` is
        samples by the setting that sizes the map, ``settings`` the current values.
        ``walks``: off-CPU time is on, and a map named here also fills at switches off
        the CPU (the Python walker runs there too): its count in ``full`` is of samples
        and switches, and is given as a share of this many walks of both, never of the
        samples alone (which could read as more than 100 %)."""
        out: list[Advice] = []
        now = self.clock()
        for setting, n in sorted(full.items()):
            if n <= 0 or not self._due(setting, self.options.warn_interval, now):
                continue
            what, loss = self._MAP_LOSS.get(setting, ("a BPF map", "lost frames"))
            of = (walks or {}).get(setting)
            if of is not None:
                out.append(Advice(logging.WARNING, (
                    f"{what} is full: {n} Python stack walks ({_share(n, of)} of the last window's {of}, "
                    f"at samples and at switches off the CPU) {loss}; "
                    f"raise {setting} (now {settings.get(setting, '?')})")))
                continue
            out.append(Advice(logging.WARNING, (
                f"{what} is full: {n} samples ({_share(n, samples)} of the last window's {samples}) {loss}; "
                f"raise {setting} (now {settings.get(setting, '?')})")))
        return out
