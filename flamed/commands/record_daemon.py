"""``flamed record`` through a running daemon (docs/daemon.md, "record through the daemon").

The daemon already samples every process, reads Python frames in BPF, unwinds
and symbolizes, with all of it compiled and warm: ``record`` then only starts
the command (or names the pid), asks the daemon over the control socket for
the target's windows as they are drained (``since_ns`` snapshots), and writes
them out when the target exits or the duration ends.  The target starts at
once (no BPF compile), and ``--since`` reaches back into the daemon's ring, to
before the command was typed.

The daemon decides who may ask (root, ``control.allowed_users`` and
``control.allowed_groups``: docs/protocol.md), and it samples at its own rate.
What was received is kept: if the daemon goes away mid-record, the profile
written holds the windows received until then and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flamed.daemon.client import DaemonError, request
from flamed.errors import FlamedError, UsageError
from flamed.folded import read_folded
from flamed.model import Profile, Stack
from flamed.procstat import child_pids, comm, descendants_cpu, is_kernel_thread, running
from flamed.pyspy.watcher import SUPPORTED as PYSPY_READS, ProcReader, python_identity


#: Seconds between two requests for what the daemon drained meanwhile (no drain is forced).
POLL_S = 1.0
#: CPU seconds of a target's descendants from which record says that its profile leaves them out.
MISSED_CHILDREN_CPU_S = 0.5
#: How long each request may take (a forced drain waits for the daemon's loop).
REQUEST_TIMEOUT_S = 30.0

#: Seconds a command has to exit after record sends it SIGINT, before it is killed.
CHILD_GRACE_S = 10.0

#: The CPython versions the BPF walker reads itself (flamed/sampling/cpython/layout.py);
#: the daemon gives the others py-spy's frames, late (see :func:`late_python_hint`).
WALKER_READS = re.compile(r"^3\.(?:[89]|1[0-3])$")

#: prctl(2) options (linux/prctl.h).
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, arg: int | ctypes.c_int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, arg if isinstance(arg, int) else ctypes.byref(arg), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Survivors:
    """What a command left running when it exited: a process it started in the
    background (``sh -c 'app & exit 0'``) or a daemon (a double fork), whose
    parent exited before it.

    While it lives, record is a *subreaper* (``PR_SET_CHILD_SUBREAPER``): a
    descendant of the command whose parent exits is re-parented to record
    instead of init, so that once the command has exited, the processes it
    left running are record's own children (:meth:`running`), whatever their
    session.  The ones that exited are reaped by :meth:`close`."""

    def __init__(self) -> None:
        before = ctypes.c_int(0)
        self._was = bool(before.value) if _prctl(_PR_GET_CHILD_SUBREAPER, before) else False
        self.enabled = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        #: Children record started itself (its command), never survivors.
        self.own: set[int] = set()

    def running(self) -> list[int]:
        """Record's children still running that it did not start itself: what the
        command left behind (py-spy, which record starts too, is left out by name)."""
        if not self.enabled:
            return []
        out = []
        for pid in child_pids(os.getpid()):
            if pid in self.own or not running(f"/proc/{pid}/stat"):
                continue
            name = comm(pid)
            if name and not name.startswith("py-spy"):
                out.append(pid)
        return sorted(out)

    @staticmethod
    def describe(pids: list[int]) -> str:
        """``python3 (pid N)``, or ``python3 (pid N), sh (pid M)``: the first three named."""
        named = [f"{comm(p) or 'process'} (pid {p})" for p in pids[:3]]
        return ", ".join(named) + (f" and {len(pids) - 3} more" if len(pids) > 3 else "")

    def close(self) -> None:
        """Reap the survivors that exited meanwhile (record's own children were waited
        for), and stop being a subreaper (unless this process was one before)."""
        if not self.enabled:
            return
        for pid in child_pids(os.getpid()):
            if pid not in self.own and not running(f"/proc/{pid}/stat"):
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
        if not self._was:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        self.enabled = False


def survivors_hint(pids: list[int], cmd: str, *, subprocesses: bool, daemon: bool) -> str:
    """The warning naming what a command left running, and how to record it."""
    what = Survivors.describe(pids)
    first = pids[0]
    follow = ("" if subprocesses else
              "; --subprocesses follows what the command leaves running until it exits or -d ends"
              + (" (sampling here, not through the daemon)" if daemon else ""))
    return (f"{cmd} exited, leaving {what} running (started in the background, or a daemon): the recording "
            f"stopped with {cmd}; record it with flamed record -p {first}{follow}")


def pyspy_only(version: str | None) -> bool:
    """Is CPython ``version`` one the daemon reads only through py-spy (not its BPF walker)?"""
    if not version:
        return False
    return not WALKER_READS.match(version) and PYSPY_READS.match(version) is not None


def late_python_hint(comm_: str, pid: int, version: str | None, drain_s: Any, named: int, total: int) -> str:
    """"" unless ``version`` is one the daemon reads only through py-spy: then why
    few (or none) of the ``total`` samples came back with Python frames, and what
    to do."""
    if not pyspy_only(version):
        return ""
    drain = f"drain_interval = {drain_s:g} s" if isinstance(drain_s, (int, float)) else "its drain_interval"
    return (f"{comm_} (pid {pid}) runs CPython {version}, which the daemon's BPF walker does not read "
            f"(it reads 3.8-3.13): the daemon gives it py-spy's Python frames, starting py-spy only once a "
            f"drained window has seen it on a CPU ({drain}) and adding them a py-spy window later; "
            f"{named} of {total} samples came back with Python frames. --no-daemon records it here "
            "with py-spy from its start")


def finish_child(child: subprocess.Popen[bytes], interrupted: bool,
                 warn: Callable[[str], None] | None = None) -> int:
    """Wait for the recorded command; its exit code (128 + N for signal N).  After
    Ctrl-C it gets SIGINT (if the terminal did not send it one) and 10 s, then
    SIGKILL; Ctrl-C (or SIGTERM) again while it is waited for kills it at once, and
    the caller goes on to write the profile.  ``warn`` says why record waits."""
    if child.poll() is None and interrupted:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGINT)
    try:
        try:
            rc = child.wait(timeout=min(1.0, CHILD_GRACE_S) if interrupted else None)
        except subprocess.TimeoutExpired:
            # A command that ignores SIGINT (or takes time to stop): said, not a silent wait.
            if warn is not None:
                warn(f"pid {child.pid} has not exited after SIGINT: waiting up to {CHILD_GRACE_S:.0f} s before "
                     "killing it (Ctrl-C again kills it now)")
            rc = child.wait(timeout=max(0.0, CHILD_GRACE_S - 1.0))
    except subprocess.TimeoutExpired:
        child.kill()
        rc = child.wait()
    except KeyboardInterrupt:
        if not interrupted:
            # Ctrl-C while waiting for a command to exit by itself: it is stopped as after Ctrl-C.
            return finish_child(child, True, warn)
        # Ctrl-C again: the command is not waited for any longer, nor left running.
        child.kill()
        rc = child.wait()
    return 128 - rc if rc < 0 else rc


class DaemonAbsent(Exception):
    """No daemon answers on the socket: record samples by itself."""


@dataclass
class DaemonRecording:
    """What came back from the daemon so far."""

    socket: str
    stacks: dict[Stack, float] = field(default_factory=dict)
    start_ns: int | None = None
    end_ns: int | None = None
    windows: int = 0
    sample_rate: float | None = None
    lost: dict[str, int] = field(default_factory=dict)
    #: Why the recording stopped early ("" when it did not).
    broken: str = ""
    #: The daemon's [sampling] filter that leaves the target out ("" when none does, or it cannot be told).
    filtered_out: str = ""
    #: The daemon's [sampling] cgroups or units filter, which may leave the target out ("" when none is set).
    maybe_filtered: str = ""
    #: The target's process id and name (for the messages).
    target: int = 0
    comm: str = ""
    #: The first process the target started, as ``NAME (pid N)`` ("" when none was seen).
    child: str = ""
    #: The CPython version the target runs (None: not Python, or not seen as such).
    version: str | None = None
    #: What was learnt of the target while it ran (its name, children, their CPU time).
    watch: TargetWatch | None = None
    #: Seconds from the start of the record to the target's exit (None: it did not exit meanwhile).
    exited_s: float | None = None
    #: The command, still running when the duration ended: to be waited for once the profile is written.
    running: subprocess.Popen[bytes] | None = None

    def add(self, head: dict[str, Any], payload: bytes) -> None:
        if not head.get("windows"):
            return
        prof = read_folded(io.BytesIO(payload), source="daemon")
        for stack, w in prof.stacks.items():
            self.stacks[stack] = self.stacks.get(stack, 0) + w
        if self.start_ns is None:
            self.start_ns = head.get("start_ns")
        self.end_ns = head.get("end_ns")
        self.windows += int(head["windows"])
        if head.get("sample_rate"):
            self.sample_rate = float(head["sample_rate"])
        for r, n in (head.get("lost") or {}).items():
            self.lost[r] = self.lost.get(r, 0) + int(n)

    def nothing_reason(self) -> str:
        """Why nothing came back (for "nothing was recorded: ...")."""
        what = f"{self.comm or 'process'} (pid {self.target})"
        if self.filtered_out:
            return (f"the daemon at {self.socket} samples only {self.filtered_out}, which leaves out {what}; "
                    "--no-daemon records it here")
        if self.broken:
            # The daemon's windows of the target had not come back: it did not see it "on no CPU".
            return (f"the daemon at {self.socket} went away after {self.windows} window(s), before any "
                    f"sample of {what} came back; --no-daemon records it here")
        if self.exited_s is not None:
            saw = f"{what} exited {self.exited_s:.1f} s after the record began, before the daemon saw it on a CPU"
        elif pyspy_only(self.version):
            # Its samples wait in the daemon for py-spy's window: not seen "on no CPU".
            saw = (f"no sample of {what} came back in {self.windows} window(s): it runs CPython {self.version}, "
                   "whose Python frames the daemon takes from py-spy, holding its samples until a py-spy window "
                   "ends (and starting py-spy only once a drained window has seen it on a CPU); record longer, "
                   "or --no-daemon records it here with py-spy from its start")
        else:
            saw = f"the daemon saw {what} on no CPU in {self.windows} window(s)"
        if self.maybe_filtered:
            saw += f"; it samples only {self.maybe_filtered}, which may leave it out (--no-daemon records it here)"
        return saw + (self.watch or TargetWatch(self.target, child=self.child)).child_hint(daemon=True)

    def profile(self) -> Profile:
        return Profile(dict(self.stacks), start_ns=self.start_ns, end_ns=self.end_ns, sample_rate=self.sample_rate,
                       labels={"unit": "samples", "source": f"flamed record through the daemon at {self.socket}"})


def probe(socket_path: str) -> dict[str, Any]:
    """The daemon's status; DaemonAbsent when nothing answers there, FlamedError
    when one answers but will not serve this user."""
    try:
        os.stat(socket_path)
    except PermissionError:
        raise FlamedError(f"the daemon's socket {socket_path} is not reachable by this user (permission denied "
                          "on its directory): run as root or as a member of the 'flamed' group") from None
    except OSError:
        raise DaemonAbsent(f"no socket at {socket_path}") from None
    try:
        head = request(socket_path, {"request": "status"}, timeout=5.0)
    except DaemonError as e:
        if e.code == "denied":
            raise FlamedError(
                f"the daemon at {socket_path} does not serve this user ({e}): run as root, or be added to its "
                "control.allowed_users or control.allowed_groups (docs/protocol.md); --no-daemon records "
                "without it (as root)") from None
        raise
    except FlamedError as e:
        msg = str(e)
        if "permission denied" in msg:
            raise FlamedError(
                f"the daemon's socket {socket_path} is not open to this user (permission denied): run as root "
                "or as a member of the 'flamed' group; --no-daemon records without it (as root)") from None
        raise DaemonAbsent(msg) from None
    status = head.get("status")
    if not isinstance(status, dict):
        raise DaemonAbsent("the daemon's status answer has no status")
    return status


@dataclass
class TargetWatch:
    """What record learns of its target while it runs (:meth:`update` at each
    turn of its loop): its name after any exec, so that a wrapper that execs
    (``sh -c 'exec python3 ...'``, ``env``, a pyenv shim) is named, and checked
    against the daemon's filter, as what it became rather than as the wrapper
    (or as this process, in the instant between fork and exec); and the first
    process it started, so that when a wrapper that forks (``timeout``,
    ``unshare --fork``, ``sh -c`` without exec) left the work to a child that
    record does not follow, the message says so."""

    pid: int
    comm: str = ""
    #: The first child process seen, as ``NAME (pid N)`` ("" while none was).
    child: str = ""
    #: That child's process id (0 while none was seen).
    child_pid: int = 0
    #: The CPython version the target runs (after any exec), None when it is not Python.
    version: str | None = None
    #: CPU seconds its descendants had used at the last look (``procstat.descendants_cpu``),
    #: and the most of them seen running at once: the work record does not
    #: sample without --subprocesses.
    children_cpu_s: float = 0.0
    children_max: int = 0
    #: Was one of them seen running Python (what --subprocesses would record)?
    python_children: bool = False
    _seen: str = field(default="", repr=False)
    _next_cpu: float = field(default=0.0, repr=False)
    #: Descendant pid -> the executable it was last seen to run.
    _kid_exes: dict[int, str] = field(default_factory=dict, repr=False)
    #: A kernel thread (kthreadd's "children" are kernel threads, not work it left to them).
    _kthread: bool | None = field(default=None, repr=False)

    def update(self, child: subprocess.Popen[bytes] | None = None) -> None:
        """Look again (each turn of record's loop).  With ``child`` (the target,
        a process record started), a target that has exited but is not reaped yet
        is read once more: as a zombie it still holds the CPU time of the
        children it waited for, which the reaping (``child.poll()``) loses."""
        if child is not None and _exited_unreaped(child.pid):
            self._next_cpu = 0.0
        name = comm(self.pid)
        if name:
            self.comm = name
            try:
                exe = os.readlink(f"/proc/{self.pid}/exe")
            except OSError:
                exe = ""
            if exe and exe != self._seen:
                # Looked up again only when the executable changes (an exec: a
                # wrapper, or this process between fork and exec, becoming python3.7).
                self._seen = exe
                ident = python_identity(ProcReader(), self.pid)
                self.version = ident[1] if ident is not None else None
        if self._kthread is None:
            self._kthread = is_kernel_thread(self.pid)
        if self._kthread:
            return
        now = time.monotonic()
        if now >= self._next_cpu:
            # Twice a second at most: a tree of a hundred workers is a few hundred reads.
            self._next_cpu = now + 0.5
            cpu, live = descendants_cpu(self.pid)
            self.children_cpu_s = max(self.children_cpu_s, cpu)
            self.children_max = max(self.children_max, len(live))
            self._classify(live)
        if self.child_pid:
            # First seen between its fork and its exec, a child has the wrapper's
            # name (sh, bash); it is named as what it became while it is still
            # the target's (its id is not yet another process's).
            kname = comm(self.child_pid) if self.child_pid in child_pids(self.pid) else ""
            if kname:
                self.child = f"{kname} (pid {self.child_pid})"
                self._classify([self.child_pid])
            return
        for kid in child_pids(self.pid):
            kname = comm(kid)
            if kname:
                self.child, self.child_pid = f"{kname} (pid {kid})", kid
                break

    def _classify(self, live: list[int]) -> None:
        """Is any of the ``live`` descendants Python?  Each is looked at again only
        when its executable changed (its exec), so a build's compilers are read once."""
        exes = self._kid_exes
        for kid in live:
            try:
                exe = os.readlink(f"/proc/{kid}/exe")
            except OSError:
                continue
            if exes.get(kid) == exe:
                continue
            exes[kid] = exe
            if not self.python_children and python_identity(ProcReader(), kid) is not None:
                self.python_children = True
        if len(exes) > 4 * len(live) + 64:  # forget the exited ones
            keep = set(live)
            self._kid_exes = {k: v for k, v in exes.items() if k in keep}

    def _subprocesses_hint(self, daemon: bool) -> str:
        """What --subprocesses would do about the descendants: record them, each
        from its fork (with the BPF sampler; py-spy alone follows Python ones only)."""
        here = " (sampling here, not through the daemon)" if daemon else ""
        if not self.python_children:
            return ("--subprocesses also records the processes a command starts, from their fork, with native "
                    f"and kernel stacks{here}; none of them was seen running Python")
        return f"--subprocesses also records the processes a command starts, from their fork{here}"

    def child_hint(self, *, daemon: bool) -> str:
        """"" when no child was seen, else why it was not recorded and how it would be."""
        if not self.child:
            return ""
        used = (f" (at least {self.children_cpu_s:.1f} s of CPU used by the processes it started)"
                if self.children_cpu_s >= 0.05 else "")
        return f"; it started {self.child}, which record does not follow{used}: " + self._subprocesses_hint(daemon)

    def unrecorded_children(self, *, daemon: bool) -> str:
        """What the target's descendants used that record did not sample, when
        it is worth saying (0.5 s of CPU or more); "" otherwise.  For a profile
        of the target alone: a multiprocessing pool, a prefork server or a
        build whose work ran in processes it started."""
        if self.children_cpu_s < MISSED_CHILDREN_CPU_S or not self.child:
            return ""
        first = f"{self.child} first, up to {self.children_max} at once" if self.children_max > 1 else self.child
        return (f"the processes that {self.comm or 'the target'} (pid {self.pid}) started ({first}) used "
                f"at least {self.children_cpu_s:.1f} s of CPU, which this profile does not hold: "
                + self._subprocesses_hint(daemon))


def _exited_unreaped(pid: int) -> bool:
    """Has our child ``pid`` exited (a zombie until it is waited for)?  It is not reaped here."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


def filter_excludes(status: dict[str, Any], tgid: int, comm: str) -> str:
    """The daemon's ``[sampling]`` filter (``status["filter"]``) when it leaves out
    process ``tgid`` named ``comm``, as ``comms = [...]``; "" when it does not, or
    when that cannot be told here (cgroups and units are not checked).  The BPF
    program samples a task only when it passes every filter set."""
    flt = status.get("filter")
    if not isinstance(flt, dict):
        return ""
    pids = flt.get("pids") or []
    comms = flt.get("comms") or []
    if pids and tgid not in pids:
        return f"[sampling] pids = {list(pids)}"
    if comms and comm and comm not in comms:
        return "[sampling] comms = [" + ", ".join(f'"{c}"' for c in comms) + "]"
    return ""


def filter_unchecked(status: dict[str, Any]) -> str:
    """The daemon's cgroups and units filters (not checked against the target), as
    ``[sampling] units = [...]``; "" when neither is set."""
    flt = status.get("filter")
    if not isinstance(flt, dict):
        return ""
    return " and ".join(f"[sampling] {k} = [" + ", ".join(f'"{v}"' for v in flt[k]) + "]"
                        for k in ("cgroups", "units") if flt.get(k))


def _windows(rec: DaemonRecording, since_ns: int, pids: list[int], root: str, *, drain: bool,
             keep: bool) -> int | None:
    """One request for the windows that end after ``since_ns`` (added to ``rec``
    when ``keep``); where the last of them ends, or ``None`` when none came."""
    buf = io.BytesIO()
    head = request(rec.socket, {"request": "snapshot", "since_ns": since_ns, "drain": drain, "pid": pids,
                                "format": "folded", "root": root}, buf, timeout=REQUEST_TIMEOUT_S)
    if keep:
        rec.add(head, buf.getvalue())
    end = head.get("end_ns")
    return int(end) if head.get("windows") and isinstance(end, int) else None


def _poll(rec: DaemonRecording, since_ns: int, pids: list[int], root: str, *, drain: bool) -> int:
    """One request: the windows that end after ``since_ns``; the new cursor."""
    end = _windows(rec, since_ns, pids, root, drain=drain, keep=True)
    return since_ns if end is None else end


def _start_cursor(rec: DaemonRecording, t_start_ns: int, pid: int, root: str) -> int:
    """Where the record's first window begins: a drain asked for now closes the
    daemon's window open when record began (its samples are from before), and
    the windows after it begin at the drain.  The daemon drains no more often
    than every 0.2 s (MIN_DRAIN_SPACING), so the profile begins at most that much
    before the record (or a request's time after it).  What was drained is not
    kept; when no window came back, the start itself.  FlamedError (the daemon
    went away since the probe) comes before anything started: record fails."""
    end = _windows(rec, t_start_ns - 5_000_000_000, [pid], root, drain=True, keep=False)
    return t_start_ns if end is None else end


def record(socket_path: str, *, pid: int | None, cmd: list[str], duration: float | None, since_s: float,
           root: str, warn: Callable[[str], None],
           status: dict[str, Any] | None = None, stdout: int | None = None) -> tuple[DaemonRecording, int, bool]:
    """Record through the daemon: the recording, the exit code (the command's, for
    ``cmd``) and whether Ctrl-C (or SIGTERM, which the caller turns into
    KeyboardInterrupt) ended it.  ``status``: the daemon's (:func:`probe`), for
    its sampling filter; ``stdout``: the command's standard output (None:
    record's).  A command that still runs when ``duration`` ended is left
    running, in ``rec.running``, for the caller to write the profile first and
    then wait for it (the exit code returned is then 0)."""
    rec = DaemonRecording(socket_path)
    t_start_ns = time.time_ns()
    # Before the command starts, so that none of its samples fall in the window closed.
    cursor = t_start_ns - int(since_s * 1e9) if since_s else _start_cursor(rec, t_start_ns, pid or os.getpid(), root)
    child: subprocess.Popen[bytes] | None = None
    if cmd:
        try:
            child = subprocess.Popen(cmd, stdout=stdout)
        except OSError as e:
            raise UsageError(f"cannot run {cmd[0]}: {e.strerror}") from None
        target = child.pid
    else:
        assert pid is not None
        target = pid
    rec.target = target
    watch = rec.watch = TargetWatch(target, os.path.basename(cmd[0])[:15] if cmd else "")
    watch.update()
    rec.maybe_filtered = filter_unchecked(status or {})

    def check_filter(*, say: bool) -> None:
        # A command is checked once it has had time to exec (a wrapper's name is not the target's).
        rec.comm = watch.comm
        rec.filtered_out = filter_excludes(status or {}, target, rec.comm)
        if rec.filtered_out and say:
            warn(f"the daemon samples only {rec.filtered_out}: {rec.comm} (pid {target}) is outside it, so its "
                 "samples will not come back; --no-daemon records it here")

    checked = child is None
    if checked:
        check_filter(say=True)
    began = time.monotonic()
    deadline = began + duration if duration else None
    interrupted = False
    try:
        next_poll = time.monotonic() + POLL_S
        while True:
            watch.update(child)
            # A zombie has exited too: its /proc entry stays until its parent reaps it.
            if (child.poll() is not None) if child is not None else not running(f"/proc/{target}/stat"):
                rec.exited_s = time.monotonic() - began
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if now >= next_poll:
                if not checked:
                    checked = True
                    check_filter(say=True)
                try:
                    cursor = _poll(rec, cursor, [target], root, drain=False)
                except FlamedError as e:
                    rec.broken = str(e)
                    break
                next_poll = now + POLL_S
            time.sleep(max(0.01, min(0.1, next_poll - time.monotonic())))
    except KeyboardInterrupt:
        interrupted = True
    if not checked:
        check_filter(say=False)
    rec.comm, rec.child, rec.version = watch.comm, watch.child, watch.version
    if not rec.broken:
        # The end: a drain puts the last samples into the ring, then they are read.
        try:
            cursor = _poll(rec, cursor, [target], root, drain=True)
        except FlamedError as e:
            rec.broken = str(e)
        except KeyboardInterrupt:
            interrupted = True
    rc = 0
    if child is not None:
        if interrupted or child.poll() is not None or rec.broken:
            rc = finish_child(child, interrupted, warn)
        else:
            rec.running = child
    if rec.broken:
        got = (f"{int(sum(rec.stacks.values()))} samples in {rec.windows} window(s)" if rec.windows
               else "nothing")
        warn(f"the daemon at {socket_path} went away mid-record ({rec.broken}); the profile holds what was "
             f"received before: {got}")
    return rec, rc, interrupted
