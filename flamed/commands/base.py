"""The shape of a subcommand."""

from __future__ import annotations

import argparse
import sys
from typing import ClassVar, TextIO

from flamed.progress import active as active_progress
from flamed.errors import FlamedError


class Command:
    """Base of subcommands. The subclass docstring becomes ``--help`` text:
    first line the summary, the rest (examples included) the description."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 50
    #: Draws a progress line on a terminal's stderr while it reads large inputs (flamed.progress).
    progress: ClassVar[bool] = False

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        # None when the process was started with fd 1 closed (`>&-`): only
        # commands that print fail then, through the property below.
        self._stdout: TextIO | None = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr

    @property
    def stdout(self) -> TextIO:
        if self._stdout is None:
            raise FlamedError(
                f"standard output is closed and '{self.name}' prints there; redirect it to a file (>FILE) instead"
            )
        return self._stdout

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare this command's options."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit code. Raise FlamedError for user errors."""
        raise NotImplementedError

    def warn(self, message: str) -> None:
        prog = active_progress()
        if prog is not None and prog.stream is self.stderr:
            prog.finish()  # the message on a line of its own; the progress line is drawn again below it
        print(f"flamed {self.name}: {message}", file=self.stderr)
