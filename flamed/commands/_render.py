"""Options shared by the commands that draw flame graphs (svg, diff)."""

from __future__ import annotations

import argparse
import gzip
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from flamed.fastfolded import count_folded, count_folded_file, profile_from_counts
from flamed.fileio import input_name, open_input
from flamed.folded import ReadStats, iter_folded
from flamed.model import Profile, Stack, Weight
from flamed.outputs.base import OutputOptions
from flamed.outputs.svg import parse_minwidth
from flamed.palette import PALETTES

if TYPE_CHECKING:
    from flamed.diff import DiffProfile


def add_render_arguments(parser: argparse.ArgumentParser, *, chart: bool = True, colors: bool = True) -> None:
    g = parser.add_argument_group("drawing")
    g.add_argument("--title", help="graph title (default: 'Flame Graph', 'Icicle Graph', ...)")
    g.add_argument("--subtitle", help="second line under the title")
    g.add_argument("--width", type=int, default=1200, help="image width in px (default 1200)")
    g.add_argument(
        "--minwidth",
        default="0.1",
        help="leave out boxes narrower than this: px (0.1, the default) or a share of the width (0.5%%)",
    )
    g.add_argument("--countname", default="samples", help="unit of the weights in tooltips (default: samples)")
    g.add_argument("--inverted", action="store_true", help="icicle graph: roots at the top")
    if chart:
        g.add_argument(
            "--flamechart",
            action="store_true",
            help="flame chart: keep the input's (time) order instead of sorting; x is time",
        )
    if not colors:
        # Differentials are colored by change; the palette options would do nothing.
        parser.set_defaults(palette="hot", hash=False, palette_file=None)
        return
    g.add_argument(
        "--palette",
        default="hot",
        choices=PALETTES,
        help="color scheme (default hot); 'mixed' colors kernel, native and Python frames apart",
    )
    g.add_argument("--hash", action="store_true", help="similar names get similar colors")
    g.add_argument(
        "--palette-file",
        metavar="FILE",
        help="keep colors consistent across graphs: read NAME->rgb(R,G,B) lines, add new names",
    )


def add_delta_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--inclusive",
        action="store_true",
        help="differentials: color a box by the change of all the stacks under it "
        "(default: by its own, self, change, as flamegraph.pl)",
    )


def render_diff(diff: DiffProfile, out: BinaryIO, options: OutputOptions, *, inclusive: bool = False) -> int:
    """A differential flame graph: AFTER's widths, colored by each box's change; returns the boxes drawn."""
    from flamed.layout import flame_frames, table_from_items
    from flamed.outputs.svg import min_weight, render_boxes

    # Stacks gone in AFTER have no width but still count in their ancestors' (inclusive) change.
    table = table_from_items(diff.after_items(include_gone=True), diff.deltas())
    boxes = flame_frames(table, min_weight(table.total, options), self_deltas=not inclusive) if len(table) else []
    render_boxes(boxes, out, options, diff=True)
    return len(boxes)


def render_options(args: argparse.Namespace) -> OutputOptions:
    return OutputOptions(
        title=args.title,
        subtitle=args.subtitle,
        width=args.width,
        minwidth=parse_minwidth(args.minwidth, args.width),
        countname=args.countname,
        inverted=args.inverted,
        flamechart=getattr(args, "flamechart", False),
        palette=args.palette,
        hash=args.hash,
        palette_file=args.palette_file,
    )


def collapse_reader() -> Callable[..., Any] | None:
    """The multi-format reader of flamed.collapse, when that package provides one."""
    try:
        mod = importlib.import_module("flamed.collapse")
    except ImportError:
        return None
    for name in ("read_any", "read_profile", "read"):
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    return None


def read_counts(paths: Sequence[str], *, strict: bool, stats: ReadStats, jobs: int = 1) -> dict[bytes, Weight]:
    """Folded inputs summed by stack text (the fast path of the renderers).

    Large plain files are counted by ``jobs`` processes; gzip and stdin by one.
    """
    counts: dict[bytes, Weight] = {}
    for path in paths or ["-"]:
        with open_input(path) as f:
            plain = path != "-" and not isinstance(f, gzip.GzipFile)
            if not plain or jobs <= 1:
                count_folded(f, counts=counts, source=input_name(path), strict=strict, stats=stats)
                continue
        count_folded_file(path, counts=counts, strict=strict, stats=stats, jobs=jobs)
    return counts


def read_ordered(paths: Sequence[str], *, strict: bool, stats: ReadStats) -> list[tuple[Stack, Weight]]:
    """Folded records in file order, not merged: what a flame chart draws."""
    items: list[tuple[Stack, Weight]] = []
    for path in paths or ["-"]:
        with open_input(path) as f:
            items.extend(iter_folded(f, source=input_name(path), strict=strict, stats=stats))
    return items


def read_profile(paths: Sequence[str], *, strict: bool, stats: ReadStats) -> Profile:
    return profile_from_counts(read_counts(paths, strict=strict, stats=stats))
