"""Command ``flamed diff``: differential flame graph or table of two profiles."""

from __future__ import annotations

import argparse

from flamed.commands._render import (
    add_delta_arguments,
    add_render_arguments,
    render_diff,
    render_options,
    total_warning,
    transform_profile,
)
from flamed.commands.base import Command
from flamed.diff import diff_profiles, format_table
from flamed.errors import UsageError
from flamed.fileio import open_output
from flamed.folded import ReadStats, folded_line
from flamed.inputs import load_profile
from flamed.model import format_weight, time_kind

_BY_EXT = {".svg": "svg", ".txt": "table", ".folded": "folded"}


class DiffCommand(Command):
    """Compare two profiles: differential flame graph (red grew, blue shrank) or a table.

    Widths are AFTER's, colors the change (after - before) of each box's own
    (self) weight, as difffolded.pl + flamegraph.pl draw it: a caller whose own
    time did not change stays white however its children moved; --inclusive
    colors by the change of everything under a box instead.  --normalize scales
    BEFORE to AFTER's total first, for captures of different length or load.
    --format table lists the functions whose own (self) weight changed most;
    --format folded writes difffolded.pl's "stack BEFORE AFTER" lines.

    examples:
      flamed diff before.folded after.folded -o diff.svg
      flamed diff --normalize --format table before.folded after.pb.gz
      flamed diff --format folded a.folded b.folded | flamegraph.pl > diff.svg
    """

    name = "diff"
    order = 32

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("before", metavar="BEFORE", help="the baseline profile (folded, pprof, speedscope, ...)")
        parser.add_argument("after", metavar="AFTER", help="the profile to compare with it")
        parser.add_argument("-o", "--output", help="output file (default stdout), written atomically")
        parser.add_argument(
            "--format",
            choices=("svg", "table", "folded"),
            help="svg (default), table, or folded (difffolded.pl's 3-column lines); default from -o's extension",
        )
        parser.add_argument("--normalize", action="store_true", help="scale BEFORE to AFTER's total first")
        parser.add_argument("--limit", type=int, default=20, help="rows of the table, 0 for every changed function (default 20)")
        parser.add_argument("--strict", action="store_true", help="fail on the first malformed line")
        add_render_arguments(parser, chart=False, colors=False)
        add_delta_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        fmt = args.format
        if fmt is None:
            fmt = "svg"
            if args.output:
                for ext, name in _BY_EXT.items():
                    if args.output.lower().endswith(ext):
                        fmt = name
        if args.limit < 0:
            raise UsageError("--limit must not be negative")
        stats = ReadStats()
        before = transform_profile(load_profile([args.before], strict=args.strict, stats=stats), args)
        after = transform_profile(load_profile([args.after], strict=args.strict, stats=stats), args)
        diff = diff_profiles(before, after, normalize=args.normalize)
        with open_output(args.output) as out:
            if fmt == "table":
                timed = time_kind(after)
                countname = timed[1] if timed is not None and args.countname == "samples" else args.countname
                out.write(format_table(diff, limit=args.limit, countname=countname).encode("utf-8", "surrogateescape"))
            elif fmt == "folded":
                for stack in sorted(diff.pairs):
                    b, a = diff.pairs[stack]
                    line = folded_line(stack, b)
                    out.write(line[:-1] + b" " + format_weight(a).encode() + b"\n")
            else:
                options = render_options(args)
                # Stacks gone in AFTER have no width but still count in their ancestors' change.
                render_diff(diff, out, options, inclusive=args.inclusive)
                warning = total_warning(diff.after_total, options)
                if warning:
                    self.warn(warning)
        summary = stats.summary()
        if summary:
            self.warn(summary)
        return 0
