"""Opening inputs (files, stdin, gzip by magic) and writing outputs atomically."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import sys
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

from flamed.errors import InputError, FlamedError

GZIP_MAGIC = b"\x1f\x8b"


def open_input(path: str | os.PathLike[str] | None) -> BinaryIO:
    """Open ``path`` for binary reading; ``None`` or ``-`` is stdin.

    Gzip input is recognised by its magic bytes, not by the file name.
    """
    if path is None or str(path) == "-":
        raw: BinaryIO = sys.stdin.buffer
        name = "<stdin>"
    else:
        name = str(path)
        try:
            raw = open(path, "rb")  # noqa: SIM115 - returned to the caller
        except FileNotFoundError:
            raise InputError("no such file", source=name) from None
        except IsADirectoryError:
            raise InputError("is a directory, expected a file", source=name) from None
        except PermissionError:
            raise InputError("permission denied", source=name) from None
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type]
    head = buffered.peek(2)[:2]
    if head == GZIP_MAGIC:
        gz = _CheckedGzipFile(fileobj=buffered, mode="rb")
        gz.source = name
        return gz  # type: ignore[return-value]
    return buffered  # type: ignore[return-value]


class _CheckedGzipFile(gzip.GzipFile):
    """A GzipFile whose corrupt or truncated data raises InputError naming the file.

    gzip reports those lazily, while the caller reads, as BadGzipFile, EOFError
    or zlib.error; without this they would escape the CLI as tracebacks.
    """

    source = "<input>"

    def _checked(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise InputError(f"corrupt or truncated gzip data ({e})", source=self.source) from None

    def read(self, size: int | None = -1) -> bytes:
        return self._checked(super().read, size)  # type: ignore[no-any-return]

    def read1(self, size: int = -1) -> bytes:
        return self._checked(super().read1, size)  # type: ignore[no-any-return]

    def readinto(self, b: Any) -> int:
        return self._checked(super().readinto, b)  # type: ignore[no-any-return]

    def peek(self, n: int) -> bytes:
        return self._checked(super().peek, n)  # type: ignore[no-any-return]

    def readline(self, size: int | None = -1) -> bytes:
        return self._checked(super().readline, size)  # type: ignore[no-any-return]


def input_name(path: str | os.PathLike[str] | None) -> str:
    return "<stdin>" if path is None or str(path) == "-" else str(path)


def input_size(path: str | os.PathLike[str] | None) -> int | None:
    """Size in bytes of a regular file input, ``None`` for stdin and pipes."""
    if path is None or str(path) == "-":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if os.path.isfile(path) else None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, mode: int = 0o644, fsync: bool = True) -> Iterator[BinaryIO]:
    """Write ``path`` so that it appears complete or not at all.

    Data goes to a temporary file in the same directory, which is fsynced and
    renamed over ``path``; on any error the temporary file is removed and the
    old ``path`` (if any) is untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        if fsync:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def open_output(path: str | os.PathLike[str] | None) -> Iterator[BinaryIO]:
    """Binary output stream: stdout for ``None``/``-``, else an atomic file write."""
    if path is None or str(path) == "-":
        out = sys.stdout.buffer
        try:
            yield out
            out.flush()
        except BrokenPipeError:
            # The reader went away (e.g. `| head`): not an error of ours.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    try:
        with atomic_write(path) as f:
            yield f
    except OSError as e:
        if isinstance(e, FlamedError):
            raise
        raise FlamedError(f"cannot write {path}: {e.strerror or e}") from None
