"""Command ``flamed collapse``: perf script, bcc, py-spy, traces or folded -> folded (or any output format)."""

from __future__ import annotations

import argparse

from flamed.collapse import names as input_formats
from flamed.collapse.base import ANNOTATIONS, CollapseOptions
from flamed.collapse.driver import DEFAULT_CHUNK_BYTES, CollapseResult, collapse, default_jobs
from flamed.commands._argtypes import jobs as jobs_type
from flamed.commands.base import Command
from flamed.errors import UsageError
from flamed.fileio import open_output
from flamed.folded import ReadStats
from flamed.inputs import foreign_kind, load_profile
from flamed.model import Profile
from flamed.outputs import choose, get
from flamed.outputs import names as output_formats
from flamed.outputs.base import OutputOptions


def add_input_arguments(parser: argparse.ArgumentParser, *, jobs: bool = True) -> None:
    """The options every command reading profiler output takes (collapse, top, tree)."""
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="input files (gzip ok); default stdin")
    g = parser.add_argument_group("input")
    g.add_argument(
        "--format",
        dest="input_format",
        choices=input_formats(),
        help="input format (default: guessed from the first lines of each input)",
    )
    g.add_argument("--strict", action="store_true", help="fail on the first malformed line instead of skipping it")
    g.add_argument("--pid", action="store_true", help="root frame 'comm-PID' instead of 'comm'")
    g.add_argument("--tid", action="store_true", help="root frame 'comm-PID/TID' (perf: needs -F pid,tid)")
    g.add_argument("--event", help="perf: keep this event only (default: the first one, named on stderr)")
    g.add_argument(
        "--weight",
        choices=("period", "samples"),
        default="period",
        help="perf: weigh samples by their period when present (default, as stackcollapse-perf.pl) or count them",
    )
    g.add_argument(
        "--annotate",
        default=",".join(ANNOTATIONS),
        metavar="LIST",
        help="frame suffixes to add: kernel (_[k]), jit (_[j]), inline (_[i]); "
        "comma-separated, 'none' for none (default: kernel,jit,inline)",
    )
    if jobs:
        g.add_argument(
            "-j",
            "--jobs",
            type=jobs_type(),
            default=None,
            help=f"worker processes (default: CPUs available, now {default_jobs()}); output is identical for any N",
        )
        g.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_BYTES, metavar="BYTES", help=argparse.SUPPRESS)


def collapse_options(args: argparse.Namespace) -> CollapseOptions:
    ann = {a.strip() for a in str(args.annotate).split(",") if a.strip()}
    if ann == {"none"}:
        ann = set()
    bad = ann - set(ANNOTATIONS)
    if bad:
        raise UsageError(f"--annotate: unknown annotation(s) {', '.join(sorted(bad))}; known: {', '.join(ANNOTATIONS)}")
    return CollapseOptions(
        include_pid=args.pid or args.tid,
        include_tid=args.tid,
        annotate=frozenset(ann),
        event=args.event,
        weight=args.weight,
        strict=args.strict,
    )


def run_collapse(cmd: Command, args: argparse.Namespace) -> CollapseResult:
    jobs = getattr(args, "jobs", None)
    chunk = getattr(args, "chunk_size", DEFAULT_CHUNK_BYTES)
    if chunk < 1024:
        raise UsageError("--chunk-size must be at least 1024 bytes")
    # pprof and speedscope files (flamed's own exports, `record -o x.pb.gz`) are read as
    # profiles, as svg and export read them; the rest is collapsed.
    foreign = [p for p in args.inputs if foreign_kind(p) != "other"] if args.input_format is None else []
    rest = [p for p in args.inputs if p not in foreign]
    if foreign and not rest:
        res = CollapseResult(Profile(), ReadStats())
    else:
        res = collapse(
            rest,
            fmt=args.input_format,
            options=collapse_options(args),
            jobs=jobs if jobs is not None else default_jobs(),
            chunk_bytes=chunk,
            progress_stream=cmd.stderr,
        )
    if foreign:
        stats = ReadStats()
        read = load_profile(foreign, strict=args.strict, stats=stats)
        res.profile = res.profile.merged(read) if rest else read
        res.stats.merge(stats)
    for m in res.messages:
        cmd.warn(m)
    summary = res.stats.summary()
    if summary:
        cmd.warn(summary)
    return res


class CollapseCommand(Command):
    """Collapse profiler output into folded stacks (or any output format).

    Reads perf script text, bcc profile output (folded or multi-line), py-spy
    raw output, timestamped traces ('TIMESTAMP STACK [COUNT]') and folded
    stacks; the format is guessed unless --format names it.  pprof and
    speedscope files (flamed's exports) named by path are read as profiles. Large inputs are
    split at sample boundaries and parsed by --jobs worker processes; the
    output is byte-identical for any number of jobs. Memory grows with the
    number of distinct stacks, not with the input size.

    A ';' inside a frame (Rust's '[u8; 32]', a thread named 'job;2') cannot be
    written in folded text: it becomes ':'.

    examples:
      perf record -g -a -- sleep 10 && perf script | flamed collapse > out.folded
      flamed collapse perf.txt.gz --pid -o out.folded
      flamed collapse --event cpu-clock --jobs 4 big.perf.txt -o out.folded
      profile-bpfcc -F 99 10 | flamed collapse --format bcc > out.folded
      flamed collapse perf.txt -o out.svg        # any output format, by extension
    """

    name = "collapse"
    progress = True
    order = 10

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_input_arguments(parser)
        parser.add_argument("-o", "--output", help="output file (default stdout), written atomically")
        parser.add_argument(
            "--output-format",
            # collapse sums the samples: a format of single samples (trace) is not one it can write
            choices=[n for n in output_formats() if get(n).writes_profiles],
            help="output format (default: from the -o extension, else folded)",
        )

    def run(self, args: argparse.Namespace) -> int:
        fmt = choose(args.output_format, args.output)
        if not fmt.writes_profiles:  # -o x.trace: said before the input is read, not after
            raise UsageError(f"collapse sums the samples into stacks, and {fmt.name} output keeps each sample "
                             f"with its time: use 'flamed export --format {fmt.name}' or 'flamed merge'")
        res = run_collapse(self, args)
        with open_output(args.output) as out:
            fmt.write(res.profile, out, OutputOptions())
        if not res.profile.stacks:
            self.warn("no samples in the input")
        return 0
