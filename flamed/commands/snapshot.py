"""The `flamed snapshot` command."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flamed.commands._argtypes import PID_MAX, WEEK_S, integer, number
from flamed.commands.base import Command
from flamed.daemon.client import DEFAULT_SOCKET, request
from flamed.errors import FlamedError, UsageError
from flamed.fileio import open_output

#: --seconds, --next: what the daemon's protocol takes (above 0, up to a week);
#: --timeout too (seconds to wait for the daemon; `--next` waits on top of it).
_SECONDS = number(0, WEEK_S, above=True, what="seconds")
_ID = integer(0, PID_MAX, what="a process or thread id")


class SnapshotCommand(Command):
    """Get a profile of the last (or next) N seconds from the running daemon.

    Talks to the daemon's control socket; filters run in the daemon, the output
    format is any registered one (folded, svg, ...).

    Examples:
      flamed snapshot --seconds 30 --pid 1234 --format svg -o now.svg
      flamed snapshot --next 10 --comm '^python' > next10.folded
      flamed snapshot --frame 'ext4_' --frames kernel --format folded
      flamed snapshot --unit nginx.service --root unit,pid
      flamed snapshot --container 3f2a9c1b --format pprof -o web.pb.gz
      flamed snapshot --kind offcpu --seconds 30 -o waits.svg   # [sampling] off_cpu = true
      flamed snapshot --flush             # close the current file now
    """

    name = "snapshot"
    order = 81

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--socket", metavar="PATH", default=DEFAULT_SOCKET, help=f"control socket (default {DEFAULT_SOCKET})")
        when = parser.add_mutually_exclusive_group()
        when.add_argument("--seconds", metavar="N", type=_SECONDS,
                          help="the last N seconds, from memory, up to a week (default 60)")
        when.add_argument("--next", metavar="N", type=_SECONDS,
                          help="the next N seconds (waits), up to a week (and the daemon's "
                               "snapshot.max_next_seconds)")
        parser.add_argument("--kind", choices=("cpu", "offcpu"), default="cpu",
                            help="cpu: CPU samples (default); offcpu: time off the CPU, in microseconds "
                                 "(nanoseconds in pprof), from a daemon with [sampling] off_cpu = true")
        parser.add_argument("--pid", metavar="PID", type=_ID, action="append", help="only this process (repeatable)")
        parser.add_argument("--tid", metavar="TID", type=_ID, action="append", help="only this thread (repeatable)")
        parser.add_argument("--comm", metavar="REGEX", help="only tasks whose comm matches")
        parser.add_argument("--frame", metavar="REGEX", help="only stacks with a frame matching")
        parser.add_argument("--exclude-frame", metavar="REGEX", help="drop stacks with a frame matching")
        parser.add_argument("--frames", choices=("all", "kernel", "user"), default="all",
                            help="keep only kernel or only user frames (default all)")
        parser.add_argument("--unit", metavar="UNIT", action="append",
                            help="only tasks of this systemd unit (nginx.service or nginx; repeatable)")
        parser.add_argument("--container", metavar="NAME|ID", action="append",
                            help="only tasks of this container: its name or an id prefix (repeatable)")
        parser.add_argument("--pod", metavar="UID", action="append", help="only tasks of this pod UID (repeatable)")
        parser.add_argument("--cgroup", metavar="PATH", action="append",
                            help="only tasks in this cgroup v2 path or below it (/system.slice/x.service, "
                                 "/sys/fs/cgroup/..., a unit, or an id; repeatable)")
        parser.add_argument("--root", metavar="FRAMES", type=root_spec,
                            help="root frames, root first: comm, pid, tid or none, or a comma-separated list "
                                 "adding unit, container, cgroup, e.g. container,pid "
                                 "(default: the daemon's output.root_frame)")
        parser.add_argument("--format", "-f", metavar="F", help="output format (default: by -o extension, else folded)")
        parser.add_argument("--title", metavar="TEXT", help="title for graphical formats")
        parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout (atomically)")
        parser.add_argument("--flush", action="store_true",
                            help="ask the daemon to close the current file now (alone: no profile options)")
        parser.add_argument("--timeout", metavar="S", type=_SECONDS, default=30.0,
                            help="socket timeout (default 30)")

    def run(self, args: argparse.Namespace) -> int:
        if args.flush:
            given = [opt for opt, dest, default in _PROFILE_OPTIONS if getattr(args, dest) not in (None, default)]
            if given:
                raise UsageError(f"--flush only closes the daemon's current file and gets no profile: "
                                 f"{', '.join(given)} cannot go with it (run the snapshot on its own)")
            return flush(self, args.socket, args.timeout)
        from flamed import outputs

        fmt = args.format
        if fmt is None and args.output and args.output != "-":
            fmt = outputs.choose(None, args.output).name
        req: dict[str, Any] = {"request": "snapshot", "format": fmt or "folded", "frames": args.frames}
        if args.kind != "cpu":
            req["kind"] = args.kind  # a daemon without the field refuses it, rather than answer CPU samples
        for key in ("seconds", "next", "comm", "frame", "title", "root"):
            v = getattr(args, key)
            if v is not None:
                req[key] = v
        if args.exclude_frame is not None:
            req["exclude_frame"] = args.exclude_frame
        if args.pid:
            req["pid"] = args.pid
        if args.tid:
            req["tid"] = args.tid
        for key in ("unit", "container", "pod", "cgroup"):
            if getattr(args, key):
                req[key] = getattr(args, key)
        with open_output(args.output) as out:
            head = request(args.socket, req, out, timeout=args.timeout)
        if head.get("stacks") == 0:
            what = "no off-CPU time" if args.kind == "offcpu" else "no samples"
            self.warn(f"{what} matched (check the filters, or wait for the first drain)")
        if head.get("partial"):
            return self._partial(args, head)
        return 0

    def _partial(self, args: argparse.Namespace, head: dict[str, Any]) -> int:
        """Say that the profile (written) covers less than asked, and why.  Exit 1 when a
        ``--next`` span was cut short, 0 when ``--seconds`` reaches past the daemon's memory."""
        asked = args.next if args.next is not None else args.seconds if args.seconds is not None else 60.0
        start, end = head.get("start_ns"), head.get("end_ns")
        covers = (f"covers {(end - start) / 1e9:.1f} s of the {asked:g} s asked"
                  if isinstance(start, int) and isinstance(end, int) else f"is empty ({asked:g} s asked)")
        reason = head.get("partial_reason")
        if reason == "stopping":
            why = "the daemon stopped before the span ended"
        elif reason == "ring" and args.next is not None:
            why = "the daemon evicted the span's oldest windows before it ended (snapshot.ring_max_stacks)"
        elif reason == "ring":
            why = ("the daemon holds no older windows in memory (it keeps snapshot.ring_seconds of them, "
                   "and only since it started)")
        elif reason == "drain_timeout":
            why = "the daemon did not drain at the end of the span in time"
        else:
            why = f"the daemon says: {reason}"
        self.warn(f"the profile {covers}: {why}")
        return 1 if args.next is not None else 0


#: Options of a profile request, which --flush does not take: (option, dest, default).
_PROFILE_OPTIONS = (
    ("--seconds", "seconds", None), ("--next", "next", None), ("--kind", "kind", "cpu"), ("--pid", "pid", None),
    ("--tid", "tid", None), ("--comm", "comm", None), ("--frame", "frame", None),
    ("--exclude-frame", "exclude_frame", None), ("--frames", "frames", "all"), ("--unit", "unit", None),
    ("--container", "container", None), ("--pod", "pod", None), ("--cgroup", "cgroup", None),
    ("--root", "root", None), ("--format", "format", None), ("--title", "title", None), ("--output", "output", None),
)


def root_spec(text: str) -> str:
    """argparse type of ``--root``: a root spec in its canonical spelling."""
    from flamed.sampling.contract import canonical_root

    try:
        return canonical_root(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class FlushCommand(Command):
    """Ask the running daemon to close its current profile file now.

    Prints the path of the file written.

    Examples:
      flamed flush
      flamed flush --socket ./var/flamed.sock
    """

    name = "flush"
    order = 83

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--socket", metavar="PATH", default=DEFAULT_SOCKET, help=f"control socket (default {DEFAULT_SOCKET})")
        parser.add_argument("--timeout", metavar="S", type=_SECONDS, default=60.0,
                            help="seconds to wait for the daemon (default 60)")

    def run(self, args: argparse.Namespace) -> int:
        return flush(self, args.socket, args.timeout)


def flush(cmd: Command, socket: str, timeout: float) -> int:
    """Ask the daemon to close its current file; print its path.  Exit 1 when the daemon
    closed it but could not write it (the state directory refuses writes)."""
    head = request(socket, {"request": "flush"}, timeout=timeout)
    if head.get("file"):
        print(head["file"], file=cmd.stdout)
        return 0
    error = head.get("write_error")
    if error:
        raise FlamedError(f"the daemon closed the file but could not write it: {error}; it keeps the unwritten "
                          "file(s) in memory and retries at every drain (flamed status shows the backlog)")
    print("nothing to write yet", file=cmd.stdout)
    return 0
