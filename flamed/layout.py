"""Flame graph geometry: which frame boxes exist, where they start and how wide they are.

Two layouts, shared by every renderer:

* :func:`flame_frames` -- the classic flame graph: stacks sorted, equal
  prefixes merged into one box.  It works on a :class:`StackTable`: every
  stack as one key string (frames joined by ``\\0``, which sorts below every
  other character, so key order equals frame-by-frame order) with cumulative
  weights.  Since sorted keys sharing a prefix are contiguous, the children of
  a box are found with a ``find`` and a ``bisect`` each, and a box narrower
  than the minimum width is skipped *with its whole subtree* without looking
  at its stacks.  The work is proportional to the boxes drawn (and their
  pruned siblings), not to the number of input stacks times their depth.
* :func:`chart_frames` -- the flame chart: stacks in the order given (time
  order), consecutive equal prefixes merged, nothing sorted.

Boxes are in weight units; renderers scale them to pixels.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from flamed.model import Profile, Stack, Weight, decode_frame, normalize_weight
from flamed.progress import phase

#: Name of the root box that spans everything (flamegraph.pl's convention).
ROOT_NAME = "all"

K = TypeVar("K", str, bytes)


@dataclass(frozen=True, slots=True)
class Box:
    """One frame box. ``depth`` 0 is the root; ``start``/``width`` in weight units."""

    depth: int
    start: Weight
    width: Weight
    name: str
    #: Sum of (after - before) over the stacks below this box, for differentials.
    delta: Weight | None = None


class StackTable(Generic[K]):
    """Stacks as sorted ``\\0``-joined keys with prefix sums of their weights.

    Keys are ``str`` (from a Profile) or ``bytes`` (straight from folded text,
    decoded only for the boxes that get drawn).
    """

    __slots__ = ("keys", "cum", "dcum", "sep", "nxt")

    def __init__(self, keys: list[K], weights: Sequence[Weight], deltas: Sequence[Weight] | None = None) -> None:
        self.keys: list[K] = keys
        self.cum = _prefix_sums(weights)
        self.dcum = _prefix_sums(deltas) if deltas is not None else None
        binary = bool(keys) and isinstance(keys[0], bytes)
        # The separator, and the smallest string greater than every key that ends a
        # frame here: bisecting for prefix+nxt finds the end of a prefix's run.
        self.sep: K = cast(K, b"\x00" if binary else "\x00")
        self.nxt: K = cast(K, b"\x01" if binary else "\x01")

    @property
    def total(self) -> Weight:
        return normalize_weight(self.cum[-1])

    def __len__(self) -> int:
        return len(self.keys)


def _prefix_sums(values: Sequence[Weight]) -> list[Weight]:
    out: list[Weight] = [0]
    acc: Weight = 0
    append = out.append
    for v in values:
        acc += v
        append(acc)
    return out


def _str_key(stack: Stack) -> str:
    key = "\x00".join(stack)
    return key


def table_from_items(
    items: Iterable[tuple[Stack, Weight]], deltas: Mapping[Stack, Weight] | None = None
) -> StackTable[str]:
    """A StackTable of ``(stack, weight)`` pairs (weights <= 0 are left out).

    ``deltas`` (optional) gives each stack's change for differential graphs;
    then stacks of weight 0 are kept too: they draw nothing but their change
    counts in their ancestors' boxes.
    """
    rows: list[tuple[str, Weight, Weight]] = []
    for stack, w in items:
        if not w > 0 and not (deltas is not None and w == 0):
            continue
        # A NUL inside a frame would be taken for a separator; show it as text instead.
        key = "\x00".join(f.replace("\x00", "\\x00") if "\x00" in f else f for f in stack)
        rows.append((key, w, deltas.get(stack, 0) if deltas is not None else 0))
    rows.sort(key=lambda r: r[0])
    keys = [r[0] for r in rows]
    ws = [r[1] for r in rows]
    ds = [r[2] for r in rows] if deltas is not None else None
    return _dedupe(StackTable(keys, ws, ds))


def table_from_profile(profile: Profile, deltas: Mapping[Stack, Weight] | None = None) -> StackTable[str]:
    return table_from_items(profile.stacks.items(), deltas)


def table_from_keyed(counts: Mapping[bytes, Weight]) -> StackTable[bytes]:
    """A StackTable from folded stack text (``;``-separated bytes) to weight."""
    tr = bytes.maketrans(b";", b"\x00")
    if any(b"\x00" in raw for raw in counts):
        # A NUL inside a frame would be taken for a separator; show it as text instead.
        fixed: dict[bytes, Weight] = {}
        for raw, w in counts.items():
            k = raw.replace(b"\x00", b"\\x00")
            fixed[k] = fixed.get(k, 0) + w
        counts = fixed
    rows = [(raw.translate(tr), w) for raw, w in counts.items() if w > 0]
    rows.sort(key=_first)
    return _dedupe(StackTable([r[0] for r in rows], [r[1] for r in rows]))


def _first(row: tuple[bytes, Weight]) -> bytes:
    return row[0]


def _dedupe(table: StackTable[K]) -> StackTable[K]:
    # Keys are unique when they came from a dict; kept as a cheap guarantee
    # because the box walk assumes it.
    keys = table.keys
    if all(keys[i] != keys[i + 1] for i in range(len(keys) - 1)):
        return table
    cum, dcum = table.cum, table.dcum
    nk: list[K] = []
    nw: list[Weight] = []
    nd: list[Weight] = []
    for i, k in enumerate(keys):
        w = cum[i + 1] - cum[i]
        d = (dcum[i + 1] - dcum[i]) if dcum is not None else 0
        if nk and nk[-1] == k:
            nw[-1] += w
            nd[-1] += d
        else:
            nk.append(k)
            nw.append(w)
            nd.append(d)
    return StackTable(nk, nw, nd if dcum is not None else None)


def flame_frames(
    table: StackTable[str] | StackTable[bytes],
    min_width: float = 0.0,
    *,
    self_deltas: bool = False,
    hidden: list[Box] | None = None,
    hidden_limit: int = 100_000,
) -> list[Box]:
    """Boxes of the flame graph of ``table``, root first, then by (depth, start).

    Boxes narrower than ``min_width`` weight units are left out with their
    subtrees (flamegraph.pl's ``--minwidth``, converted to weight units).
    A differential table's box gets the change of the stacks under it, or with
    ``self_deltas`` that of its own stack only (the stack ending at the box, as
    flamegraph.pl colors: a caller whose own time did not change stays white).
    ``hidden`` receives the boxes left out for their width, and those under them
    (what a search must still count), in no particular order -- up to
    ``hidden_limit`` of them: a list that long means there were more (and the
    caller should not take it for all of them).
    """
    # str or bytes alike: both have find, slicing and ordering, which is all this needs.
    keys: Any = table.keys
    cum = table.cum
    dcum = table.dcum
    sep: Any = table.sep
    nxt: Any = table.nxt
    n = len(keys)
    total = cum[-1]
    if n == 0 or not total > 0:
        return []
    names: dict[Any, str] = {}
    is_bytes = isinstance(sep, bytes)
    root_delta: Weight | None = None
    if dcum is not None:
        # No stack ends at the root: its own change is none.
        root_delta = 0 if self_deltas else dcum[-1]
    out: list[Box] = [Box(0, 0, normalize_weight(total), ROOT_NAME, root_delta)]
    # Work list of (lo, hi, offset of the next frame in the keys, depth of the parent).
    todo: list[tuple[int, int, int, int, bool]] = [(0, n, 0, 0, True)]
    pop = todo.pop
    push = todo.append
    emit_drawn = out.append
    emit_hidden = hidden.append if hidden is not None else None
    ph = phase("layout", None, "boxes")  # a count only: how many boxes there are is known at the end
    while todo:
        lo, hi, off, depth, drawn = pop()
        if ph is not None:
            ph.step()
        i = lo
        # The parent's own samples (a key that ends at the parent) sort first.
        if off and len(keys[i]) == off - 1:
            i += 1
        while i < hi:
            k = keys[i]
            end = k.find(sep, off)
            if end < 0:
                end = len(k)
            prefix = k[:end]
            j = bisect_left(keys, prefix + nxt, i + 1, hi)
            width = cum[j] - cum[i]
            show = drawn and width >= min_width
            if not show and emit_hidden is not None and len(hidden) >= hidden_limit:  # type: ignore[arg-type]
                emit_hidden = None  # too many to carry: the caller drops them all
            if width > 0 and (show or emit_hidden is not None):
                raw = k[off:end]
                name = names.get(raw)
                if name is None:
                    name = decode_frame(raw) if is_bytes else raw
                    names[raw] = name
                if dcum is None:
                    delta = None
                elif self_deltas:
                    delta = (dcum[i + 1] - dcum[i]) if end == len(k) else 0  # keys[i] is the prefix itself
                else:
                    delta = dcum[j] - dcum[i]
                (emit_drawn if show else emit_hidden)(  # type: ignore[misc]
                    Box(depth + 1, normalize_weight(cum[i]), normalize_weight(width), name, delta)
                )
                push((i, j, end + 1, depth + 1, show))
            i = j
    out.sort(key=lambda b: (b.depth, b.start))
    return out


def chart_frames(items: Iterable[tuple[Stack, Weight]], min_width: float = 0.0) -> list[Box]:
    """Boxes of the flame chart of ``items`` in the given (time) order.

    Consecutive stacks that share a prefix share its boxes; nothing is sorted,
    so the x axis is the order of the input.
    """
    out: list[Box] = []
    emit = out.append
    prev: Stack = ()
    starts: list[Weight] = []
    x: Weight = 0
    for stack, w in items:
        if not w > 0:
            continue
        lp = len(prev)
        m = min(lp, len(stack))
        same = 0
        while same < m and prev[same] == stack[same]:
            same += 1
        for d in range(lp - 1, same - 1, -1):
            s = starts[d]
            if x - s >= min_width:
                emit(Box(d + 1, normalize_weight(s), normalize_weight(x - s), prev[d]))
        del starts[same:]
        starts.extend([x] * (len(stack) - same))
        x += w
        prev = stack
    for d in range(len(prev) - 1, -1, -1):
        s = starts[d]
        if x - s >= min_width:
            emit(Box(d + 1, normalize_weight(s), normalize_weight(x - s), prev[d]))
    if not x > 0:
        return []
    emit(Box(0, 0, normalize_weight(x), ROOT_NAME))
    out.sort(key=lambda b: (b.depth, b.start))
    return out
