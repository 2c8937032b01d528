"""Supervisor of py-spy children: one per watched Python process.

Each child is ``py-spy record --pid P --format chrometrace -t [--nonblocking]
[--idle] [--native] --rate R -o FILE``.  py-spy only writes chrometrace when
it stops, so a child records one *window*: after ``window_s`` a successor is
started and the old child gets SIGINT (py-spy's Ctrl-C: it writes its file and
exits) ``overlap_s`` later, once the successor samples, so no instant goes
uncovered.  A finished child becomes a :class:`CompletedRun`.

Children never outlive their parent: each gets ``PR_SET_PDEATHSIG=SIGKILL``
and its own process group, and :meth:`PySpySupervisor.close` stops, waits for
and, past a deadline, kills them.  Note that Linux delivers the death signal
when the *thread* that forked exits, so call :meth:`tick` and :meth:`add` from
one long-lived thread.

Failures are counted by reason (:class:`Failure`) and retried with exponential
backoff while the target lives; a target that exits ends its supervision.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flamed.errors import ConfigError, InputError
from flamed.procstat import have_cap_sys_ptrace, running
from flamed.pyspy.chrometrace import PyTrace, parse_chrometrace

log = logging.getLogger(__name__)

#: py-spy above this rate makes samples closer than the clock fit can tell
#: apart, and costs the target more than the join gains.
MAX_RATE = 250


class Failure(str, enum.Enum):
    MISSING_BINARY = "missing_binary"
    PERMISSION = "permission"
    TARGET_EXITED = "target_exited"
    TIMEOUT = "timeout"
    UNSUPPORTED = "unsupported_interpreter"
    CRASH = "crash"
    LIMIT = "limit"  # not started: max_children reached


@dataclass(frozen=True)
class PySpyOptions:
    """How py-spy children run.

    binary: py-spy executable (default: next to this Python's executable, else PATH).
    rate: samples per second per process (default 100, at most 250).
    nonblocking: don't pause the target while reading it (default True).
    idle: include idle threads; keeps every thread in every sample, which the
        alignment uses to know when each sample happened (default True).
    native: py-spy's own native frames (forces blocking mode; default False).
    window_s: length of one py-spy run; its trace arrives when it ends (default 10).
    first_window_s: length of the first run on a process (default: window_s).  A
        short one brings a trace while the process surely still runs, which
        mapping pthread ids to OS tids (interpreters before 3.11) needs.
    overlap_s: successor and predecessor run together this long (default 0.25).
    max_children: processes with a py-spy at once (default 8; py-spy 0.4.3 measured 5-7 MB RSS and
        2-5 % of a core at 100 Hz each).
    backoff_s / backoff_max_s: first and longest delay before a restart (default 1 / 60).
    stop_timeout_s: SIGINT to file written, else SIGKILL and a ``timeout`` (default 10).
    attach_timeout_s: a child not known to sample is stopped no earlier than this (default 5).
    min_age_s: a process gets py-spy once it is this old (default 0.3).
    nice: scheduling niceness of py-spy children, so their samples stay on time on a
        busy host (default -10; needs root, else left at the daemon's; 0 = inherit).
    exit_grace_s: after its target exits, a child that has not stopped by itself gets SIGINT (default 2).
    workdir: where trace files go (default: a private directory under ``workdir_parent``, see
        :func:`private_workdir`, removed at close).
    workdir_parent: where that private directory is made (default: the system temp directory);
        the daemon gives its runtime directory, so a daemon killed by SIGKILL leaves nothing in /tmp.
    """

    binary: str | None = None
    rate: int = 100
    nonblocking: bool = True
    idle: bool = True
    native: bool = False
    window_s: float = 10.0
    first_window_s: float | None = None
    overlap_s: float = 0.25
    max_children: int = 8
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stop_timeout_s: float = 10.0
    attach_timeout_s: float = 5.0
    min_age_s: float = 0.3
    nice: int = -10
    exit_grace_s: float = 2.0
    workdir: str | None = None
    workdir_parent: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.rate <= MAX_RATE:
            raise ConfigError(f"py-spy rate must be 1..{MAX_RATE} Hz, got {self.rate}")
        if self.first_window_s is not None and self.first_window_s <= 0:
            raise ConfigError("py-spy first_window_s must be > 0")
        if self.window_s <= 0 or self.overlap_s < 0 or self.max_children < 1:
            raise ConfigError("py-spy window_s must be > 0, overlap_s >= 0, max_children >= 1")

    @property
    def interval_ns(self) -> int:
        return 1_000_000_000 // self.rate


def find_pyspy(binary: str | None = None) -> str | None:
    """The py-spy to run: ``binary`` if given (path or name on PATH), else the venv's, else PATH."""
    if binary:
        if os.sep in binary:
            return binary if os.access(binary, os.X_OK) else None
        return shutil.which(binary)
    sibling = Path(sys.executable).parent / "py-spy"
    if sibling.exists():
        return str(sibling)
    return shutil.which("py-spy")


def command(opts: PySpyOptions, binary: str, pid: int, out: str) -> list[str]:
    cmd = [binary, "record", "--pid", str(pid), "--format", "chrometrace", "--threads",
           "--rate", str(opts.rate), "--output", out]
    if opts.nonblocking and not opts.native:
        cmd.append("--nonblocking")
    if opts.idle:
        cmd.append("--idle")
    if opts.native:
        cmd.append("--native")
    return cmd


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl


def _child_setup(nice: int) -> Callable[[], None]:
    def setup() -> None:
        # Runs between fork and exec: only simple calls, resolved before fork.
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setpgid(0, 0)
        if nice:
            # A late wakeup is a late sample: on a busy host py-spy at nice 0
            # sampled at a fraction of its rate (measured), blurring phases.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, nice)
    return setup


_PERMISSION = re.compile(r"Permission Denied|Operation not permitted|EPERM|ptrace", re.I)
_GONE = re.compile(r"Check that the process is running|No such process|os error 3\b|process .* (?:not found|exited)", re.I)
_UNSUPPORTED = re.compile(r"Failed to find python version|Unsupported version|failed to find a python interpreter|"
                          r"not a python|Unsupported python", re.I)


def classify(returncode: int, stderr: str, target_alive: bool, killed_by_us: bool,
             can_ptrace: bool = True) -> Failure | None:
    """Why a py-spy child failed (``None``: it did not).

    Without CAP_SYS_PTRACE py-spy's reads fail in ways it reports as anything
    from "permission denied" to "failed to find python version"; then any
    failure on a live target is a permission failure.
    """
    if killed_by_us:
        return Failure.TIMEOUT
    if returncode == 0:
        return None
    if returncode < 0:
        return Failure.CRASH
    if _PERMISSION.search(stderr) or (not can_ptrace and target_alive):
        return Failure.PERMISSION
    if not target_alive or _GONE.search(stderr):
        return Failure.TARGET_EXITED
    if _UNSUPPORTED.search(stderr):
        return Failure.UNSUPPORTED
    return Failure.CRASH


#: Private work directories are named ``flamed-pyspy-PID-XXXXXXXX``: PID is their owner's.
WORKDIR_PREFIX = "flamed-pyspy-"
_WORKDIR_RE = re.compile(rf"^{re.escape(WORKDIR_PREFIX)}(\d+)-[A-Za-z0-9_]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_workdirs(parent: str) -> list[str]:
    """Remove the private work directories under ``parent`` whose owner process is gone
    (a SIGKILL skips :meth:`PySpySupervisor.close`); returns their paths.

    A reused pid only keeps a stale directory until a later start; a live
    owner's directory is never touched.
    """
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = _WORKDIR_RE.match(name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d py-spy work director%s left by processes that no longer run: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def private_workdir(parent: str | None = None) -> str:
    """A new directory for py-spy's trace files under ``parent`` (default: the system temp
    directory), named after this process, after removing the stale ones there."""
    if parent is not None:
        try:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        except OSError as e:
            log.warning("cannot create %s for py-spy's trace files (%s); using %s", parent, e.strerror or e,
                        tempfile.gettempdir())
            parent = None
    base = parent if parent is not None else tempfile.gettempdir()
    remove_stale_workdirs(base)
    return tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=base)


@dataclass
class CompletedRun:
    """One finished py-spy window on one process."""

    pid: int
    pyspy_pid: int
    spawn_ns: int  # CLOCK_MONOTONIC just before the spawn
    end_ns: int  # CLOCK_MONOTONIC when the file was collected
    trace: PyTrace
    interval_ns: int


@dataclass
class _Child:
    pid: int
    proc: subprocess.Popen[bytes]
    out: str
    err: str
    spawn_ns: int
    stop_at_ns: int | None = None  # when to send SIGINT
    sigint_ns: int | None = None
    successor: _Child | None = None  # stop only once this one samples
    killed: bool = False


@dataclass
class _Target:
    pid: int
    children: list[_Child] = field(default_factory=list)
    failures: int = 0
    next_try_ns: int = 0
    done: bool = False
    rotated: bool = False  # past the first window


class PySpySupervisor:
    """Keeps one py-spy per added process running, in overlapping windows.

    ``add``/``remove`` say which processes to record; ``tick()`` (call it every
    few hundred ms) reaps, rotates and restarts, and returns the runs that
    finished.  ``close()`` stops everything and returns the last runs.
    """

    def __init__(self, options: PySpyOptions | None = None, *, proc_root: str = "/proc",
                 clock: Callable[[], int] = time.monotonic_ns,
                 on_spawn: Callable[[int], None] | None = None,
                 ready: Callable[[int], bool] | None = None,
                 on_discard: Callable[[int], None] | None = None) -> None:
        self.options = options or PySpyOptions()
        self.on_spawn = on_spawn
        self.ready = ready
        self.on_discard = on_discard  # a child ended without a usable trace
        self._closing = False
        self.binary = find_pyspy(self.options.binary)
        self.can_ptrace = have_cap_sys_ptrace(proc_root)
        if self.binary is not None and not self.can_ptrace:
            log.warning("no CAP_SYS_PTRACE: py-spy cannot read Python processes, which keep native and "
                        "kernel stacks only (grant CAP_SYS_PTRACE or run as root)")
        self.proc_root = proc_root
        self._now = clock
        self._targets: dict[int, _Target] = {}
        self._own_dir = self.options.workdir is None
        self.workdir = self.options.workdir or private_workdir(self.options.workdir_parent)
        self.failures: Counter[str] = Counter()
        self.started = 0
        self.completed_runs = 0
        self._warned: set[str] = set()

    # -- membership -------------------------------------------------------
    def add(self, pid: int, *, started_ns: int | None = None, start_now: bool = True) -> bool:
        """Record ``pid`` from now on; False (and a ``limit`` failure) when the bound is reached.

        ``started_ns``: when the process started (CLOCK_MONOTONIC); py-spy is
        started once it is ``min_age_s`` old, so the many processes that live
        for milliseconds cost nothing.  ``start_now`` False: never here, only
        by the next :meth:`tick` (for a caller with something to set up first).
        """
        t = self._targets.get(pid)
        if t is not None:
            if t.done:
                # Removed and added again (exec): a fresh run, the old one finishes on its own.
                t.done = False
                t.failures = 0
                t.next_try_ns = 0
            return True
        # Targets being stopped (their process exited) no longer count: their
        # py-spy is finishing and goes away within stop_timeout_s.
        if sum(1 for t in self._targets.values() if not t.done) >= self.options.max_children:
            self.failures[Failure.LIMIT.value] += 1
            return False
        t = _Target(pid)
        self._targets[pid] = t
        due = (started_ns if started_ns is not None else self._now()) + int(self.options.min_age_s * 1e9)
        if due <= self._now() and start_now:
            self._start(t)
        else:
            t.next_try_ns = due
        return True

    def remove(self, pid: int) -> None:
        """Stop recording ``pid``: its children write their traces and are collected by ``tick``."""
        t = self._targets.get(pid)
        if t is None:
            return
        t.done = True
        now = self._now()
        # py-spy stops by itself when its target exits, and writes its trace;
        # SIGINT is only the fallback for a target that lingers (zombie, exec).
        grace = now + int(self.options.exit_grace_s * 1e9)
        for c in t.children:
            if c.stop_at_ns is None or c.stop_at_ns > grace:
                c.stop_at_ns = grace

    def pids(self) -> list[int]:
        return sorted(p for p, t in list(self._targets.items()) if not t.done)

    def idle(self) -> bool:
        """No process to start, watch or stop py-spy for: :meth:`tick` has nothing to do."""
        return not self._targets

    def busy_pids(self) -> set[int]:
        """Processes with a py-spy child still running (its trace is yet to come)."""
        return {p for p, t in list(self._targets.items()) if t.children}

    def running(self) -> int:
        # list(): also called from other threads (metrics) while tick() changes the dict
        return sum(1 for t in list(self._targets.values()) for c in list(t.children) if c.proc.poll() is None)

    # -- the loop ---------------------------------------------------------
    def tick(self) -> list[CompletedRun]:
        now = self._now()
        out: list[CompletedRun] = []
        opts = self.options
        window = int(opts.window_s * 1e9)
        for pid in list(self._targets):
            t = self._targets[pid]
            for c in list(t.children):
                rc = c.proc.poll()
                if rc is not None:
                    t.children.remove(c)
                    run = self._finish(t, c, rc)
                    if run is not None:
                        out.append(run)
                    continue
                if (c.stop_at_ns is not None and now >= c.stop_at_ns and c.sigint_ns is None
                        and self._may_stop(c, now)):
                    self._signal(c, signal.SIGINT)
                    log.debug("py-spy %d for pid %d: SIGINT", c.proc.pid, t.pid)
                    c.sigint_ns = now
                elif c.sigint_ns is not None and now - c.sigint_ns > opts.stop_timeout_s * 1e9 and not c.killed:
                    self._signal(c, signal.SIGKILL)
                    c.killed = True
            if t.done:
                if not t.children:
                    del self._targets[pid]
                continue
            live = [c for c in t.children if c.stop_at_ns is None]
            if not live:
                if now >= t.next_try_ns:
                    self._start(t)
            elif (now - live[-1].spawn_ns >= (window if t.rotated or opts.first_window_s is None
                                               else int(opts.first_window_s * 1e9))
                  and self._sampling(live[-1], now)):
                # (a child still attaching is not rotated: a successor would only
                # add a second attach to a host that is already slow)
                # Rotate: the successor starts now, the predecessor stops after the overlap.
                old = live[-1]
                t.rotated = True
                old.stop_at_ns = now + int(opts.overlap_s * 1e9)
                self._start(t)
                fresh = [c for c in t.children if c.stop_at_ns is None]
                old.successor = fresh[-1] if fresh else None
        self.completed_runs += len(out)
        return out

    def close(self, timeout_s: float | None = None) -> list[CompletedRun]:
        """Stop every child (SIGINT, then SIGKILL past the timeout) and collect the traces."""
        self._closing = True
        for pid in list(self._targets):
            self.remove(pid)
            for c in self._targets[pid].children:
                c.stop_at_ns = self._now()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.options.stop_timeout_s)
        out: list[CompletedRun] = []
        while self._targets and time.monotonic() < deadline:
            out.extend(self.tick())
            if self._targets:
                time.sleep(0.02)
        for t in self._targets.values():
            for c in t.children:
                self._signal(c, signal.SIGKILL)
                c.killed = True
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=2)
                self.failures[Failure.TIMEOUT.value] += 1
                self._cleanup(c)
        self._targets.clear()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return out

    # -- internals --------------------------------------------------------
    def _sampling(self, c: _Child, now: int) -> bool:
        """Has py-spy started sampling (so SIGINT makes it write, not die)?

        py-spy installs its Ctrl-C handler only after attaching, which takes
        from tens of ms to seconds on a loaded host; a SIGINT before that
        kills it without a trace.  ``ready`` (the clock uprobe's first hit)
        says so exactly; without it, an age is the proxy.
        """
        if c.proc.poll() is not None:
            return False
        if self.ready is not None and self.ready(c.proc.pid):
            return True
        return now - c.spawn_ns >= int(self.options.attach_timeout_s * 1e9)

    def _may_stop(self, c: _Child, now: int) -> bool:
        if self._closing:
            return self._sampling(c, now) or now - c.spawn_ns >= int(self.options.attach_timeout_s * 1e9)
        if not self._sampling(c, now):
            return False
        s = c.successor
        # The predecessor of a rotation keeps sampling until its successor does.
        return s is None or s.proc.poll() is not None or self._sampling(s, now)

    def _start(self, t: _Target) -> None:
        if self.binary is None:
            self._fail(t, Failure.MISSING_BINARY, "py-spy not found (set the py-spy binary or install py-spy); "
                       "Python processes keep native and kernel stacks only")
            return
        seq = self.started
        out = os.path.join(self.workdir, f"pyspy-{t.pid}-{seq}.json")
        err = os.path.join(self.workdir, f"pyspy-{t.pid}-{seq}.err")
        cmd = command(self.options, self.binary, t.pid, out)
        spawn = self._now()
        try:
            with open(err, "wb") as ef:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=ef,
                                        preexec_fn=_child_setup(self.options.nice), close_fds=True,
                                        env={**os.environ, "RUST_BACKTRACE": "0"})
        except FileNotFoundError:
            self._fail(t, Failure.MISSING_BINARY, f"{self.binary} not found")
            return
        except PermissionError:
            self._fail(t, Failure.PERMISSION, f"{self.binary} is not executable")
            return
        self.started += 1
        log.debug("py-spy %d started for pid %d", proc.pid, t.pid)
        if self.on_spawn is not None:
            self.on_spawn(proc.pid)
        t.children.append(_Child(pid=t.pid, proc=proc, out=out, err=err, spawn_ns=spawn))

    def _finish(self, t: _Target, c: _Child, rc: int) -> CompletedRun | None:
        try:
            stderr = Path(c.err).read_text(errors="replace")
        except OSError:
            stderr = ""
        trace: PyTrace | None = None
        if os.path.exists(c.out):
            try:
                trace = parse_chrometrace(Path(c.out).read_bytes(), source=c.out)
            except InputError as e:
                log.warning("py-spy %d: unreadable trace: %s", c.proc.pid, e)
        self._cleanup(c)
        # A child we stopped exits 0 after writing; SIGINT may also end it by the signal.
        stopped = c.sigint_ns is not None and not c.killed
        failure = None if (trace is not None and (rc == 0 or stopped)) else classify(
            rc, stderr, self._alive(t.pid), c.killed, self.can_ptrace)
        if failure is None and trace is None:
            failure = Failure.CRASH
        if failure is not None:
            if failure is Failure.TARGET_EXITED or not self._alive(t.pid):
                # The process is gone: nothing to retry, and not a fault of py-spy.
                self.failures[Failure.TARGET_EXITED.value] += 1
                t.done = True
                log.debug("py-spy %d on pid %d: target exited (rc %d, %s)", c.proc.pid, t.pid, rc,
                          (stderr.strip().splitlines() or ["no message"])[0])
            else:
                last = stderr.strip().splitlines()[:1]
                hint = ("; py-spy needs root or CAP_SYS_PTRACE (and kernel.yama.ptrace_scope <= 1, or 3 never)"
                        if failure is Failure.PERMISSION else "")
                self._fail(t, failure, f"py-spy on pid {t.pid} failed ({failure.value}): "
                           f"{last[0] if last else f'exit {rc}'}{hint}")
        else:
            t.failures = 0
            if not self._alive(t.pid):
                t.done = True
        if trace is None or trace.first_ts_us is None:
            if self.on_discard is not None:
                self.on_discard(c.proc.pid)
            return None
        return CompletedRun(pid=t.pid, pyspy_pid=c.proc.pid, spawn_ns=c.spawn_ns, end_ns=self._now(),
                            trace=trace, interval_ns=self.options.interval_ns)

    def _fail(self, t: _Target, reason: Failure, message: str) -> None:
        self.failures[reason.value] += 1
        t.failures += 1
        delay = min(self.options.backoff_s * 2 ** (t.failures - 1), self.options.backoff_max_s)
        t.next_try_ns = self._now() + int(delay * 1e9)
        if reason in (Failure.MISSING_BINARY, Failure.PERMISSION):
            t.next_try_ns = self._now() + int(self.options.backoff_max_s * 1e9)
        # Log each kind of failure once at warning level, repeats at debug.
        level = logging.WARNING if reason.value not in self._warned else logging.DEBUG
        self._warned.add(reason.value)
        log.log(level, "%s; retry in %.1fs", message, (t.next_try_ns - self._now()) / 1e9)

    def _alive(self, pid: int) -> bool:
        return running(os.path.join(self.proc_root, str(pid), "stat"))

    @staticmethod
    def _signal(c: _Child, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(c.proc.pid, sig)

    @staticmethod
    def _cleanup(c: _Child) -> None:
        for p in (c.out, c.err):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def metrics(self) -> dict[str, int]:
        """Flat counters: ``running``, ``started``, ``completed``, ``failed_<reason>``."""
        m = {"running": self.running(), "started": self.started, "completed": self.completed_runs}
        for r in Failure:
            m[f"failed_{r.value}"] = self.failures.get(r.value, 0)
        return m
