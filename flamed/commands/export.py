"""Command ``flamed export``: profiles to pprof, speedscope, chrome trace and the other formats."""

from __future__ import annotations

import argparse
import contextlib

from flamed.commands._argtypes import integer, number
from flamed.commands.base import Command
from flamed.errors import UsageError
from flamed.fileio import open_output
from flamed.folded import ReadStats
from flamed.inputs import load_profile, open_sample_streams, untimed_note
from flamed.model import INT64_MAX
from flamed.outputs import choose, names
from flamed.outputs.base import OutputOptions
from flamed.outputs.trace import TraceFormat, with_task_roots


#: --sample-rate's range: a period (1e9 / rate ns, pprof's int64) from 1 ns to 1e18 ns (31 years).
MIN_RATE, MAX_RATE = 1e-9, 1e9


class ExportCommand(Command):
    """Convert profiles to another format (pprof, speedscope, chrometrace, json, svg, folded).

    Inputs may be folded text, pprof or speedscope files, or anything
    `flamed collapse` reads; they are summed into one profile.  For
    speedscope and chrometrace, inputs that keep time (perf script,
    'TIMESTAMP STACK' traces) become per-thread timelines instead
    (--aggregate writes the summed profile).  The format
    comes from --format, else from the output's extension (.pb.gz, .svg,
    .speedscope.json, .trace.json, ...).

    examples:
      flamed export --format pprof -o cpu.pb.gz out.folded && go tool pprof -top cpu.pb.gz
      flamed export -o out.speedscope.json a.folded b.folded
      flamed export --format folded cpu.pb.gz > back.folded
      flamed export -o timeline.trace.json perf-script.txt     # open in ui.perfetto.dev
      flamed export --format pprof --sample-rate 99 --start-ns 1764676800000000000 out.folded > out.pb.gz
    """

    name = "export"
    progress = True
    order = 35

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="*", metavar="INPUT", help="input files (gzip ok); default stdin")
        parser.add_argument("-f", "--format", help=f"output format: {', '.join(names())}")
        parser.add_argument("-o", "--output", help="output file (default stdout), written atomically")
        parser.add_argument("--strict", action="store_true", help="fail on the first malformed line")
        parser.add_argument("--sample-rate", type=number(MIN_RATE, MAX_RATE, what="a rate in Hz"),
                            help="sampling rate in Hz, when the input does not say")
        parser.add_argument("--start-ns", type=integer(0, INT64_MAX, what="ns since the epoch"),
                            help="start time (ns since the epoch), when the input does not say")
        parser.add_argument("--duration-ns", type=integer(0, INT64_MAX, what="a duration in ns"),
                            help="duration in ns, when the input does not say")
        parser.add_argument("--title", help="profile name (speedscope) or graph title (svg)")
        parser.add_argument(
            "--aggregate",
            action="store_true",
            help="for speedscope/chrometrace: write the summed profile even when the inputs keep time",
        )

    def run(self, args: argparse.Namespace) -> int:
        if args.format is None and (args.output is None or args.output == "-"):
            raise UsageError("name the output format with --format (or use an output file with a known extension)")
        fmt = choose(args.format, args.output)
        extra = {"sample_rate": str(args.sample_rate)} if args.sample_rate else {}
        options = OutputOptions(title=args.title, extra=extra)
        stats = ReadStats()
        if fmt.wants_samples and not args.aggregate and args.inputs:
            # Inputs with timestamps (perf script, traces) become a timeline.
            with contextlib.ExitStack() as files:
                mixed: list[str] = []
                stream = open_sample_streams(args.inputs, files, strict=args.strict, stats=stats, mixed=mixed)
                if mixed:
                    self.warn(untimed_note(mixed, f"the {fmt.name} output"))
                if stream is not None:
                    if isinstance(fmt, TraceFormat):
                        stream = with_task_roots(stream)
                    with open_output(args.output) as out:
                        fmt.write_samples(stream, out, options)
                    for note in stats.notes:
                        self.warn(note)
                    summary = stats.summary()
                    if summary:
                        self.warn(summary)
                    return 0
        profile = load_profile(args.inputs, strict=args.strict, stats=stats)
        if args.sample_rate is not None and profile.sample_rate is None:
            profile.sample_rate = args.sample_rate
        if args.start_ns is not None and profile.start_ns is None:
            profile.start_ns = args.start_ns
        if args.duration_ns is not None and profile.start_ns is not None and profile.end_ns is None:
            if profile.start_ns + args.duration_ns > INT64_MAX:
                raise UsageError(
                    f"--duration-ns {args.duration_ns} from the start {profile.start_ns} ends past "
                    f"{INT64_MAX} ns, the largest time the formats carry"
                )
            profile.end_ns = profile.start_ns + args.duration_ns
        with open_output(args.output) as out:
            fmt.write(profile, out, options)
        summary = stats.summary()
        if summary:
            self.warn(summary)
        return 0
