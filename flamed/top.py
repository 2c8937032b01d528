"""Functions ranked by self and total weight.

*Self*: the weight of the stacks a function is the leaf of.  *Total*: the
weight of the stacks a function appears in, counted once per stack -- a
recursive ``fib;fib;fib`` adds its weight to ``fib`` once, not three times, so
no total exceeds the profile's total.
"""

from __future__ import annotations

from dataclasses import dataclass

from flamed.model import Profile, Weight, tidy_weight
from flamed.progress import counted


@dataclass(frozen=True)
class FunctionStat:
    name: str
    self_weight: Weight
    total_weight: Weight


def function_stats(profile: Profile) -> list[FunctionStat]:
    self_w: dict[str, Weight] = {}
    total_w: dict[str, Weight] = {}
    for stack, w in counted(profile.stacks.items(), "counting", len(profile.stacks), "stacks"):
        if not stack:
            continue
        leaf = stack[-1]
        self_w[leaf] = self_w.get(leaf, 0) + w
        for f in set(stack) if len(stack) > 1 else stack:
            total_w[f] = total_w.get(f, 0) + w
    return [
        FunctionStat(name, tidy_weight(self_w.get(name, 0)), tidy_weight(tw))
        for name, tw in total_w.items()
    ]


def ranked(stats: list[FunctionStat], by: str = "self") -> list[FunctionStat]:
    """Heaviest first by ``self`` or ``total``; ties by the other measure, then by name."""
    if by == "total":
        return sorted(stats, key=lambda s: (-s.total_weight, -s.self_weight, s.name))
    return sorted(stats, key=lambda s: (-s.self_weight, -s.total_weight, s.name))
