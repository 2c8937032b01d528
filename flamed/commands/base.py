"""The shape of a subcommand."""

from __future__ import annotations

import argparse
import sys
from typing import ClassVar, TextIO


class Command:
    """Base of subcommands. The subclass docstring becomes ``--help`` text:
    first line the summary, the rest (examples included) the description."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 50

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare this command's options."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit code. Raise FlamedError for user errors."""
        raise NotImplementedError

    def warn(self, message: str) -> None:
        print(f"flamed {self.name}: {message}", file=self.stderr)
