"""The fields of ``/proc/PID/stat`` and ``/proc/PID/task/TID/stat``.

The second field (comm, in parentheses) may itself hold spaces and
parentheses, so the fields after it are found after the *last* ``)``.
"""

from __future__ import annotations

import os
import re

#: States of a task that has exited (zombie, dead).
EXITED = (b"Z", b"X")

_TGID = re.compile(rb"^Tgid:\s*(\d+)", re.M)


def kernel_at_least(major: int, minor: int) -> bool:
    """Is the running kernel ``major.minor`` or later (by ``uname -r``)?"""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def stat_fields(raw: bytes) -> list[bytes]:
    """Fields 3 onward of a stat line, so that field N is at index N - 3
    (the state is at 0, the start time at 19); [] for a malformed line."""
    end = raw.rfind(b")")
    return raw[end + 2 :].split() if end >= 0 else []


def read_stat(path: str | os.PathLike[str]) -> list[bytes] | None:
    """The fields (see :func:`stat_fields`) of the stat file at ``path``;
    ``None`` when it cannot be read (the task is gone)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return stat_fields(raw)


def running(path: str | os.PathLike[str]) -> bool:
    """Is the task whose stat file is ``path`` there and not exited?"""
    fields = read_stat(path)
    return fields is not None and bool(fields) and fields[0] not in EXITED


def status_tgid(raw: bytes) -> int | None:
    """The process (thread group) id in a ``/proc/PID/status`` text: the task's
    own id for a process, its process's for a thread; ``None`` if missing."""
    m = _TGID.search(raw)
    return int(m[1]) if m is not None else None


def comm(pid: int) -> str:
    """The name (comm) of process ``pid``; "" when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().rstrip(b"\n").decode(errors="replace")
    except OSError:
        return ""


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is process ``pid`` (the children of each of its
    threads, from ``/proc/PID/task/TID/children``); [] when it is gone."""
    out: list[int] = []
    for tid in _tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


#: Thread states off the CPU: sleeping, uninterruptible, stopped (job control or a
#: tracer), idle.
OFF_CPU_STATES = (b"S", b"D", b"T", b"t", b"I")


def thread_states(pid: int) -> dict[int, bytes]:
    """The state letter (``R``, ``S``, ``D``, ``T``...) of each thread of process
    ``pid``, by thread id; {} when it is gone."""
    out: dict[int, bytes] = {}
    for tid in _tids(pid):
        fields = read_stat(f"/proc/{pid}/task/{tid}/stat")
        if fields:
            out[int(tid)] = fields[0]
    return out


def _tids(pid: int) -> list[str]:
    """The thread ids of process ``pid``, as named in /proc; [] when it is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def descendants_cpu(pid: int, limit: int = 512) -> tuple[float, list[int]]:
    """CPU seconds used by the processes process ``pid`` started, and those of
    them that run now: each live descendant's own time (utime + stime) plus
    the time of the children it has waited for (cutime + cstime), and
    ``pid``'s own waited-for children's.  A child that exited and was reaped
    counts in its parent's cutime; one not yet reaped still has its own stat.
    At most ``limit`` descendants are read; (0.0, []) when ``pid`` is gone."""
    own = read_stat(f"/proc/{pid}/stat")
    if not own or len(own) < 15:
        return 0.0, []
    ticks = int(own[13]) + int(own[14])
    seen = {pid}
    todo = child_pids(pid)
    live: list[int] = []
    while todo and len(seen) <= limit:
        kid = todo.pop()
        if kid in seen:
            continue
        seen.add(kid)
        f = read_stat(f"/proc/{kid}/stat")
        if not f or len(f) < 15:
            continue
        live.append(kid)
        ticks += sum(int(x) for x in f[11:15])
        todo.extend(child_pids(kid))
    return ticks / _CLK_TCK, live


#: PF_KTHREAD of linux/sched.h, in /proc/PID/stat's flags (field 9): a kernel thread.
PF_KTHREAD = 0x00200000


def is_kernel_thread(pid: int) -> bool:
    """Is ``pid`` a kernel thread (False when it is gone or unreadable)?"""
    f = read_stat(f"/proc/{pid}/stat")
    if not f or len(f) < 7:
        return False
    try:
        return bool(int(f[6]) & PF_KTHREAD)  # field 9, flags
    except ValueError:
        return False


#: capability(7) number of CAP_SYS_PTRACE.
CAP_SYS_PTRACE = 19


def effective_caps(proc_root: str = "/proc") -> int | None:
    """This process's effective capability set (``CapEff``); None when it cannot be read."""
    try:
        with open(os.path.join(proc_root, "self", "status"), "rb") as f:
            for line in f:
                if line.startswith(b"CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def have_cap_sys_ptrace(proc_root: str = "/proc") -> bool:
    """Is CAP_SYS_PTRACE in this process's effective set (what py-spy inherits)?
    Root, when the set cannot be read."""
    caps = effective_caps(proc_root)
    return bool(caps >> CAP_SYS_PTRACE & 1) if caps is not None else os.geteuid() == 0


def ptrace_advice(pid: int) -> str:
    """What to do when reading process ``pid``'s memory (or maps) was refused:
    "run as root" helps only someone without CAP_SYS_PTRACE; with it, what may
    still refuse (Yama's scope 3, a user namespace, a security module)."""
    if not have_cap_sys_ptrace():
        return "run as root or grant CAP_SYS_PTRACE"
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", "rb") as f:
            if f.read().strip() == b"3":
                return "refused even with CAP_SYS_PTRACE: kernel.yama.ptrace_scope is 3 (no process may be read)"
    except OSError:
        pass
    return (f"refused even with CAP_SYS_PTRACE: process {pid} is in a user namespace this one does not own, "
            "or a security module forbids reading it")
