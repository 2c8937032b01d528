"""Command ``flamed dump``: every thread's stack of a process, now."""

from __future__ import annotations

import argparse
import json

from flamed.commands.base import Command


class DumpCommand(Command):
    """Print the current stack of every thread of a process (a hung one).

    For each thread: tid, name, scheduler state, wait channel, the kernel
    stack (/proc/PID/task/TID/stack, root only) and, for CPython 3.8-3.13,
    its Python frames innermost first, read from the process's memory
    without stopping it (needs root or CAP_SYS_PTRACE); for older ones
    (2.7, 3.6, 3.7) `py-spy dump --nonblocking` reads them, when a py-spy is
    found (next to flamed's python, else on PATH). Native (C) frames
    are not shown. A process that is not Python gets its threads' states
    and kernel stacks, with the reason it has no Python frames.

    examples:
      flamed dump -p 1234
      flamed dump -p 1234 --json | jq '.threads[] | {tid, state, python}'
    """

    name = "dump"
    order = 45

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-p", "--pid", type=int, required=True, metavar="PID", help="the process to dump")
        parser.add_argument("--json", action="store_true",
                            help="one JSON document (schema in docs/dump.md) instead of text")
        parser.add_argument("--pyspy-binary", metavar="PATH",
                            help="py-spy for interpreters flamed cannot read itself (before 3.8; "
                                 "default: next to python, else PATH)")

    def run(self, args: argparse.Namespace) -> int:
        from flamed.dump import dump_process, format_text, to_json
        from flamed.fileio import write_text

        from flamed.pyspy.supervisor import find_pyspy

        dump = dump_process(args.pid, pyspy=find_pyspy(args.pyspy_binary))
        if args.json:
            write_text(self.stdout, json.dumps(to_json(dump), indent=2, ensure_ascii=False) + "\n")
        else:
            write_text(self.stdout, format_text(dump))
        return 0
