"""``flamed`` command line: turns flags into options and calls the library.

``main(argv) -> int`` is what tests call; ``entry()`` is the console script.
Only this module prints errors and chooses exit codes.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from flamed import __version__
from flamed.commands import discover
from flamed.errors import FlamedError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, the usual exit code 2; the usage line helps more than a traceback.
        self.print_usage(sys.stderr)
        raise SystemExit(f"{self.prog}: error: {message}") from None


def build_parser(stdout: TextIO | None = None, stderr: TextIO | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flamed",
        description="System-wide continuous profiler and flame graph toolkit.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flamed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cls in discover():
        doc = inspect.cleandoc(cls.__doc__ or "")
        summary = doc.splitlines()[0] if doc else cls.name
        p = sub.add_parser(
            cls.name,
            help=summary,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd = cls(stdout=stdout, stderr=stderr)
        cmd.add_arguments(p)
        p.set_defaults(_command=cmd)
    return parser


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    err = stderr if stderr is not None else sys.stderr
    parser = build_parser(stdout, stderr)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=err)
            return 2
        return int(e.code or 0)
    cmd = getattr(args, "_command", None)
    if cmd is None:
        parser.print_help(stdout if stdout is not None else sys.stdout)
        return 2
    try:
        return int(cmd.run(args) or 0)
    except FlamedError as e:
        print(f"flamed {cmd.name}: error: {e}", file=err)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"flamed {cmd.name}: interrupted", file=err)
        return 130
    except BrokenPipeError:
        return 0


def _reserve_std_fds() -> None:
    """Put /dev/null on whichever of fds 0-2 the caller closed (`<&-`, `>&-`).

    Python has already left sys.stdin/sys.stdout None for them, which is how
    the commands see a closed stream and say so. Without this, the next file
    opened would get that number, and a child process (or anything writing to
    fd 1) would write into it.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            new = os.open(os.devnull, os.O_RDWR)
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
    if sys.stderr is None:
        # print(file=None) would write warnings into stdout, among the output.
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def entry() -> None:
    _reserve_std_fds()
    sys.exit(main())


if __name__ == "__main__":
    entry()
