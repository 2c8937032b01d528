"""``flamed`` command line: turns flags into options and calls the library.

``main(argv) -> int`` is what tests call; ``entry()`` is the console script.
Only this module prints errors and chooses exit codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from flamed import __version__
from flamed.errors import FlamedError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, the usual exit code 2; the usage line helps more than a traceback.
        # (Part of the message, so it goes where main() prints errors.)
        raise SystemExit(f"{self.format_usage()}{self.prog}: error: {message}") from None


def _cleandoc(doc: str) -> str:
    """inspect.cleandoc without importing inspect (and ast, dis, ...): a few ms of every start-up."""
    lines = doc.expandtabs().splitlines()
    indents = [len(ln) - len(ln.lstrip()) for ln in lines[1:] if ln.strip()]
    margin = min(indents) if indents else 0
    out = [lines[0].strip()] + [ln[margin:].rstrip() for ln in lines[1:]] if lines else []
    while out and not out[0]:
        out.pop(0)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word not an option), if any."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a
    return None


def build_parser(
    stdout: TextIO | None = None, stderr: TextIO | None = None, argv: Sequence[str] | None = None
) -> argparse.ArgumentParser:
    """The parser; given ``argv``, only the subcommand it names is imported and given its options.

    Start-up is what a command costs before its work: listing every command
    (for ``--help``) needs each one's summary, but parsing ``flamed svg ...``
    needs the options of ``svg`` only.
    """
    from flamed.commands import discover

    chosen = _chosen_command(argv) if argv is not None else None
    parser = _Parser(
        prog="flamed",
        description="System-wide continuous profiler and flame graph toolkit.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flamed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cls in discover(chosen):
        doc = _cleandoc(cls.__doc__ or "")
        summary = doc.splitlines()[0] if doc else cls.name
        p = sub.add_parser(
            cls.name,
            help=summary,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd = cls(stdout=stdout, stderr=stderr)
        if chosen is None or cls.name == chosen:
            cmd.add_arguments(p)
        p.set_defaults(_command=cmd, _parser=p)
    return parser


#: True while ``main`` runs as the process's own command (``flamed ...``,
#: ``python -m flamed``: no argv given), not called from other Python code: only
#: then may a command change process-wide state such as how bcc is loaded.
STANDALONE = False


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    global STANDALONE
    STANDALONE = argv is None
    err = stderr if stderr is not None else sys.stderr
    words = list(argv) if argv is not None else sys.argv[1:]
    if words == ["--version"]:
        # Answered before any command module is imported: as fast as the interpreter starts.
        print(f"flamed {__version__}", file=stdout if stdout is not None else sys.stdout)
        return 0
    parser = build_parser(stdout, stderr, words)
    try:
        args, extra = parser.parse_known_args(words)
        if extra:
            # argparse hands a subcommand's unknown options up to the top-level
            # parser, whose usage line does not list them: show the subcommand's.
            sub: argparse.ArgumentParser = getattr(args, "_parser", None) or parser
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
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
        if not cmd.progress:
            return int(cmd.run(args) or 0)
        from flamed.progress import reading

        # A long job over large inputs draws its progress on a terminal's stderr
        # (flamed.progress), cleared before whatever ends the run is printed.
        with reading(cmd.stderr, list(getattr(args, "inputs", None) or [None]), cmd.name):
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
