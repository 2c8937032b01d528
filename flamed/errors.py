"""The one exception hierarchy of flamed.

Library code raises these; only the entry points (``flamed.cli.main``, the
daemon's top level) print them and choose an exit code.  Messages say what is
wrong and, where there is one, what to do about it.
"""

from __future__ import annotations


class FlamedError(Exception):
    """Base of every error flamed reports to a user."""

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(FlamedError):
    """Bad command-line arguments or option values."""

    exit_code = 2


class InputError(FlamedError):
    """An input file is malformed (strict mode) or cannot be read."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None) -> None:
        where = ""
        if source is not None:
            where = f"{source}:{line}: " if line is not None else f"{source}: "
        super().__init__(where + message)
        self.source = source
        self.line = line


class ConfigError(FlamedError):
    """Invalid configuration; the message names the key at fault."""

    exit_code = 2


class CapabilityError(FlamedError):
    """Missing privilege, kernel feature or tool (BPF, perf events, headers, py-spy)."""

    exit_code = 3
