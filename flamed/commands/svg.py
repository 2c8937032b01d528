"""Command ``flamed svg``: folded stacks to an interactive SVG flame graph."""

from __future__ import annotations

import argparse
import contextlib

from flamed.commands._render import (
    add_delta_arguments,
    add_render_arguments,
    read_counts,
    read_ordered,
    render_diff,
    render_options,
    total_warning,
    transform_counts,
    transform_diff,
    transform_items,
    transform_profile,
)
from flamed.commands._argtypes import jobs as jobs_type
from flamed.commands.base import Command
from flamed.errors import UsageError
from flamed.fileio import open_output
from flamed.folded import ReadStats
from flamed.diff import read_differential
from flamed.inputs import all_folded, differential_inputs, load_profile, open_sample_streams, untimed_note
from flamed.layout import StackTable, table_from_keyed, table_from_profile
from flamed.model import Weight
from flamed.outputs.base import OutputOptions
from flamed.outputs._timeline import lanes
from flamed.outputs.svg import render_chart, render_table


class SvgCommand(Command):
    """Draw folded stacks as an interactive SVG flame graph.

    Inputs are folded text (fastest), or anything `flamed collapse` reads
    (perf script, bcc, py-spy), or pprof / speedscope files.

    Differential input -- difffolded.pl's 'stack BEFORE AFTER' lines -- is
    drawn as `flamed diff` draws it: AFTER's widths, colored by each box's own
    change (--inclusive: by the change under it).

    The SVG is self-contained (no network): hover for details, click a box to
    zoom, "Reset Zoom" (or Esc) to go back, "Search" (or Ctrl-F) for a regex,
    whose matched share is shown bottom right.

    examples:
      flamed svg out.folded -o out.svg
      flamed svg --palette mixed --title "web-1, 30 s" a.folded b.folded.gz > both.svg
      flamed svg --inverted --minwidth 0.5% out.folded -o icicle.svg
      flamed svg --flamechart trace.folded -o chart.svg     # input order = time
      flamed svg --palette-file colors.map before.folded -o before.svg
      flamed svg --cp --total 5000 --nameattr links.tsv in.folded > in.svg   # flamegraph.pl's options
    """

    name = "svg"
    progress = True
    order = 30

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="*", metavar="INPUT", help="folded files (gzip ok); default stdin")
        parser.add_argument("-o", "--output", help="output file (default stdout), written atomically")
        parser.add_argument("--strict", action="store_true", help="fail on the first malformed line")
        parser.add_argument(
            "-j",
            "--jobs",
            type=jobs_type(),
            default=1,
            help="processes counting a large (>64 MB, not gzip) folded file (default 1: on a busy machine more "
            "is slower); output is the same for any number",
        )
        add_render_arguments(parser)
        add_delta_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        options = render_options(args)
        stats = ReadStats()
        differential = differential_inputs(args.inputs)
        if differential:
            if options.flamechart:
                raise UsageError("--flamechart does not draw differential (BEFORE AFTER) input; leave it out")
            diff = transform_diff(read_differential(args.inputs, strict=args.strict, stats=stats), args)
            with open_output(args.output) as out:
                n = render_diff(diff, out, options, inclusive=args.inclusive)
            return self._done(n, diff.after_total, stats, options)
        folded = all_folded(args.inputs)
        if options.flamechart:
            if folded:
                items = read_ordered(args.inputs, strict=args.strict, stats=stats)
            else:
                with contextlib.ExitStack() as files:
                    # Inputs with timestamps (perf script, traces): their samples in time order.
                    mixed: list[str] = []
                    stream = open_sample_streams(args.inputs, files, strict=args.strict, stats=stats, mixed=mixed)
                    if mixed:
                        self.warn(untimed_note(mixed, "the flame chart"))
                    items = lanes(stream) if stream is not None else []  # one lane per thread
                if stream is None:
                    items = list(load_profile(args.inputs, strict=args.strict, stats=stats).stacks.items())
            items = transform_items(items, args)
            total = sum(w for _, w in items if w > 0)
            with open_output(args.output) as out:
                n = render_chart(items, out, options)
        else:
            # Folded text skips the Profile: counted by stack text, split once per box drawn.
            table: StackTable[bytes] | StackTable[str]
            if folded:
                counts = read_counts(args.inputs, strict=args.strict, stats=stats, jobs=args.jobs)
                table = table_from_keyed(transform_counts(counts, args))
            else:
                table = table_from_profile(transform_profile(load_profile(args.inputs, strict=args.strict, stats=stats), args))
            total = table.total
            with open_output(args.output) as out:
                n = render_table(table, out, options)
        return self._done(n, total, stats, options)

    def _done(self, boxes: int, total: Weight, stats: ReadStats, options: OutputOptions) -> int:
        for message in (*stats.notes, stats.summary(), total_warning(total, options)):
            if message:
                self.warn(message)
        if boxes == 0:
            self.warn("no stacks in the input; the graph is empty")
        return 0
