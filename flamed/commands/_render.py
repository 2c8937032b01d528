"""Options shared by the commands that draw flame graphs (svg, diff)."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from flamed.commands._argtypes import integer, number
from flamed.fastfolded import count_folded, count_folded_file, profile_from_counts
from flamed.fileio import input_name, open_input
from flamed.folded import ReadStats, iter_folded
from flamed.errors import UsageError
from flamed.model import Profile, Stack, Weight, decode_frame, encode_frame, format_weight, normalize_weight
from flamed.outputs.base import OutputOptions
from flamed.outputs._svgattrs import read_nameattr
from flamed.outputs.svg import ENCODING, NAMEATTR, TOTAL, XPAD, check_encoding, graph_total, parse_minwidth, parse_total
from flamed.palette import PALETTES

if TYPE_CHECKING:
    from flamed.diff import DiffProfile

#: Ranges of the numeric drawing options: what a drawing can use; weights times --factor
#: far from float's limits (int64 counts summed over many lines), and a count of 1 times
#: it still a weight that folded text (17 decimals) and the SVG's viewBox can write.
MAX_WIDTH, MIN_PX, MAX_PX = 1_000_000, 0.01, 10_000
MIN_FONTWIDTH, MAX_FONTWIDTH = 0.01, 10.0
MIN_FACTOR, MAX_FACTOR = 1e-9, 1e9

#: The file of --cp, flamegraph.pl's name for it.
CP_FILE = "palette.map"


def add_render_arguments(parser: argparse.ArgumentParser, *, chart: bool = True, colors: bool = True) -> None:
    g = parser.add_argument_group("drawing")
    g.add_argument("--title", help="graph title (default: 'Flame Graph', 'Icicle Graph', ...)")
    g.add_argument("--subtitle", help="second line under the title")
    g.add_argument("--width", type=integer(2 * XPAD + 1, MAX_WIDTH, what="a width in px"),
        default=1200, help="image width in px (default 1200)")
    g.add_argument(
        "--minwidth",
        default="0.1",
        help="leave out boxes narrower than this: px (0.1, the default) or a share of the width (0.5%%)",
    )
    g.add_argument("--countname", default="samples", help="unit of the weights in tooltips (default: samples)")
    g.add_argument("--nametype", default="Function:", help="label before the hovered name (default 'Function:')")
    g.add_argument("--inverted", action="store_true", help="icicle graph: roots at the top")
    g.add_argument("--height", type=integer(2, MAX_PX, what="a height in px"),
        default=16, metavar="PX", help="height of a row of boxes (default 16)")
    g.add_argument("--fontsize", type=number(MIN_PX, MAX_PX, what="a size in px"),
        default=12.0, metavar="PX", help="label font size (default 12)")
    g.add_argument("--fonttype", default="Verdana", metavar="FONT", help="label font family (default Verdana)")
    g.add_argument(
        "--fontwidth",
        type=number(MIN_FONTWIDTH, MAX_FONTWIDTH, what="a share of the font size"),
        default=0.59,
        metavar="SHARE",
        help="average glyph width as a share of the font size, to fit labels in the file (default 0.59)",
    )
    g.add_argument(
        "--bgcolors",
        metavar="COLOR",
        help="background: yellow, blue, green, grey (gradients) or #rrggbb (flat); default by palette",
    )
    g.add_argument("--reverse", action="store_true", help="reverse every stack (leaf first): merge at the leaves")
    g.add_argument("--factor", type=number(MIN_FACTOR, MAX_FACTOR, what="a factor"),
        default=1.0, help="multiply every weight by this (default 1)")
    g.add_argument("--notes", default="", metavar="TEXT", help="text of a comment embedded in the SVG")
    g.add_argument("--negate", action="store_true", help="differentials: swap the hues (red shrank, blue grew)")
    g.add_argument(
        "--total",
        metavar="SAMPLES",
        help="the width stands for this many samples (before --factor), when more than the input's: "
        "graphs of different captures drawn to one scale (flamegraph.pl's --total)",
    )
    g.add_argument("--encoding", metavar="NAME", help="encoding of the file, declared in its XML header (default UTF-8)")
    nameattr_help = "extra SVG attributes per function, flamegraph.pl's file: lines 'NAME<TAB>key=value<TAB>...'"
    g.add_argument("--nameattr", metavar="FILE", help=nameattr_help + " (title id class href target g_extra a_extra)")
    if chart:
        g.add_argument(
            "--flamechart",
            action="store_true",
            help="flame chart: keep the input's (time) order instead of sorting; x is time",
        )
    if not colors:
        # Differentials are colored by change; the palette options would do nothing.
        parser.set_defaults(palette="hot", hash=False, palette_file=None, random=False, cp=False)
        return
    g.add_argument(
        "--palette",
        "--colors",
        dest="palette",
        default="hot",
        choices=PALETTES,
        help="color scheme (default hot); 'mixed' colors kernel, native and Python frames apart; "
        "java, js, perl, wakeup and chain pick a color per frame as flamegraph.pl's palettes do",
    )
    g.add_argument("--hash", action="store_true", help="similar names get similar colors")
    g.add_argument("--random", action="store_true", help="random colors (one per name within a graph)")
    g.add_argument(
        "--palette-file",
        metavar="FILE",
        help="keep colors consistent across graphs: read NAME->rgb(R,G,B) lines, add new names",
    )
    g.add_argument(
        "--cp",
        action="store_true",
        help="consistent palette, as flamegraph.pl's --cp: --palette-file palette.map (in the current directory)",
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
    from flamed.layout import Box, flame_frames, table_from_items
    from flamed.outputs.svg import HIDDEN_LIMIT, graph_total, min_weight, render_boxes, spanning

    # Stacks gone in AFTER have no width but still count in their ancestors' (inclusive) change.
    table = table_from_items(diff.after_items(include_gone=True), diff.deltas())
    hidden: list[Box] = []
    span = graph_total(table.total, options)
    boxes = (
        spanning(
            flame_frames(table, min_weight(span, options), self_deltas=not inclusive, hidden=hidden, hidden_limit=HIDDEN_LIMIT),
            span,
        )
        if len(table)
        else []
    )
    render_boxes(boxes, out, options, diff=True, hidden=hidden)
    return len(boxes)


def render_options(args: argparse.Namespace) -> OutputOptions:
    if args.height < 2:
        raise UsageError("--height must be at least 2 px")
    if not args.fontsize > 0 or not args.fontwidth > 0:
        raise UsageError("--fontsize and --fontwidth must be positive")
    if not args.factor > 0 or args.factor != args.factor or args.factor == float("inf"):
        raise UsageError("--factor must be a positive number")
    extra: dict[str, str] = {}
    total = parse_total(args.total) if args.total is not None else None
    if total is not None:
        # Weights are multiplied by --factor as they are read: so is the span they fill.
        extra[TOTAL] = format_weight(normalize_weight(total * args.factor) if args.factor != 1.0 else total)
    if args.encoding:
        extra[ENCODING] = check_encoding(args.encoding)
    if args.nameattr:
        read_nameattr(args.nameattr)  # a bad file is reported before any input is read
        extra[NAMEATTR] = args.nameattr
    palette_file = args.palette_file
    if palette_file is None and args.cp:
        palette_file = CP_FILE
    return OutputOptions(
        frame_height=args.height,
        font_size=args.fontsize,
        font_type=args.fonttype,
        font_width=args.fontwidth,
        nametype=args.nametype,
        bgcolors=args.bgcolors,
        negate=args.negate,
        random=args.random,
        notes=args.notes,
        title=args.title,
        subtitle=args.subtitle,
        width=args.width,
        minwidth=parse_minwidth(args.minwidth, args.width),
        countname=args.countname,
        inverted=args.inverted,
        flamechart=getattr(args, "flamechart", False),
        palette=args.palette,
        hash=args.hash,
        palette_file=palette_file,
        extra=extra,
    )


def total_warning(total: Weight, options: OutputOptions) -> str | None:
    """What to say when ``--total`` is less than the graph's ``total`` (and so ignored, as flamegraph.pl does)."""
    want = options.extra.get(TOTAL)
    if want and graph_total(total, options) == total and total and float(want) < float(total):
        return f"--total {want} is less than the input's total {format_weight(total)}: ignored"
    return None


def stack_transform(args: argparse.Namespace) -> Callable[[Stack], Stack] | None:
    """What --reverse and the chain palette do to every stack (None: nothing)."""
    reverse = bool(getattr(args, "reverse", False))
    chain = getattr(args, "palette", "") == "chain"
    if not reverse and not chain:
        return None

    def apply(stack: Stack) -> Stack:
        if chain and "--" in stack:
            # flamegraph.pl's chain graphs: frames after a "--" separator are the
            # wakers', marked _[w] for their color.
            i = stack.index("--")
            stack = stack[: i + 1] + tuple(f if f.endswith("_[w]") else f + "_[w]" for f in stack[i + 1 :])
        return stack[::-1] if reverse else stack

    return apply


def scale_weight(args: argparse.Namespace) -> Callable[[Weight], Weight] | None:
    """--factor as a function of a weight (None for 1): integers stay integers when the factor is one."""
    factor = float(getattr(args, "factor", 1.0))
    if factor == 1.0:
        return None
    if factor.is_integer():
        k = int(factor)
        return lambda w: w * k
    return lambda w: normalize_weight(w * factor)


def transform_counts(counts: dict[bytes, Weight], args: argparse.Namespace) -> dict[bytes, Weight]:
    """Folded counts (by stack text) with --reverse, --factor and the chain marks applied."""
    tf, sw = stack_transform(args), scale_weight(args)
    if tf is None and sw is None:
        return counts
    out: dict[bytes, Weight] = {}
    for key, w in counts.items():
        if tf is not None:
            frames = tuple(decode_frame(f) for f in key.split(b";"))
            key = b";".join(encode_frame(f) for f in tf(frames))
        if sw is not None:
            w = sw(w)
        out[key] = out.get(key, 0) + w
    return out


def transform_items(items: Sequence[tuple[Stack, Weight]], args: argparse.Namespace) -> list[tuple[Stack, Weight]]:
    tf, sw = stack_transform(args), scale_weight(args)
    if tf is None and sw is None:
        return list(items)
    return [(tf(s) if tf else s, sw(w) if sw else w) for s, w in items]


def transform_profile(profile: Profile, args: argparse.Namespace) -> Profile:
    tf, sw = stack_transform(args), scale_weight(args)
    if tf is None and sw is None:
        return profile
    stacks: dict[Stack, Weight] = {}
    for s, w in profile.stacks.items():
        k = tf(s) if tf else s
        stacks[k] = stacks.get(k, 0) + (sw(w) if sw else w)
    return dataclasses.replace(profile, stacks=stacks)


def transform_diff(diff: DiffProfile, args: argparse.Namespace) -> DiffProfile:
    tf, sw = stack_transform(args), scale_weight(args)
    if tf is None and sw is None:
        return diff
    pairs: dict[Stack, tuple[Weight, Weight]] = {}
    for s, (b, a) in diff.pairs.items():
        k = tf(s) if tf else s
        ob, oa = pairs.get(k, (0, 0))
        pairs[k] = (ob + (sw(b) if sw else b), oa + (sw(a) if sw else a))
    return dataclasses.replace(
        diff,
        pairs=pairs,
        before_total=normalize_weight(sum(b for b, _ in pairs.values())),
        after_total=normalize_weight(sum(a for _, a in pairs.values())),
    )


def collapse_reader() -> Callable[..., Any] | None:
    """The multi-format reader of flamed.collapse, when that package provides one."""
    try:
        mod = importlib.import_module("flamed.collapse.driver")
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
