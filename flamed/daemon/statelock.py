"""One daemon per state directory: an flock on ``DIR/.flamed.lock``, held for the daemon's life.

Two daemons writing one directory would interleave their files, and each
one's recovery and retention would delete the other's.  ``flock`` belongs to
the open file, so the kernel drops it when the holder dies in any way
(SIGKILL, OOM kill): a stale lock file never blocks a restart, and nothing
has to be cleaned up.  The file holds the holder's pid, so the refusal can
name it.  The descriptor is close-on-exec, so py-spy children never keep it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from flamed.daemon.paths import path_error
from flamed.errors import FlamedError

LOCK_NAME = ".flamed.lock"


class StateDirBusy(FlamedError):
    """Another daemon holds the state directory; exit 2 like a config refusal (a restart would not help)."""

    exit_code = 2


class StateDirLock:
    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`StateDirBusy` naming the holder's pid."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise path_error(f"output.state_dir: cannot create the lock file {self.path}: {e.strerror or e}; "
                             "set output.state_dir or --state-dir to a writable directory", e.errno) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "pid unknown"
            raise StateDirBusy(f"state directory {self.directory} is in use by another flamed daemon ({who}, "
                               f"which holds {self.path}); stop that daemon, or give this one its own "
                               "output.state_dir (--state-dir)") from None
        except OSError as e:
            os.close(fd)
            raise FlamedError(f"cannot lock {self.path}: {e.strerror or e}") from None
        # Written after the lock is ours: a reader that sees a pid sees the holder's.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def still_held(self) -> bool:
        """Is the lock file at :attr:`path` still the one this lock holds?  False once
        the directory or the file was removed (and maybe made again by someone else)."""
        if self._fd is None:
            return False
        try:
            st = os.lstat(self.path)
            own = os.fstat(self._fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def renew(self) -> None:
        """Lock the file now at :attr:`path` (the directory was made again); raise
        :class:`StateDirBusy` (keeping the old descriptor) if another daemon holds it."""
        old, self._fd = self._fd, None
        try:
            self.acquire()
        except BaseException:
            self._fd = old
            raise
        if old is not None:
            with contextlib.suppress(OSError):
                os.close(old)

    def release(self) -> None:
        """Give the lock up; the file stays (removing it would race a daemon that just opened it)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) < 12 else None
