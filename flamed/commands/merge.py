"""Command ``flamed merge``: many traces or folded files into one."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re

from flamed.collapse import get as get_input_format
from flamed.collapse import guess
from flamed.collapse import names as input_formats
from flamed.collapse.base import CollapseOptions, Collapser
from flamed.collapse.driver import HEAD_BYTES, collapse, default_jobs, read_head
from flamed.collapse.trace import parse_timestamp
from flamed.commands._argtypes import jobs as jobs_type
from flamed.commands.base import Command
from flamed.errors import UsageError
from flamed.fileio import input_name, open_input, open_output
from flamed.inputs import stdin_head
from flamed.merge import (
    LABEL_ROOTS,
    IdRemapper,
    MergeOptions,
    MergeStats,
    Source,
    aggregate_trace_files,
    distinct_names,
    merge_sources,
    merge_trace_files,
    root_label,
)
from flamed.model import Profile, Stack, parse_task_frame, profile_from_samples, task_frame
from flamed.outputs import choose
from flamed.outputs import names as output_formats
from flamed.outputs.base import OutputOptions


_UNITS = (("ns", 1), ("us", 1_000), ("ms", 1_000_000), ("s", 1_000_000_000))


def parse_time_arg(text: str | None, flag: str) -> int | None:
    """A time bound: as in traces (seconds with decimals, or integer ns), or with a unit (``1700000000s``)."""
    if text is None:
        return None
    for suffix, mult in _UNITS:
        # ASCII digits only: str.isdigit() is true for '²', which int() refuses.
        if text.isascii() and text.endswith(suffix) and text[: -len(suffix)][-1:].isdigit():
            num = text[: -len(suffix)]
            whole, _, frac = num.partition(".")
            if whole.isdigit() and (not frac or frac.isdigit()):
                return int(whole) * mult + (int(frac.ljust(9, "0")[:9]) * mult // 1_000_000_000 if frac else 0)
            break
    t = parse_timestamp(text)
    if t is None:
        raise UsageError(
            f"{flag}: expected seconds with decimals (1700000000.5), integer ns, or a unit (1700000000s, 5ms), got {text!r}"
        )
    return t


def _default_label(path: str | None, name: str | None = None) -> str:
    """The label of an input given no --label: its file name (``name``: with the
    directories that tell it from the others'), without its extensions."""
    name = name if name is not None else os.path.basename(input_name(path))
    name, copy, nth = name.rpartition("#") if re.search(r"#\d+$", name) else (name, "", "")
    for ext in (".gz", ".trace", ".folded", ".txt", ".collapsed"):
        if name.endswith(ext) and len(name) > len(ext):
            name = name[: -len(ext)]
    return name + copy + nth


class MergeCommand(Command):
    """Merge traces or folded files from many processes or hosts.

    Timestamped traces ('TIMESTAMP STACK [COUNT]', and perf script) are merged
    by a streaming k-way merge on timestamps: memory does not grow with the
    inputs. Each input's pids/tids are remapped so no two inputs share one
    (root frames 'comm-PID/TID' follow; a perf script sample's root frame
    names its task so), timestamps are kept as they are.
    An input whose timestamps go backwards is an error naming its file and
    line; --sort sorts it on the fly instead (external sort, bounded memory).
    Folded inputs are summed.

    Times (--from/--to, and in traces): seconds when written with a decimal
    point (1700000000.5), nanoseconds when an integer (1700000000500000000),
    or with a unit (1700000000s, 250ms).

    Output: a merged trace when every input has timestamps, else folded;
    --output-format (or the -o extension) picks any other format (folded
    aggregates the trace; svg, json, ...).

    examples:
      flamed merge host-a.trace host-b.trace -o all.trace
      flamed merge --label web1 --label web2 --label-root label w1.trace w2.trace > all.trace
      flamed merge --from 1700000000s --to 1700000060.5 *.trace.gz --output-format folded > minute.folded
      flamed merge w1.trace w2.trace -o timeline.json --output-format chrometrace
      flamed merge --sort unsorted.trace other.trace -o all.trace
      flamed merge a.folded b.folded.gz -o sum.folded
    """

    name = "merge"
    progress = True
    order = 12

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="+", metavar="INPUT", help="traces, perf scripts or folded files (gzip ok; - is stdin)")
        parser.add_argument("-o", "--output", help="output file (default stdout), written atomically")
        parser.add_argument("--output-format", choices=output_formats(), help="output format (default: trace if every input has timestamps, else folded)")
        parser.add_argument("--format", dest="input_format", choices=input_formats(), help="input format of every input (default: guessed per input)")
        parser.add_argument("--from", dest="time_from", metavar="TIME", help="keep samples at or after TIME: seconds.decimals, integer ns, or with a unit (1700000000s)")
        parser.add_argument("--to", dest="time_to", metavar="TIME", help="keep samples before TIME")
        parser.add_argument("--label", action="append", default=[], metavar="NAME", help="label of each input, in order (default: its file name); e.g. a host name")
        parser.add_argument("--label-root", choices=LABEL_ROOTS, help="put a root frame on every stack: the input's label (label or host), its file name, or pid-N")
        parser.add_argument("--keep-ids", action="store_true", help="do not remap pids/tids that collide between inputs")
        parser.add_argument("--sort", action="store_true", help="sort inputs whose timestamps go backwards (external sort, bounded memory)")
        parser.add_argument("--sort-run", type=int, default=100_000, metavar="N", help="samples per in-memory run of --sort (default 100000)")
        parser.add_argument("--tmpdir", help="directory for --sort's runs (default: system temp dir)")
        parser.add_argument("--time-format", choices=("ns", "seconds"), default="ns", help="timestamps of a trace output (default ns)")
        parser.add_argument("--strict", action="store_true", help="fail on the first malformed line")
        parser.add_argument("-j", "--jobs", type=jobs_type(), default=None, help="worker processes for folded inputs (default: CPUs)")

    def run(self, args: argparse.Namespace) -> int:
        if args.label and len(args.label) != len(args.inputs):
            raise UsageError(f"--label given {len(args.label)} times for {len(args.inputs)} inputs; give one per input")
        if sum(1 for p in args.inputs if p == "-") > 1:
            raise UsageError("stdin (-) can be read only once")
        if args.sort_run < 1:
            raise UsageError("--sort-run must be at least 1")
        start_ns, end_ns = parse_time_arg(args.time_from, "--from"), parse_time_arg(args.time_to, "--to")
        if start_ns is not None and end_ns is not None and end_ns <= start_ns:
            raise UsageError(f"--to ({args.time_to}) must be after --from ({args.time_from}): the range keeps nothing")
        opts = MergeOptions(
            start_ns=start_ns,
            end_ns=end_ns,
            remap_ids=not args.keep_ids,
            label_root=args.label_root,
            sort=args.sort,
            sort_run=args.sort_run,
            tmpdir=args.tmpdir,
        )
        copts = CollapseOptions(strict=args.strict)
        # Two inputs of one name (d1/x.trace, d2/x.trace) keep apart by their directories.
        distinct = distinct_names([input_name(p) for p in args.inputs])
        sources = [
            Source(path=p, name=input_name(p),
                   label=args.label[i] if args.label else _default_label(p, distinct[i]),
                   collapser=self._format(p, args.input_format), file_label=distinct[i])
            for i, p in enumerate(args.inputs)
        ]
        timed = all(s.collapser.timestamped for s in sources)
        fmt = choose(args.output_format, args.output, default="trace" if timed else "folded")
        stats = MergeStats()
        if fmt.wants_samples or timed:
            if not timed:
                untimed = ", ".join(s.name for s in sources if not s.collapser.timestamped)
                raise UsageError(f"{fmt.name} output needs timestamps, and these inputs have none: {untimed}")
            if not fmt.wants_samples and not opts.sort and all(s.collapser.name == "trace" for s in sources):
                with contextlib.ExitStack() as stack:
                    profile = aggregate_trace_files(sources, opts, stack, strict=args.strict, stats=stats)
                with open_output(args.output) as out:
                    fmt.write(profile, out, OutputOptions())
                self._report(stats)
                return 0
            if fmt.name == "trace" and not opts.sort and all(s.collapser.name == "trace" for s in sources):
                # Traces to a trace: line by line, stacks never split (same bytes, several times faster).
                with contextlib.ExitStack() as stack, open_output(args.output) as out:
                    merge_trace_files(sources, opts, stack, out, strict=args.strict, time_format=args.time_format, stats=stats)
                self._report(stats)
                return 0
            with contextlib.ExitStack() as stack:
                merged = merge_sources(sources, opts, stack, collapse_options=copts, stats=stats)
                with open_output(args.output) as out:
                    if fmt.wants_samples:
                        fmt.write_samples(merged, out, OutputOptions(extra={"time_format": args.time_format}))
                    else:
                        fmt.write(profile_from_samples(merged), out, OutputOptions())
            self._report(stats)
            return 0
        if opts.start_ns is not None or opts.end_ns is not None:
            untimed = ", ".join(s.name for s in sources if not s.collapser.timestamped)
            raise UsageError(f"--from/--to need timestamps, and these inputs have none: {untimed}")
        profile = self._sum(sources, opts, copts, args)
        with open_output(args.output) as out:
            fmt.write(profile, out, OutputOptions())
        return 0

    def _report(self, stats: MergeStats) -> None:
        for note in stats.read.notes:
            self.warn(note)
        summary = stats.read.summary()
        if summary:
            self.warn(summary)  # what collapse says: "skipped N malformed lines (first: FILE:LINE: why)"
        if stats.ids_remapped:
            self.warn(f"remapped {stats.ids_remapped} pid/tid(s) that collided between inputs")
        if stats.samples_out == 0:
            self.warn("no samples in the output")

    def _format(self, path: str | None, fmt: str | None) -> Collapser:
        if fmt:
            return get_input_format(fmt)
        if path is None or path == "-":
            # Peek, do not read: the merge reads stdin again from its start.
            return guess(stdin_head(HEAD_BYTES), source="<stdin>")
        with open_input(path) as f:
            return guess(read_head(f), source=input_name(path))

    def _sum(self, sources: list[Source], opts: MergeOptions, copts: CollapseOptions, args: argparse.Namespace) -> Profile:
        """Folded (and other untimed) inputs: collapse each, relabel, sum in input order."""
        remap = IdRemapper() if opts.remap_ids else None
        jobs = args.jobs if args.jobs is not None else default_jobs()
        total = Profile()
        for i, src in enumerate(sources):
            # A timestamped input (perf script) summed beside folded ones names its
            # tasks as the streaming merge names them (comm-PID/TID, comm-?/TID), so
            # its threads stay apart and its ids are remapped like any other input's.
            src_opts = dataclasses.replace(copts, include_tid=True) if src.collapser.timestamped else copts
            res = collapse([src.path] if src.path is not None else [None], fmt=src.collapser.name, options=src_opts, jobs=jobs)
            for m in res.messages:
                self.warn(f"{src.name}: {m}")
            summary = res.stats.summary()
            if summary:
                self.warn(summary)
            p = res.profile

            label = root_label(src, opts.label_root)

            def relabel(stack: Stack, i: int = i, label: str | None = label) -> Stack:
                if remap is not None:
                    task = parse_task_frame(stack[0])
                    if task.pid is not None or task.tid is not None:
                        npid, ntid = remap.task(i, task.pid, task.tid)
                        if npid != task.pid or ntid != task.tid:
                            stack = (task_frame(task.comm, npid, ntid),) + stack[1:]
                if label is not None:
                    stack = (label,) + stack
                elif opts.label_root == "pid":
                    pid = parse_task_frame(stack[0]).pid
                    stack = (f"pid-{pid if pid is not None else '?'}",) + stack
                return stack

            if remap is not None or opts.label_root:
                p = p.map_stacks(relabel)
            total = total.merged(p) if total.stacks else p
        if remap is not None and remap.remapped:
            self.warn(f"remapped {remap.remapped} pid/tid(s) that collided between inputs")
        return total
