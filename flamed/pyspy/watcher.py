"""Which processes are Python, as they come and go.

Events come from the kernel's proc connector (pyroute2's ``ProcEventSocket``,
needs CAP_NET_ADMIN): fork, exec and exit, each with a CLOCK_MONOTONIC
timestamp.  A process is Python when its executable is an interpreter
(``python3.12``, ``python3``, ``python``), when it maps a ``libpython3.X``
(uwsgi, gunicorn under an embedding binary, mod_wsgi...), or when its
executable, whatever its name, defines CPython's own symbols (a statically
linked interpreter copied or renamed, an application that links libpython
statically).  On exec the dynamic
loader has not mapped any library yet, so a process whose executable does not
say "Python" is looked at again a little later.  A Python process that forks
without exec (prefork servers, multiprocessing) has a Python child.

A periodic scan of ``/proc`` finds what the socket missed (it overflows under
fork storms, or is not available at all without CAP_NET_ADMIN) and drops
processes whose exit was missed.

Include/exclude by comm regex, uid and cgroup path; at most ``max_watched``
processes at once, the others counted in ``left_out`` and picked up by a later
scan when a slot frees.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import select
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flamed.errors import ConfigError
from flamed.procstat import have_cap_sys_ptrace, kernel_at_least, stat_fields, status_tgid
from flamed.sampling.cpython import elf

log = logging.getLogger(__name__)

#: Interpreter executables (``t``: free-threaded, ``d``: debug, ``m``: pymalloc ABI of 3.7 and older).
PYTHON_EXE = re.compile(r"^python(?P<ver>[23](?:\.\d+)?)?[tdm]{0,2}(?:-dbg)?$")
#: A mapped libpython, with its version (``libpython3.7m.so``, ``libpython2.7.so``...).
LIBPYTHON = re.compile(rb"/libpython(?P<ver>[23]\.\d+)[tdm]{0,2}\.so")
#: The CPython versions py-spy reads: 2.3-2.7 and 3.3-3.14.  The BPF walker
#: reads only 3.8-3.13 (flamed/sampling/cpython/layout.py); the others get
#: their Python frames from py-spy, so they must not be turned away here.
#: Measured with the bundled py-spy 0.4.3 on pyenv 2.7.18, 3.6.15 and 3.7.16
#: (tests/integration/test_pyspy_old_versions.py).
SUPPORTED = re.compile(r"^(?:2\.[3-7]|3\.(?:[3-9]|1[0-4]))$")


def unsupported_reason(version: str) -> str:
    """Why a Python process of ``version`` gets no Python frames (the watcher turns it away)."""
    return (f"Python {version} is not supported: neither the BPF walker (CPython 3.8-3.13) nor py-spy "
            "(CPython 2.3-2.7, 3.3-3.14) reads its frames; native and kernel stacks only")


@dataclass(frozen=True)
class WatchOptions:
    """What the watcher watches.

    include_comm / exclude_comm: regex searched in the comm (default: all / none).
    uids: only these real uids (default: any).
    include_cgroup / exclude_cgroup: regex searched in the cgroup v2 path (default: all / none).
    pids: only these processes (default: all; ``flamed record``).
    descendants: with ``pids``, their descendants too (default True).
    max_watched: processes watched at once (default 32).
    scan_interval_s: full /proc scan period (default 5).
    recheck_s: after an exec that does not look like Python, look again at
        these ages for a mapped libpython (default 0.05, 0.3, 1.0).
    use_connector: listen to the proc connector; False: scans only (default True).
    exclude_self: never watch this process (default True).
    """

    include_comm: str | None = None
    exclude_comm: str | None = None
    uids: frozenset[int] | None = None
    include_cgroup: str | None = None
    exclude_cgroup: str | None = None
    pids: frozenset[int] | None = None
    descendants: bool = True
    max_watched: int = 32
    scan_interval_s: float = 5.0
    recheck_s: tuple[float, ...] = (0.05, 0.3, 1.0)
    use_connector: bool = True
    exclude_self: bool = True

    def __post_init__(self) -> None:
        if self.max_watched < 1:
            raise ConfigError("python.max_watched must be at least 1")
        for key in ("include_comm", "exclude_comm", "include_cgroup", "exclude_cgroup"):
            v = getattr(self, key)
            if v is not None:
                try:
                    re.compile(v)
                except re.error as e:
                    raise ConfigError(f"python.{key}: bad regex {v!r}: {e}") from None


@dataclass(frozen=True)
class PyProcess:
    pid: int
    comm: str
    exe: str
    version: str | None  # "3.11" when known
    how: str  # "exe", "libpython" or "fork"
    seen_ns: int  # CLOCK_MONOTONIC of the event (or scan) that found it
    #: /proc/PID/auxv when found: it differs after each exec (ASLR), None when unreadable
    image: bytes | None = None


@dataclass
class WatcherStats:
    events: Counter[str] = field(default_factory=Counter)
    found: Counter[str] = field(default_factory=Counter)  # by how
    left_out: int = 0  # Python processes not watched because of max_watched
    filtered: int = 0  # Python processes excluded by comm/uid/cgroup
    unsupported: int = 0  # Python, but a version py-spy cannot read
    #: the same processes by version ("3.2", "2.2"...), for the metric's label and
    #: ``flamed record``'s "Python X is not supported"
    unsupported_versions: Counter[str] = field(default_factory=Counter)
    overruns: int = 0  # proc connector socket overflowed (ENOBUFS)
    scans: int = 0
    connector: bool = False
    #: the connector was asked for fork, exec and exit events only (Linux 6.6+)
    connector_filtered: bool = False
    #: datagrams read from the connector (one event each): what the events cost
    datagrams: int = 0


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


# The proc connector's datagram: nlmsghdr (16 bytes), cn_msg (20), then
# proc_event {what u32, cpu u32, timestamp_ns u64, union}.  Decoded here with
# struct: pyroute2's generic marshal costs tens of microseconds per event,
# which a fork storm on a busy host turns into seconds of a stalled loop.
_NLMSG = struct.Struct("=IHHII")
_EVENT_HEAD = struct.Struct("=IIQ")
_CN_MSG_SIZE = 20
_WHAT = {0x1: "PROC_EVENT_FORK", 0x2: "PROC_EVENT_EXEC", 0x80000000: "PROC_EVENT_EXIT"}
_BODY = {
    "PROC_EVENT_FORK": (struct.Struct("=IIII"), ("parent_pid", "parent_tgid", "child_pid", "child_tgid")),
    "PROC_EVENT_EXEC": (struct.Struct("=II"), ("process_pid", "process_tgid")),
    "PROC_EVENT_EXIT": (struct.Struct("=IIII"), ("process_pid", "process_tgid", "exit_code", "exit_signal")),
}


#: The events the watcher acts on (those parse_proc_events decodes): what the
#: kernel is asked for, where it can filter.
_WANTED_EVENTS = sum(_WHAT)
_PROC_CN_MCAST_LISTEN = 1
_CN_IDX_PROC = _CN_VAL_PROC = 1
_NLMSG_DONE = 3


def connector_filters() -> bool:
    """Does this kernel take a listen message with an event mask (``struct
    proc_input``, Linux 6.6)?  An older one ignores such a message whole: it
    would send no events at all, so it gets the plain one."""
    return kernel_at_least(6, 6)


def listen_message(events: int) -> bytes:
    """The netlink datagram that subscribes a bound proc connector socket to ``events``
    (a mask of PROC_EVENT_* values): nlmsghdr, cn_msg, proc_input {mcast_op, event_type}."""
    payload = struct.pack("=II", _PROC_CN_MCAST_LISTEN, events)
    cn = struct.pack("=IIIIHH", _CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    return _NLMSG.pack(_NLMSG.size + len(cn), _NLMSG_DONE, 0, 0, 0) + cn


def parse_proc_events(data: bytes) -> Iterator[dict[str, Any]]:
    """The fork/exec/exit events in one proc connector datagram (others are skipped)."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length = _NLMSG.unpack_from(data, off)[0]
        if length < _NLMSG.size or off + length > len(data):
            return
        body = off + _NLMSG.size + _CN_MSG_SIZE
        if body + _EVENT_HEAD.size <= off + length:
            what, _cpu, ts = _EVENT_HEAD.unpack_from(data, body)
            name = _WHAT.get(what)
            if name is not None:
                st, fields = _BODY[name]
                if body + _EVENT_HEAD.size + st.size <= off + length:
                    ev: dict[str, Any] = dict(zip(fields, st.unpack_from(data, body + _EVENT_HEAD.size)))
                    ev["event"] = name
                    ev["timestamp_ns"] = ts
                    yield ev
        off += (length + 3) & ~3


class ProcReader:
    """What the watcher needs from one /proc tree (real or fake)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root
        #: /proc/PID/exe reads refused (ptrace access mode): those processes cannot be recognised.
        self.denied = 0

    def pids(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def comm(self, pid: int) -> str | None:
        b = _read(f"{self.root}/{pid}/comm")
        return b.decode("utf-8", "replace").rstrip("\n") if b is not None else None

    def exe(self, pid: int) -> str:
        try:
            return os.readlink(f"{self.root}/{pid}/exe")
        except PermissionError:
            # Found by tests/faults/test_security_caps.py: without CAP_SYS_PTRACE every Python
            # process was skipped silently.  Count it, and say once what is missing.
            if self.denied == 0:
                if have_cap_sys_ptrace():
                    # Refused although we may trace: a process in another user
                    # namespace or protected by an LSM; only that one is missed.
                    log.info("cannot read /proc/%d/exe: permission denied despite CAP_SYS_PTRACE; "
                             "such processes are not recognised as Python (counted as unreadable)", pid)
                else:
                    log.warning("cannot read /proc/%d/exe: permission denied; Python processes cannot be "
                                "recognised (mixed mode needs CAP_SYS_PTRACE, or root)", pid)
            self.denied += 1
            return ""
        except OSError:
            return ""

    def image(self, pid: int) -> bytes | None:
        """/proc/PID/auxv: the stack and vDSO addresses in it change with every exec."""
        return _read(f"{self.root}/{pid}/auxv") or None

    def maps(self, pid: int) -> bytes:
        return _read(f"{self.root}/{pid}/maps") or b""

    def uid(self, pid: int) -> int | None:
        b = _read(f"{self.root}/{pid}/status")
        if b is None:
            return None
        m = re.search(rb"^Uid:\s+(\d+)", b, re.M)
        return int(m.group(1)) if m else None

    def cgroup(self, pid: int) -> str:
        b = _read(f"{self.root}/{pid}/cgroup") or b""
        for line in b.decode("utf-8", "replace").splitlines():
            if line.startswith("0::"):
                return line[3:]
        return ""

    def ppid(self, pid: int) -> int | None:
        b = _read(f"{self.root}/{pid}/stat")
        if b is None:
            return None
        try:
            return int(stat_fields(b)[1])  # field 4
        except (IndexError, ValueError):
            return None

    def is_thread_group_leader(self, pid: int) -> bool:
        b = _read(f"{self.root}/{pid}/status")
        if b is None:
            return False
        return status_tgid(b) == pid


def python_identity(reader: ProcReader, pid: int) -> tuple[str, str | None] | None:
    """``(how, version)`` if ``pid`` runs Python, else None."""
    exe = reader.exe(pid)
    base = os.path.basename(exe.removesuffix(" (deleted)"))
    m = PYTHON_EXE.match(base)
    if m is not None:
        ver = m.group("ver")
        if ver is None or "." not in ver:
            # ``python3`` symlinks are resolved by /proc/PID/exe; a binary named
            # plainly still may map libpython with its version.
            lm = LIBPYTHON.search(reader.maps(pid))
            ver = lm.group("ver").decode() if lm else None
        return "exe", ver
    maps = reader.maps(pid)
    lm = LIBPYTHON.search(maps)
    if lm is not None:
        return "libpython", lm.group("ver").decode()
    return _static_interpreter(reader, pid, exe, maps)


#: Symbols only a CPython interpreter defines: ``_PyRuntime`` (3.7 and later;
#: what the BPF walker starts from) or ``Py_InitializeEx`` (every version).
_CPYTHON_SYMBOLS = (b"_PyRuntime", b"Py_InitializeEx")
#: Executables already looked at, by the device and inode their mapping
#: shows: True when they define CPython, with the version their
#: ``Py_Version`` gives (None before 3.11).  Every scan looks at every process
#: that is not Python; this answers it from the maps already read, without
#: touching the file (a binary on a network mount that hangs would hang the
#: watcher); bounded, oldest first out.
_EXE_VERDICTS: dict[bytes, tuple[bool, str | None]] = {}
_EXE_VERDICTS_MAX = 4096


def _static_interpreter(reader: ProcReader, pid: int, exe: str, maps: bytes) -> tuple[str, str | None] | None:
    """``("exe", version)`` when the executable of ``pid`` defines CPython itself.

    A statically linked interpreter under another name (Debian's python3.11
    copied as ``myservice``, an application built with a static libpython)
    maps no libpython and is named otherwise; the BPF walker reads it all the
    same (it looks for ``_PyRuntime``), so the watcher must know it is Python.
    The file is read once per device and inode, through ``/proc/PID/exe``,
    which opens it even in another mount namespace or when it was replaced
    on disk.
    """
    if not exe:
        return None
    # "start-end perms offset dev inode path": the executable's first mapping.
    tail = b" " + os.fsencode(exe) + b"\n"
    at = maps.find(tail)
    if at < 0:
        return None  # not mapped yet (exec in progress), or gone
    line = maps[maps.rfind(b"\n", 0, at) + 1 : at].split()
    if len(line) < 5:
        return None
    key = line[3] + b" " + line[4]
    verdict = _EXE_VERDICTS.get(key)
    if verdict is None:
        path = f"{reader.root}/{pid}/exe"
        verdict = (False, None)
        try:
            facts = elf.CACHE.get(path)
        except OSError:
            return None  # unreadable now (gone, refused): not a verdict to keep
        except elf.ElfError:
            facts = None
        if facts is not None and any(s in facts.symbols for s in _CPYTHON_SYMBOLS):
            hexversion = facts.hexversion(path)
            verdict = (True, f"{hexversion >> 24 & 0xFF}.{hexversion >> 16 & 0xFF}" if hexversion else None)
        if len(_EXE_VERDICTS) >= _EXE_VERDICTS_MAX:
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):  # another thread's eviction
                del _EXE_VERDICTS[next(iter(_EXE_VERDICTS))]
        _EXE_VERDICTS[key] = verdict
    return ("exe", verdict[1]) if verdict[0] else None


def wait_readable(fds: list[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for any of ``fds`` to be readable; those that are.
    With poll, not select: on a host with hundreds of CPUs (their perf events'
    fds) these may be past select's 1,024.  Raises OSError (EBADF) when one of
    them was closed meanwhile, as select did, rather than returning at once."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    events = poller.poll(math.ceil(timeout_s * 1000))
    if any(ev & select.POLLNVAL for _, ev in events):
        raise OSError(errno.EBADF, "closed")
    return [fd for fd, ev in events if ev & select.POLLIN]


class ProcessWatcher:
    """Finds Python processes and reports starts and exits through callbacks.

    Drive it with :meth:`poll` from one thread; ``on_start(PyProcess)`` and
    ``on_exit(pid)`` are called from there.  ``watched`` is the current set.
    ``on_start`` may return False to refuse a process for now (no room): it is
    counted as left out and offered again by a later scan.
    """

    def __init__(self, options: WatchOptions | None = None, *,
                 on_start: Callable[[PyProcess], bool | None] | None = None,
                 on_exit: Callable[[int], None] | None = None,
                 on_thread: Callable[[int], None] | None = None,
                 proc_root: str = "/proc",
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        """``on_thread(tgid)``: a watched process started a thread (proc connector only)."""
        self.options = options or WatchOptions()
        self.reader = ProcReader(proc_root)
        self.on_start = on_start
        self.on_exit = on_exit
        self.on_thread = on_thread
        self._now = clock
        self.watched: dict[int, PyProcess] = {}
        self.stats = WatcherStats()
        self._sock: Any = None
        self._fd = -1
        self._recheck: dict[int, list[int]] = {}  # pid -> remaining recheck times (ns)
        self._fork_hint: dict[int, tuple[str, str | None]] = {}  # forked from a Python process, not exec'd
        self._next_scan = 0
        self._left_out: set[int] = set()
        # Decided not to watch (filters, or a version nothing reads); forgotten on exit/exec.
        # Nothing else is kept per process turned away: its version is counted in
        # stats.unsupported_versions (which ``flamed record`` names), so a daemon
        # seeing such processes come and go keeps one entry per version, not per pid.
        self._rejected: set[int] = set()
        self._unsupported_logged: set[str] = set()
        o = self.options
        self._inc_comm = re.compile(o.include_comm) if o.include_comm else None
        self._exc_comm = re.compile(o.exclude_comm) if o.exclude_comm else None
        self._inc_cg = re.compile(o.include_cgroup) if o.include_cgroup else None
        self._exc_cg = re.compile(o.exclude_cgroup) if o.exclude_cgroup else None
        self._family: set[int] | None = set(o.pids) if o.pids is not None else None

    # -- lifecycle --------------------------------------------------------
    def start(self) -> None:
        """Open the proc connector (when allowed) and scan /proc once."""
        if self.options.use_connector:
            try:
                from pyroute2.netlink.connector.cn_proc import ProcEventSocket  # noqa: PLC0415

                sock = ProcEventSocket()
                sock.bind()
                if connector_filters():
                    # Only fork, exec and exit: a process renaming its threads
                    # (prctl(PR_SET_NAME) in a loop) sent tens of thousands of comm
                    # events a second, each one read and thrown away here.
                    os.write(sock.fileno(), listen_message(_WANTED_EVENTS))
                    self.stats.connector_filtered = True
                else:
                    sock.control(listen=True)
                # From here on the datagrams are read straight from the fd and
                # parsed by pyroute2's marshal: its own reader queues them
                # behind the fd's back, so select() would miss queued events.
                self._fd = sock.fileno()
                os.set_blocking(self._fd, False)
                self._sock = sock
                self.stats.connector = True
            except Exception as e:  # noqa: BLE001 - any failure means: scan only
                log.warning("proc connector unavailable (%s); finding Python processes by /proc scans "
                            "every %.0fs (run as root or with CAP_NET_ADMIN for events)", e,
                            self.options.scan_interval_s)
                self._sock = None
        self.scan()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def fileno(self) -> int:
        return self._fd if self._sock is not None else -1

    # -- driving ----------------------------------------------------------
    def next_due_s(self) -> float:
        """Seconds until :meth:`poll` has work besides events: a recheck or the periodic scan."""
        due = [times[0] for times in self._recheck.values() if times]
        return max(0.0, (min([self._next_scan, *due]) - self._now()) / 1e9)

    def poll(self, timeout_s: float = 0.1) -> None:
        """Handle pending events (waiting up to ``timeout_s``), due rechecks and scans."""
        if self._sock is not None:
            try:
                wait_readable([self._fd], timeout_s)
            except (OSError, ValueError):
                time.sleep(timeout_s)  # closed meanwhile: no busy loop
            self._read_events()
        elif timeout_s > 0:
            time.sleep(timeout_s)
        now = self._now()
        for pid, times in list(self._recheck.items()):
            if times and now >= times[0]:
                times.pop(0)
                if self._consider(pid, now, how_hint=self._fork_hint.pop(pid, None)):
                    self._recheck.pop(pid, None)
                elif not times:
                    self._recheck.pop(pid, None)
        if now >= self._next_scan:
            self.scan()

    def _read_events(self) -> None:
        for _ in range(2_000):  # bounded: a fork storm cannot keep us here; the rest waits for the next poll
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    # The kernel dropped events: a scan finds what we missed.
                    self.stats.overruns += 1
                    self._next_scan = 0
                    continue
                raise
            self.stats.datagrams += 1
            for m in parse_proc_events(data):
                try:
                    self._event(m)
                except (KeyError, TypeError, ValueError):
                    self.stats.events["malformed"] += 1

    def scan(self) -> None:
        """Compare /proc with what is watched: add missed Python processes, drop gone ones."""
        now = self._now()
        self.stats.scans += 1
        self._next_scan = now + int(self.options.scan_interval_s * 1e9)
        live = set(self.reader.pids())
        for pid in list(self.watched):
            if pid not in live or self.reader.comm(pid) is None:
                self._gone(pid)
        self._rejected &= live
        self._left_out &= live
        if self._family is not None and self.options.descendants:
            # Descendants of the recorded processes, by parent pid.
            parents = {pid: self.reader.ppid(pid) for pid in live}
            changed = True
            while changed:
                changed = False
                for pid, pp in parents.items():
                    if pp in self._family and pid not in self._family:
                        self._family.add(pid)
                        changed = True
        for pid in sorted(live):
            if pid in self.watched or pid in self._rejected:
                continue
            if pid in self._left_out and len(self.watched) >= self.options.max_watched:
                continue
            self._consider(pid, now, how_hint=None)

    def follow(self, pid: int) -> bool:
        """Add ``pid`` to the ``pids`` set (``flamed record`` after spawning) and look at it now."""
        if self._family is None:
            self._family = set()
        self._family.add(pid)
        now = self._now()
        if self._consider(pid, now, how_hint=None):
            return True
        # Not Python (yet): looked at again like after an exec, and by every scan.
        self._recheck[pid] = [now + int(d * 1e9) for d in self.options.recheck_s]
        return False

    # -- internals --------------------------------------------------------
    def _event(self, m: Any) -> None:
        ev = str(m["event"]).removeprefix("PROC_EVENT_")
        self.stats.events[ev] += 1
        ts = int(m["timestamp_ns"])
        if ev == "FORK":
            child, child_pid = int(m["child_tgid"]), int(m["child_pid"])
            parent = int(m["parent_tgid"])
            if child != child_pid or child == parent:
                # A new thread.
                if self.on_thread is not None and child in self.watched:
                    self.on_thread(child)
                return
            if self._family is not None and self.options.descendants and parent in self._family:
                self._family.add(child)
            if parent in self.watched:
                # Same image as its Python parent until it execs -- which most
                # forks (subprocess) do at once: decide after the first recheck,
                # and only if it is still the parent's image.
                self._fork_hint[child] = ("fork", self.watched[parent].version)
                self._recheck[child] = [ts + int(d * 1e9) for d in self.options.recheck_s[:1]]
        elif ev == "EXEC":
            pid = int(m["process_tgid"])
            self._rejected.discard(pid)
            self._fork_hint.pop(pid, None)
            if pid in self.watched:
                if ts <= self.watched[pid].seen_ns:
                    return  # an event older than the scan that found the process
                image = self.reader.image(pid)
                if image is not None and image == self.watched[pid].image:
                    # The exec that made the image already watched: its event is
                    # stamped at the end of exec, after a vfork parent (flamed
                    # record's Popen) may have followed the new image already.
                    return
                self._gone(pid)  # a new program: its caches and py-spy are stale
            if not self._consider(pid, ts, how_hint=None):
                now = self._now()
                self._recheck[pid] = [ts + int(d * 1e9) for d in self.options.recheck_s
                                      if ts + int(d * 1e9) > now] or [now]
        elif ev == "EXIT":
            pid, tid = int(m["process_tgid"]), int(m["process_pid"])
            if pid != tid:
                return
            self._recheck.pop(pid, None)
            self._fork_hint.pop(pid, None)
            self._rejected.discard(pid)
            self._left_out.discard(pid)
            if self._family is not None and pid not in (self.options.pids or ()):
                self._family.discard(pid)
            if pid in self.watched:
                self._gone(pid)

    def _consider(self, pid: int, ts: int, how_hint: tuple[str, str | None] | None) -> bool:
        """Watch ``pid`` if it is Python and passes the filters. True when decided (either way)."""
        if pid in self.watched:
            return True
        if self.options.exclude_self and pid == os.getpid():
            return True
        if self._family is not None and pid not in self._family:
            return True
        ident = how_hint or python_identity(self.reader, pid)
        if ident is None:
            return False
        how, ver = ident
        if ver is not None and not SUPPORTED.match(ver):
            self.stats.unsupported += 1
            self.stats.unsupported_versions[ver] += 1
            if ver not in self._unsupported_logged:
                self._unsupported_logged.add(ver)
                log.warning("pid %d: %s (counted in flamed_python_unsupported_total)", pid,
                            unsupported_reason(ver))
            self._rejected.add(pid)
            return True
        comm = self.reader.comm(pid)
        if comm is None:
            return True  # already gone
        if not self._passes(pid, comm):
            self.stats.filtered += 1
            self._rejected.add(pid)
            return True
        if len(self.watched) >= self.options.max_watched:
            if pid not in self._left_out:
                self.stats.left_out += 1
                self._left_out.add(pid)
            return True
        self._left_out.discard(pid)
        proc = PyProcess(pid=pid, comm=comm, exe=self.reader.exe(pid), version=ver, how=how, seen_ns=ts,
                         image=self.reader.image(pid))
        if self.on_start is not None and self.on_start(proc) is False:
            # The consumer has no room now (its own bound): a later scan retries.
            if pid not in self._left_out:
                self.stats.left_out += 1
                self._left_out.add(pid)
            return True
        self.watched[pid] = proc
        self.stats.found[how] += 1
        return True

    def _passes(self, pid: int, comm: str) -> bool:
        if self._inc_comm is not None and not self._inc_comm.search(comm):
            return False
        if self._exc_comm is not None and self._exc_comm.search(comm):
            return False
        if self.options.uids is not None and self.reader.uid(pid) not in self.options.uids:
            return False
        if self._inc_cg is not None or self._exc_cg is not None:
            cg = self.reader.cgroup(pid)
            if self._inc_cg is not None and not self._inc_cg.search(cg):
                return False
            if self._exc_cg is not None and self._exc_cg.search(cg):
                return False
        return True

    def _gone(self, pid: int) -> None:
        if self.watched.pop(pid, None) is not None and self.on_exit is not None:
            self.on_exit(pid)

    def metrics(self) -> dict[str, int]:
        s = self.stats
        m = {"watched": len(self.watched), "left_out": s.left_out, "filtered": s.filtered,
             "unsupported": s.unsupported, "overruns": s.overruns, "scans": s.scans,
             "unreadable": int(getattr(self.reader, "denied", 0)),
             "connector": int(s.connector)}
        for k, v in sorted(s.events.items()):
            m[f"events_{k.lower()}"] = v
        for ver, v in sorted(s.unsupported_versions.items()):
            m[f"unsupported_version:{ver}"] = v
        return m
