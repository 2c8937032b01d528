"""Opening the file behind one mapping of another process.

``/proc/PID/maps`` names a mapped file by a path as *this* process would see
it, which is not always a path this process can open:

- a container (its own mount namespace, its root pivoted): the path is the one
  inside the container, openable as ``/proc/PID/root`` + path;
- a chroot, such as a systemd unit's ``RootDirectory=``: the path starts with
  the process's root directory as seen from here (``/srv/app/usr/lib/...``),
  while files bind-mounted into that root exist only in the unit's namespace:
  openable as ``/proc/PID/root`` + the rest of the path;
- a file deleted or replaced since it was mapped (a package upgrade): the
  process's executable still opens as ``/proc/PID/exe`` (ptrace read access,
  as for the rest of /proc/PID), any other file only as
  ``/proc/PID/map_files/START-END`` (CAP_CHECKPOINT_RESTORE since Linux 5.9,
  or CAP_SYS_ADMIN; the unit grants the first);
- a process that has exited: its ``/proc/PID/root`` is gone, and the path
  here is right only if it is still the same file.

Every candidate is checked against the mapping's inode, so a path that names
another file here is never read in its place.  The device is compared only
for the path taken as it is: through an overlay filesystem (containers) a
mapping shows the device of the layer below, ``stat`` the overlay's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

DELETED = " (deleted)"
log = logging.getLogger("flamed.bpf")


def _inode_is(path: str, inode: int, dev: str | None = None) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_ino != inode:
        return False
    return dev is None or f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}" == dev


def mapped_file(pid: int, path: str, inode: int, start: int, end: int, *,
                dev: str | None = None, proc: Path | str = "/proc") -> str | None:
    """A path that opens the file ``pid`` maps at ``start``-``end`` as ``path``
    (``inode``, and ``dev`` as ``fd:01`` when known), or None when none here does."""
    base = f"{proc}/{pid}"
    if not path.startswith("/"):
        return None
    if not path.endswith(DELETED):
        rooted = f"{base}/root{path}"
        if _inode_is(rooted, inode):
            return rooted
        try:
            root = os.readlink(f"{base}/root")
        except OSError:
            root = "/"
        if root != "/" and path.startswith(root.rstrip("/") + "/"):
            inside = f"{base}/root{path[len(root.rstrip('/')):]}"
            if _inode_is(inside, inode):
                return inside
        if _inode_is(path, inode, dev):
            return path
    # The executable, even deleted, without the capability map_files needs
    # (named as the mapping is: its inode alone could be another device's).
    exe = f"{base}/exe"
    try:
        is_exe = os.readlink(exe) == path
    except OSError:
        is_exe = False
    if is_exe and _inode_is(exe, inode):
        return exe
    mapped = f"{base}/map_files/{start:x}-{end:x}"
    try:
        st = os.stat(mapped)
    except PermissionError:
        _refused(pid, path)
        return None
    except OSError:
        return None
    return mapped if st.st_ino == inode else None


_warned = False
#: Files a missing capability kept closed, since this process started (``record`` says so).
refused: set[str] = set()


def _refused(pid: int, path: str) -> None:
    """Said once per process (then at debug level): which capability would have opened it."""
    global _warned
    level = logging.DEBUG if _warned else logging.WARNING
    _warned = True
    if len(refused) < 1024:
        refused.add(path)
    why = ("it was deleted or replaced since it was mapped (an upgrade?)" if path.endswith(DELETED)
           else "no path to it opens here")
    log.log(level, "cannot open %s of pid %d: %s, and /proc/PID/map_files needs CAP_CHECKPOINT_RESTORE "
            "(or CAP_SYS_ADMIN): its symbols, unwind table and Python frames are lost", path, pid, why)
