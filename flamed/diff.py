"""Differential profiles: what grew and what shrank between two profiles.

The semantics of difffolded.pl + flamegraph.pl: every stack of either
profile gets a (before, after) pair; the graph is drawn with the AFTER
widths and colored by ``after - before`` of the box's own stack (its self
change: red grew, blue shrank, white unchanged), or, on request, of all the
stacks under it (inclusive).  ``normalize`` first scales BEFORE to
AFTER's total (truncating, as difffolded.pl ``-n``), so a longer or busier second capture does not paint
everything red.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flamed.errors import InputError
from flamed.model import Profile, Stack, Weight, format_weight, normalize_weight, printable, tidy_weight


@dataclass
class DiffProfile:
    """Stacks to (before, after) weights; ``after`` is a Profile with the AFTER weights."""

    pairs: dict[Stack, tuple[Weight, Weight]]
    before_total: Weight
    after_total: Weight
    normalized: bool

    def deltas(self) -> dict[Stack, Weight]:
        return {k: normalize_weight(a - b) for k, (b, a) in self.pairs.items()}

    def after_items(self, *, include_gone: bool = False) -> list[tuple[Stack, Weight]]:
        """AFTER's stacks; with ``include_gone`` also those only BEFORE had (weight 0)."""
        return [(k, a) for k, (_, a) in self.pairs.items() if a > 0 or include_gone]


def read_differential(paths: Sequence[str], *, strict: bool = False, stats: object | None = None) -> DiffProfile:
    """difffolded.pl output (``stack BEFORE AFTER`` lines) of ``paths``, summed."""
    from flamed.fileio import input_name, open_input
    from flamed.folded import ReadStats, iter_differential

    st = stats if isinstance(stats, ReadStats) else ReadStats()
    pairs: dict[Stack, tuple[Weight, Weight]] = {}
    for path in paths or ["-"]:
        with open_input(path) as f:
            for stack, b, a in iter_differential(f, source=input_name(path), strict=strict, stats=st):
                ob, oa = pairs.get(stack, (0, 0))
                pairs[stack] = (ob + b, oa + a)
    if not pairs and st.skipped:
        raise InputError("no 'stack BEFORE AFTER' line could be read", source=", ".join(paths) or "<stdin>")
    return DiffProfile(
        pairs,
        normalize_weight(sum(b for b, _ in pairs.values())),
        normalize_weight(sum(a for _, a in pairs.values())),
        False,
    )


def diff_profiles(before: Profile, after: Profile, *, normalize: bool = False) -> DiffProfile:
    bt = before.total()
    at = after.total()
    # difffolded.pl -n scales only when the totals differ, as int(count * total2 / total1):
    # truncated, multiplied before dividing, so the counts written match its own.
    scale = normalize and bool(bt) and bt != at
    pairs: dict[Stack, tuple[Weight, Weight]] = {}
    for k, w in before.stacks.items():
        b: Weight = w
        if scale:
            if isinstance(w, int) and isinstance(at, int) and isinstance(bt, int):
                # Perl's arithmetic: an exact integer quotient stays exact, any other is a
                # division of doubles (the product's rounding included), then truncated.
                p = w * at
                b = p // bt if p % bt == 0 else int(float(p) / float(bt))
            else:
                # Fractional weights (seconds, say) would lose everything below one to truncation.
                b = normalize_weight(float(w) * float(at) / float(bt))
        pairs[k] = (b, 0)
    for k, w in after.stacks.items():
        b, _ = pairs.get(k, (0, 0))
        pairs[k] = (b, w)
    return DiffProfile(pairs, normalize_weight(sum(b for b, _ in pairs.values())), at, normalize)


@dataclass(frozen=True)
class Change:
    function: str
    self_before: Weight
    self_after: Weight
    total_before: Weight
    total_after: Weight

    @property
    def self_delta(self) -> Weight:
        return tidy_weight(self.self_after - self.self_before)

    @property
    def total_delta(self) -> Weight:
        return tidy_weight(self.total_after - self.total_before)


def changes(diff: DiffProfile) -> list[Change]:
    """Per function: self and inclusive weights before and after, biggest self change first."""
    sb: dict[str, Weight] = {}
    sa: dict[str, Weight] = {}
    tb: dict[str, Weight] = {}
    ta: dict[str, Weight] = {}
    for stack, (b, a) in diff.pairs.items():
        leaf = stack[-1]
        sb[leaf] = sb.get(leaf, 0) + b
        sa[leaf] = sa.get(leaf, 0) + a
        for f in set(stack):
            tb[f] = tb.get(f, 0) + b
            ta[f] = ta.get(f, 0) + a
    out = [
        # Sums of float weights (normalized, fractional inputs) are tidied, or a
        # function whose weight did not change showed a change of 1e-16.
        Change(f, tidy_weight(sb.get(f, 0)), tidy_weight(sa.get(f, 0)), tidy_weight(tb[f]), tidy_weight(ta[f]))
        for f in tb
    ]
    out.sort(key=lambda c: (-abs(c.self_delta), -abs(c.total_delta), c.function))
    return out


def format_table(diff: DiffProfile, *, limit: int = 20, countname: str = "samples") -> str:
    """The biggest changes as an aligned text table (percentages of the AFTER total,
    or of the BEFORE total when AFTER is empty: everything went, -100% in all);
    ``limit`` rows, every changed function when it is 0 (as ``top``'s)."""
    rows = [c for c in changes(diff) if c.self_delta or c.total_delta]
    if limit > 0:
        rows = rows[:limit]
    total = float(diff.after_total) or float(diff.before_total) or 1.0
    of_before = " (after is empty: Δ% of before)" if not diff.after_total and diff.before_total else ""
    head = (
        f"before: {format_weight(tidy_weight(diff.before_total))} {countname}{' (normalized)' if diff.normalized else ''}, "
        f"after: {format_weight(tidy_weight(diff.after_total))} {countname}{of_before}\n"
    )
    cols = ("self Δ", "self Δ%", "self before", "self after", "total Δ", "total Δ%", "function")
    table = [cols]
    for c in rows:
        table.append(
            (
                f"{c.self_delta:+}",
                f"{100.0 * float(c.self_delta) / total:+.2f}%",
                str(c.self_before),
                str(c.self_after),
                f"{c.total_delta:+}",
                f"{100.0 * float(c.total_delta) / total:+.2f}%",
                printable(c.function),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(cols) - 1)]
    lines = [head]
    for r in table:
        lines.append("  ".join(r[i].rjust(widths[i]) for i in range(len(cols) - 1)) + "  " + r[-1] + "\n")
    if not rows:
        lines.append("no changes\n")
    return "".join(lines)
