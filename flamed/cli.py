"""``flamed`` command line: turns flags into options and calls the library.

``main(argv) -> int`` is what tests call; ``entry()`` is the console script.
Only this module prints errors and chooses exit codes.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from flamed import __version__
from flamed.errors import FlamedError
from flamed.fileio import StdoutError, StdoutWriter


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
    out = stdout if stdout is not None else sys.stdout
    words = list(argv) if argv is not None else sys.argv[1:]
    name = "flamed"
    code: int | None = None
    try:
        if words == ["--version"]:
            # Answered before any command module is imported: as fast as the interpreter starts.
            print(f"flamed {__version__}", file=out)
            code = 0
        else:
            code, name = _parse_and_run(words, stdout, stderr, err)
        if out is not None:
            out.flush()  # what is still buffered: failing to write it fails the command
    except BrokenPipeError:
        # The reader went away (`flamed --help | head -1`): not an error of ours.
        _discard_stdout()
        return code or 0
    except StdoutError as e:
        print(f"{name}: error: {e}", file=err)
        _discard_stdout()
        return e.exit_code
    return code or 0


def _parse_and_run(
    words: list[str], stdout: TextIO | None, stderr: TextIO | None, err: TextIO
) -> tuple[int, str]:
    """The exit code of the command ``words`` name, and the name errors start with."""
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
            return 2, "flamed"
        return int(e.code or 0), "flamed"
    cmd = getattr(args, "_command", None)
    if cmd is None:
        parser.print_help(stdout if stdout is not None else sys.stdout)
        return 2, "flamed"
    name = f"flamed {cmd.name}"
    try:
        if not cmd.progress:
            return int(cmd.run(args) or 0), name
        from flamed.progress import reading

        # A long job over large inputs draws its progress on a terminal's stderr
        # (flamed.progress), cleared before whatever ends the run is printed.
        with reading(cmd.stderr, list(getattr(args, "inputs", None) or [None]), cmd.name):
            return int(cmd.run(args) or 0), name
    except FlamedError as e:
        print(f"{name}: error: {e}", file=err)
        if isinstance(e, StdoutError):
            _discard_stdout()
        return e.exit_code, name
    except KeyboardInterrupt:
        _sigint_ends_the_process()
        print(f"{name}: interrupted", file=err)
        return 130, name
    except BrokenPipeError:
        _discard_stdout()
        return 0, name


class _CheckedStdout(StdoutWriter):
    """The process's standard output under ``sys.stdout``: a failed write is a
    :class:`StdoutError` naming standard output, where Python would print a
    traceback (or, at exit, "Exception ignored"); a reader gone away stays a
    ``BrokenPipeError``, which :func:`main` ends quietly."""

    #: Every write reaches the descriptor at once (python -u, PYTHONUNBUFFERED), as before.
    unbuffered = False

    def write(self, data: bytes) -> int:  # type: ignore[override]
        n = super().write(data)
        if self.unbuffered:
            self.flush()
        return n


def _check_stdout() -> None:
    """Put :class:`_CheckedStdout` under ``sys.stdout`` (help, --version, and
    every command's ``print`` go through it), keeping its encoding and buffering."""
    old = sys.stdout
    if old is None:
        return  # fd 1 closed at start-up: commands that print say so
    try:
        fd = old.fileno()
    except (AttributeError, OSError, ValueError):
        return
    old.flush()
    checked = _CheckedStdout(io.FileIO(fd, "wb", closefd=False))
    checked.unbuffered = not isinstance(getattr(old, "buffer", None), io.BufferedWriter)
    sys.stdout = io.TextIOWrapper(
        checked,
        encoding=old.encoding, errors=old.errors,
        line_buffering=bool(old.line_buffering), write_through=bool(getattr(old, "write_through", False)),
    )


def _discard_stdout() -> None:
    """After a failed write to standard output: whatever is still buffered goes
    to /dev/null, so the interpreter's flush at exit finds nothing to complain about.
    Only in the ``flamed`` process itself: a caller's descriptors are its own."""
    if not STANDALONE:
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    except OSError:
        pass


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


def _sigint_ends_the_process() -> None:
    """Once a command has ended (or been interrupted), another Ctrl-C ends the
    process at once, by the signal, as a shell expects: raised as
    KeyboardInterrupt it landed in the output's last flush or the interpreter's
    shutdown and printed a traceback (two Ctrl-C 10 ms apart).  Only in the
    ``flamed`` process itself, not in a caller's."""
    if not STANDALONE:
        return
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def entry() -> None:
    _reserve_std_fds()
    _check_stdout()
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130  # a second Ctrl-C before the first had been handled
    _sigint_ends_the_process()
    sys.exit(code)


if __name__ == "__main__":
    entry()
