"""Opening inputs (files, stdin, gzip by magic) and writing outputs (atomically when they are files)."""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import os
import re
import stat
import sys
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO, TextIO, cast

from flamed import progress
from flamed.errors import InputError, FlamedError

GZIP_MAGIC = b"\x1f\x8b"
#: What some editors and Windows tools put before UTF-8 text. It is no part of
#: the first line: left there it made the first stack's root frame another
#: function (``\ufeffmain`` beside ``main``), or the first perf sample's command.
UTF8_BOM = b"\xef\xbb\xbf"


def skip_bom(f: BinaryIO) -> int:
    """Read past a UTF-8 byte order mark at ``f``'s position (an input's start); its length, 0 or 3."""
    peek = getattr(f, "peek", None)
    head = peek(3)[:3] if peek is not None else b""
    if head == UTF8_BOM:
        f.read(3)
        return 3
    return 0


def bom_length(path: str | os.PathLike[str]) -> int:
    """3 when the file ``path`` starts with a UTF-8 byte order mark, else 0."""
    with open(path, "rb") as f:
        return 3 if f.read(3) == UTF8_BOM else 0


def open_input(path: str | os.PathLike[str] | None) -> BinaryIO:
    """Open ``path`` for binary reading; ``None`` or ``-`` is stdin.

    Gzip input is recognised by its magic bytes, not by the file name. A UTF-8
    byte order mark at the start (of the decompressed text) is skipped.
    """
    if path is None or str(path) == "-":
        raw: BinaryIO = stdin_binary()
        name = "<stdin>"
        if raw.closed:
            # A reader before this one read it to its end and closed it.
            raise InputError("standard input was already read: '-' can be given once", source=name)
    else:
        name = str(path)
        try:
            once = _once_input(name)
            if once is not None:
                raw = cast(BinaryIO, once)
            else:
                # Unbuffered under a progress line: the counting layer's buffer is the only one.
                raw = open(path, "rb", buffering=0 if progress.active() is not None else -1)  # noqa: SIM115 - returned to the caller
        except FileNotFoundError:
            raise InputError("no such file", source=name) from None
        except IsADirectoryError:
            raise InputError("is a directory, expected a file", source=name) from None
        except PermissionError:
            raise InputError("permission denied", source=name) from None
        except OSError as e:  # a socket (ENXIO), a file name too long, an I/O error, ...
            raise InputError(f"cannot open: {e.strerror or e}", source=name) from None
    prog = progress.active()
    if prog is not None:
        # A progress line is drawn: count what is read of this input (its bytes
        # as stored, compressed or not, against the file's size).
        raw = cast(BinaryIO, io.BufferedReader(_CountingRaw(raw, name, prog)))
    # Both are BufferedReaders unless sys.stdin was replaced (tests, embedding).
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(cast(io.RawIOBase, raw))
    head = buffered.peek(2)[:2]
    if head == GZIP_MAGIC:
        gz = _CheckedGzipFile(fileobj=buffered, mode="rb")
        gz.source = name
        if name != "<stdin>":
            gz.owned = buffered
        # GzipFile has every method of BinaryIO; typeshed just does not declare it one.
        skip_bom(cast(BinaryIO, gz))
        return cast(BinaryIO, gz)
    skip_bom(buffered)
    return buffered


class _Once:
    """A named input that can be read only once: a pipe (``<(cmd)``, ``/dev/stdin``
    on a pipe), a FIFO, a character device.  Opening its path again does not
    start it over, it goes on where the last reader stopped; so what readers
    have taken from it (up to ``KEEP`` bytes: the heads that tell its format)
    is kept here, and every open of the path reads that again first.  A reader
    that needs bytes another reader took past ``KEEP`` gets an InputError,
    never a stream with a hole in it."""

    KEEP = 1 << 20

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.kept = bytearray()
        #: bytes read from the descriptor; more than ``kept`` once keeping stopped
        self.taken = 0


#: The inputs that read once, by (device, inode) of what the path opens.
_ONCE: dict[tuple[int, int], _Once] = {}


def _once_input(path: str) -> _OnceReader | None:
    """A reader of ``path`` from its start when it names a pipe, FIFO or device
    (the same source for every open); ``None`` for a regular file."""
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    key = (st.st_dev, st.st_ino)
    once = _ONCE.get(key)
    if once is None:
        once = _ONCE[key] = _Once(os.open(path, os.O_RDONLY | os.O_CLOEXEC), path)
    return _OnceReader(once)


class _OnceReader(io.RawIOBase):
    """One open of a :class:`_Once` input: its kept bytes, then the descriptor."""

    def __init__(self, once: _Once) -> None:
        self._once = once
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        o = self._once
        if self._pos < len(o.kept):
            n = min(len(b), len(o.kept) - self._pos)
            b[:n] = o.kept[self._pos : self._pos + n]
            self._pos += n
            return n
        if self._pos != o.taken:
            raise InputError("is a pipe (or FIFO, or device) that was already read past this point: it can be "
                             "read only once; save it to a file and give that", source=o.name)
        d = os.read(o.fd, len(b))
        if d and len(o.kept) == o.taken and o.taken + len(d) <= _Once.KEEP:
            o.kept += d
        o.taken += len(d)
        self._pos += len(d)
        b[: len(d)] = d
        return len(d)


class _CountingRaw(io.RawIOBase):
    """Reads ``inner`` and tells the progress line how far it got."""

    def __init__(self, inner: BinaryIO, name: str, prog: progress.Progress) -> None:
        self._inner = inner
        self._name = name
        self._prog = prog
        self._pos = 0
        # Where a file opened to read a range starts: what lies before counts too.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._pos = inner.tell()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        inner: Any = self._inner
        # One read of what is there (a pipe gives what it has), as a raw read would.
        fn = getattr(inner, "readinto1", None) or inner.readinto
        n = fn(b)
        if n:
            self._pos += n
            self._prog.reached(self._name, self._pos)
        return int(n or 0)

    def fileno(self) -> int:
        return self._inner.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                self._inner.close()
            finally:
                super().close()


class _CheckedGzipFile(gzip.GzipFile):
    """A GzipFile whose corrupt or truncated data raises InputError naming the file.

    gzip reports those lazily, while the caller reads, as BadGzipFile, EOFError
    or zlib.error; without this they would escape the CLI as tracebacks.
    """

    source = "<input>"
    #: The file under it, which open_input opened: GzipFile closes only a file
    #: it opened itself, so without this one descriptor per .gz input stayed
    #: open until the collector found it (a ResourceWarning).
    owned: BinaryIO | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.owned is not None:
                self.owned.close()
                self.owned = None

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


def stdin_binary() -> BinaryIO:
    """Standard input as bytes, or an error saying what to do when it is closed."""
    if _REPLAY is not None and _REPLAY[0] is sys.stdin:
        return _REPLAY[1]
    # Python leaves sys.stdin None when fd 0 was closed at startup (`<&-`).
    if sys.stdin is None:
        raise InputError("standard input is closed; name the input file instead", source="<stdin>")
    return sys.stdin.buffer


class _Replay(io.RawIOBase):
    """Bytes already read from a stream, then the rest of the stream."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        d = self._rest.read(len(b))
        b[: len(d)] = d
        return len(d)


#: (the sys.stdin it was made for, the stream that replays what peek_stdin read).
_REPLAY: tuple[Any, BinaryIO] | None = None


def peek_stdin(n: int = 64 << 10) -> bytes:
    """The first ``n`` bytes of standard input (fewer at its end), still to be read by the next reader.

    BufferedReader.peek gives what one read of a pipe returned, which may be
    a part of a line: deciding the format of a pipe needs whole lines.
    """
    global _REPLAY
    src = stdin_binary()
    parts: list[bytes] = []
    have = 0
    while have < n:
        d = src.read1(n - have) if hasattr(src, "read1") else src.read(n - have)
        if not d:
            break
        parts.append(d)
        have += len(d)
    head = b"".join(parts)
    _REPLAY = (sys.stdin, io.BufferedReader(_Replay(head, src)))
    return head


def stdout_binary() -> BinaryIO:
    """Standard output as bytes, or an error saying what to do when it is closed."""
    # Python leaves sys.stdout None when fd 1 was closed at startup (`>&-`).
    if sys.stdout is None:
        raise FlamedError("standard output is closed; give -o FILE to write the output to a file")
    return sys.stdout.buffer


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


#: A descriptor's directory of /proc: /proc/PID/fd or /proc/PID/task/TID/fd.
_PROC_FD_DIR = re.compile(r"^/proc/(?P<pid>[0-9]+)(?:/task/[0-9]+)?/fd$")


def open_descriptor(path: str) -> int | None:
    """The descriptor of this process that ``path`` names, or ``None``.

    ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``,
    ``/proc/thread-self/fd/N`` and ``/proc/PID/fd/N`` of this process name a
    descriptor already open, whatever it is open on: the links are followed up
    to the entry of a ``fd`` directory of /proc, never through it.
    """
    p = os.path.abspath(path)
    for _ in range(40):  # as many links as the kernel follows (ELOOP)
        parent, base = os.path.split(p)
        m = _PROC_FD_DIR.match(os.path.realpath(parent))
        if m is not None and base.isdigit() and int(m.group("pid")) == os.getpid():
            return int(base)
        try:
            link = os.readlink(p)
        except OSError:  # not a link, or nothing there
            return None
        p = os.path.normpath(os.path.join(os.path.realpath(parent), link))
    return None


def _replace_target(path: str) -> str | None:
    """The file an atomic write of ``path`` renames into place, or ``None`` when
    ``path`` must be written in place.

    Only a regular file, or nothing yet, may be replaced by a rename. Through a
    symlink the file it ends at is replaced, so the link stays a link. A FIFO, a
    character or block device (``/dev/null``), a socket, or a magic link of
    ``/proc`` to a pipe is written in place, as a shell redirection would:
    renaming over it would destroy it (and, as root, ``/dev/null`` with it).
    """
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None  # nothing there, or a dangling symlink: create its target
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, expected a file", path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        return None
    if not os.path.islink(path):
        return path
    real = os.path.realpath(path)
    if st is not None:
        try:
            rst = os.stat(real)
        except OSError:
            return None
        if (rst.st_dev, rst.st_ino) != (st.st_dev, st.st_ino):
            # A /proc/PID/fd link names a file it cannot be renamed over.
            return None
    return real


@contextlib.contextmanager
def _write_in_place(path: str) -> Iterator[BinaryIO]:
    """Write straight into an existing FIFO, device or socket."""
    if stat.S_ISSOCK(os.stat(path).st_mode):
        import socket  # rare (writing into a Unix socket): not a start-up cost of every command

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            with sock.makefile("wb") as f:
                yield f
            # End of data for the reader, as closing a FIFO's write end would be.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        finally:
            sock.close()
        return
    # No O_CREAT: if the node vanished meanwhile, do not create a regular file
    # where a device was. No O_TRUNC: it means nothing for these files.
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "wb") as f:
        yield f


@contextlib.contextmanager
def _write_descriptor(fd: int) -> Iterator[BinaryIO]:
    """Write into this process's open descriptor ``fd``, as a shell's ``>&N`` would.

    A copy of the descriptor shares its open file: the data goes where the
    file's offset is and moves it on (at the end when it was opened to append),
    so what the shell or the caller wrote before and after stays.
    """
    for std in (sys.stdout, sys.stderr):
        if std is not None and _fileno(std) == fd:
            std.flush()  # what flamed printed there goes first
    try:
        dup = os.dup(fd)
    except OSError as e:
        raise FlamedError(f"cannot write descriptor {fd}: {e.strerror or e} (it is not open)") from None
    os.set_inheritable(dup, False)
    with os.fdopen(dup, "wb") as f:
        yield f


class StdoutError(FlamedError):
    """Standard output refused what a command wrote (a full disk, EIO, EFBIG): exit 1, one line."""


class StdoutWriter(io.BufferedWriter):
    """Standard output, buffered: every byte written or an error that says so.

    A failed write (a full disk, EIO, EFBIG) is a :class:`StdoutError` naming
    standard output instead of a traceback; a reader gone away stays a
    ``BrokenPipeError`` (quiet, see :func:`open_output`)."""

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to standard output: {e.strerror or e}") from None

    def flush(self) -> None:
        try:
            super().flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to standard output: {e.strerror or e}") from None


def write_text(stream: TextIO, text: str) -> None:
    """Write ``text`` to a command's text stream: through :func:`open_output`'s
    checked writer when it is this process's standard output (a full disk is an
    error naming standard output, also under PYTHONUNBUFFERED, where the text
    layer dropped what a short write left out and exited 0), as it is otherwise
    (a caller's stream)."""
    if stream is not sys.stdout or _fileno(stream) is None or not hasattr(stream, "buffer"):
        stream.write(text)
        return
    data = text.encode(stream.encoding or "utf-8", stream.errors or "strict")
    with open_output(None) as out:
        out.write(data)


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return None


def _temp_beside(target: str) -> tuple[int, str]:
    """A new temporary file in ``target``'s directory, where an atomic write of it
    writes before the rename: (descriptor, path)."""
    return tempfile.mkstemp(prefix="." + os.path.basename(target) + ".", suffix=".tmp",
                            dir=os.path.dirname(target) or ".")


def output_problem(path: str) -> str | None:
    """Why :func:`atomic_write` of ``path`` would fail now, or ``None`` when it can
    write it.  Tried by creating and removing a temporary file where the write
    puts its own, so nothing is left behind; '-', descriptors (/dev/stdout) and
    existing FIFOs or devices are checked for write access."""
    if path == "-" or open_descriptor(path) is not None:
        return None
    try:
        target = _replace_target(path)
    except OSError as e:
        return str(e.strerror or e)
    if target is None:  # a FIFO, device or socket, written in place
        return None if os.access(path, os.W_OK) else "not writable"
    directory = os.path.dirname(target) or "."
    if not os.path.isdir(directory):
        return f"no directory {directory}"
    try:
        fd, tmp = _temp_beside(target)
    except OSError as e:
        return f"cannot create a file in {directory}: {e.strerror or e}"
    os.close(fd)
    os.unlink(tmp)
    return None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, mode: int = 0o644, fsync: bool = True) -> Iterator[BinaryIO]:
    """Write ``path`` so that it appears complete or not at all.

    Data goes to a temporary file in the same directory, which is fsynced and
    renamed over ``path``; on any error the temporary file is removed and the
    old ``path`` (if any) is untouched. A symlink is kept and the file it ends
    at is replaced that way; a FIFO, device or socket is written in place (see
    :func:`_replace_target`), and so is a descriptor this process has open
    (``/dev/stdout``, ``/dev/fd/N``, see :func:`open_descriptor`), where its
    offset is.
    """
    name = os.fspath(path)
    fd = open_descriptor(name)
    if fd is not None:
        with _write_descriptor(fd) as out:
            yield out
        return
    target = _replace_target(name)
    if target is None:
        with _write_in_place(name) as out:
            yield out
        return
    directory = os.path.dirname(target) or "."
    fd, tmp = _temp_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
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
        out = stdout_binary()
        fd = _fileno(out)
        try:
            if fd is None:  # not a descriptor (a caller's in-memory stream)
                yield out
                out.flush()
            else:
                # A buffered writer of our own on a copy of the descriptor:
                # under PYTHONUNBUFFERED (python -u) sys.stdout.buffer is the raw
                # file, whose write() may write part of the data (a disk that
                # fills up) and say so only in the count it returns, so the
                # output was cut short with exit 0.
                for std in (sys.stdout, sys.stderr):
                    if std is not None and _fileno(std) == fd:
                        std.flush()  # what flamed printed there goes first
                with StdoutWriter(io.FileIO(fd, "wb", closefd=False)) as f:
                    yield f
        except BrokenPipeError:
            # The reader went away (e.g. `| head`): not an error of ours, but
            # the command stops here (the entry point exits 0): swallowed, the
            # rest of its `with` body was skipped and what follows ran on
            # half-made state (flamed svg: UnboundLocalError).
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise
        return
    try:
        with atomic_write(path) as f:
            yield f
    except OSError as e:
        if isinstance(e, FlamedError):
            raise
        raise FlamedError(f"cannot write {path}: {e.strerror or e}") from None
