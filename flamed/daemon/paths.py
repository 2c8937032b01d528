"""The directories the daemon is configured to use: made when missing, refused clearly when unusable.

``output.state_dir`` and the directory of ``control.socket`` follow one rule:
a missing directory is created (mode 0755, with its missing parents: ``/run``
is empty after a reboot when systemd's ``RuntimeDirectory=`` did not make it),
and each directory created is logged, so a typo in a path shows up in the
log instead of as a new tree nobody expected.  A path that cannot be a
directory (a regular file, a dangling link, a read-only file system, no
permission) is a :class:`PathError`: exit 2, which the unit's
``RestartPreventExitStatus=`` treats as final, since a restart every few
seconds would meet the same path.  An error a retry may cure (EIO, a full
disk, too many open files) keeps exit 1, so systemd restarts the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from flamed.errors import FlamedError

log = logging.getLogger("flamed.daemon")

#: errno values a restart cannot change: the configured path itself is at fault.
PERMANENT = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.EROFS, errno.ELOOP,
                       errno.ENAMETOOLONG, errno.ENOENT, errno.EINVAL})


class PathError(FlamedError):
    """A configured path cannot be used as it is; exit 2 (final for systemd) unless a retry may help."""

    exit_code = 2


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a directory", "a pipe (FIFO)"...)."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a file of type {stat.S_IFMT(mode):#o}"


def _hint(err: int) -> str:
    if err == errno.EROFS:
        return ("; under systemd (ProtectSystem=strict) the daemon writes only below its StateDirectory=, "
                "CacheDirectory= and RuntimeDirectory=, or paths added with ReadWritePaths=")
    if err in (errno.EACCES, errno.EPERM):
        return "; the daemon's user must be allowed to create and write it"
    return ""


def path_error(message: str, err: int | None) -> PathError:
    """A :class:`PathError` for ``err``: exit 2 when the path is at fault, 1 when a retry may help."""
    return PathError(message, exit_code=2 if err is None or err in PERMANENT else 1)


def _missing(path: str, key: str) -> list[str]:
    """The directories of ``path`` (absolute) that do not exist, deepest first;
    raises :class:`PathError` when something other than a directory is in the way."""
    missing: list[str] = []
    p = path
    while True:
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError) as e:
            if isinstance(e, FileNotFoundError) and os.path.islink(p):
                raise path_error(f"{key}: {p} is a symbolic link to {os.readlink(p)!r}, which does not exist; "
                                 f"create its target or set {key} to a directory", None) from None
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
            continue
        except OSError as e:
            raise path_error(f"{key}: cannot use {p}: {e.strerror or e}{_hint(e.errno or 0)}", e.errno) from None
        if not stat.S_ISDIR(st.st_mode):
            what = "" if p == path else f" (in the path of {path})"
            raise path_error(f"{key}: {p}{what} is {file_kind(st.st_mode)}, not a directory; "
                             f"remove it or set {key} to another path", None)
        break
    return missing


#: File systems of the kernel's own objects: no regular file can be made there
#: (mkdir in a cgroup file system even succeeds, and makes a cgroup).
_PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "securityfs", "debugfs", "tracefs",
                        "bpf", "configfs", "pstore", "efivarfs", "mqueue", "fusectl", "binfmt_misc", "nsfs",
                        "selinuxfs", "hugetlbfs", "rpc_pipefs"})


def _unescape(field: str) -> str:
    """A mountinfo path field: blanks, tabs, newlines and backslashes are octal escapes."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def file_system_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system holding ``path`` (an existing path, links
    resolved), from the mount table; None when it cannot be read."""
    real = os.path.realpath(path)
    best: tuple[int, str] | None = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5 or not right.split():
                    continue
                mp = _unescape(fields[4])
                if real == mp or real.startswith(mp.rstrip("/") + "/"):
                    if best is None or len(mp) >= best[0]:  # the later of two at one place covers the earlier
                        best = (len(mp), right.split()[0])
    except OSError:
        return None
    return best[1] if best is not None else None


def _check_pseudo(existing: str, path: str, key: str) -> None:
    fstype = file_system_type(existing)
    if fstype in _PSEUDO_FS:
        raise path_error(f"{key}: {path} is on a {fstype} file system (at {existing}), which holds the kernel's "
                         "own objects, not files; choose a directory on a disk or a tmpfs", None)


def ensure_directory(path: str, key: str) -> list[str]:
    """Make ``path`` (and its missing parents) a directory; the directories created.

    ``key`` names the setting (``output.state_dir``) in the log and in errors.
    Raises :class:`PathError` saying what is in the way."""
    path = os.path.abspath(path)
    missing = _missing(path, key)
    _check_pseudo(os.path.dirname(missing[-1]) if missing else path, path, key)
    created: list[str] = []
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            if os.path.isdir(d):
                continue  # made meanwhile (another process): fine
            raise path_error(f"{key}: {d} appeared meanwhile and is not a directory", None) from None
        except OSError as e:
            raise path_error(f"{key}: cannot create directory {d}: {e.strerror or e}{_hint(e.errno or 0)}",
                             e.errno) from None
        created.append(d)
    if created:
        log.info("%s: created directory %s (it did not exist)", key, ", ".join(created))
    return created


def check_directory(path: str, key: str) -> None:
    """What :func:`ensure_directory` would refuse, found without creating
    anything (``flamed daemon --check-config``): something other than a
    directory in the way, a dangling link, a read-only file system. Not
    permissions: the check may run as another user than the daemon (which the
    unit runs as root), and a directory it cannot write may be fine for the daemon."""
    path = os.path.abspath(path)
    missing = _missing(path, key)
    existing = os.path.dirname(missing[-1]) if missing else path
    _check_pseudo(existing, path, key)
    if _read_only(existing):
        target = f"create directory {missing[-1]}" if missing else f"write to {path}"
        raise path_error(f"{key}: cannot {target}: {os.strerror(errno.EROFS)}{_hint(errno.EROFS)}", errno.EROFS)


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def not_a_socket(path: str) -> PathError:
    """Something other than a socket at ``control.socket``'s path: the daemon will not remove it."""
    return path_error(f"control.socket: {path} exists and is not a socket; remove it or choose another "
                      "control.socket", None)


def check_socket_path(path: str) -> None:
    """``control.socket`` as the daemon will bind it: its directory as
    :func:`check_directory` checks it, and nothing but a socket at the path."""
    check_directory(os.path.dirname(os.path.abspath(path)), "control.socket")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise path_error(f"control.socket: cannot use {path}: {e.strerror or e}{_hint(e.errno or 0)}",
                         e.errno) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise not_a_socket(path)
