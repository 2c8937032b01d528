"""The stack of every thread of a process, now: what ``flamed dump`` prints.

Per task (/proc/PID/task/TID): its name, scheduler state, wait channel and,
when readable (root), its kernel stack; for a CPython process each thread's
Python frames, read from user space with the frame walker's layouts
(:mod:`flamed.sampling.cpython`); for a CPython the walker has no layout
for (2.7, 3.6, 3.7), ``py-spy dump --nonblocking`` when a py-spy is found.
Nothing attaches to the process: it is not
stopped, so a thread that runs while it is read may show a torn stack (a
hung process, the case this is for, holds still).  Native frames are not
read: that would need ptrace or an unwinder over the process's stacks.

:func:`dump_process` gathers; :func:`to_json` and :func:`format_text` print.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flamed.errors import CapabilityError, FlamedError, UsageError
from flamed.model import printable
from flamed.procstat import ptrace_advice, read_stat, status_tgid
from flamed.sampling.pystack import short_filename

#: Version of the ``--json`` document (see docs/dump.md); a change of a
#: field's meaning or a removal bumps it, a new field does not.
JSON_SCHEMA = 1
#: Bounds of the Python walk (thread states, frames per thread).
MAX_THREADS = 4096
MAX_DEPTH = 1024
#: A layout check races running threads (a frame freed while it is read):
#: it is retried before the frames are given up.
VALIDATE_TRIES = 3
#: How long ``py-spy dump`` may take (versions the walker cannot read).
PYSPY_TIMEOUT_S = 20.0

STATE_NAMES = {
    "R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "tracing stop",
    "Z": "zombie", "X": "dead", "I": "idle", "P": "parked", "W": "waking", "K": "wakekill",
}
_PY_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")
_KERNEL_LINE = re.compile(r"^\[<[0-9a-fA-F]+>\] ")


class NoSuchProcess(FlamedError):
    """The pid names no process (or it exited while being read)."""


class NotPermitted(CapabilityError):
    """The process's maps or memory cannot be read by this user."""


@dataclass(frozen=True, slots=True)
class PyFrame:
    function: str
    #: None for a frame whose code object could not be read
    file: str | None
    line: int | None

    @classmethod
    def parse(cls, frame: str) -> PyFrame:
        """A frame in flamed's ``NAME (FILENAME:LINE)`` form, split up."""
        m = _PY_FRAME.match(frame)
        if m is None:
            return cls(frame, None, None)
        return cls(m.group("function"), m.group("file"), int(m.group("line")))

    def text(self) -> str:
        if self.file is None:
            return self.function
        return f"{self.function} ({short_filename(self.file)}:{self.line})"


@dataclass(slots=True)
class PyThread:
    """One Python thread state: its ids as the interpreter holds them, its frames (innermost first)."""

    #: PyThreadState.thread_id, pthread_self() of the thread
    thread_id: int
    #: PyThreadState.native_thread_id (3.11+; the tid in the process's own PID namespace)
    native_thread_id: int | None
    frames: list[PyFrame]
    #: the walk stopped early (an unreadable frame, or the depth bound)
    truncated: bool = False


@dataclass(slots=True)
class ThreadDump:
    tid: int
    name: str
    #: one letter of /proc/PID/task/TID/stat (R, S, D, ...)
    state: str
    wchan: str | None
    #: innermost first; None when unreadable (see ProcessDump.kernel_error)
    kernel: list[str] | None
    #: None: no Python thread state is this thread's
    python: PyThread | None = None

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "unknown")


@dataclass(slots=True)
class ProcessDump:
    pid: int
    cmdline: list[str]
    threads: list[ThreadDump]
    #: "3.11.7" (or "3.8" when the binary does not say its micro version); None: no Python frames
    python_version: str | None = None
    interpreter: str | None = None
    #: why there are no Python frames (not CPython, not initialized, layout refused)
    python_error: str | None = None
    #: why the kernel stacks are missing (None when they were read)
    kernel_error: str | None = None
    #: Python thread states no task of the process was matched to (exited, or an unmapped pthread id)
    unmatched: list[PyThread] = field(default_factory=list)
    #: why some thread states are unmatched
    unmatched_reason: str | None = None
    #: who read the Python frames: "flamed" (the walker's layouts) or "py-spy"
    python_reader: str | None = None


# ---- /proc --------------------------------------------------------------


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _task_state(task: Path) -> str | None:
    fields = read_stat(task / "stat")
    return fields[0].decode("ascii", "replace") if fields else None


def _wchan(task: Path) -> str | None:
    raw = _read(task / "wchan")
    text = raw.decode("ascii", "replace").strip() if raw is not None else ""
    # "0": running, or a kernel that hides wait channels from this reader.
    return text if text and text != "0" else None


def _kernel_stack(task: Path) -> tuple[list[str] | None, str | None]:
    try:
        text = (task / "stack").read_text(errors="replace")
    except OSError as e:
        why = "needs root" if e.errno in (errno.EACCES, errno.EPERM) else (e.strerror or str(e))
        return None, f"/proc/PID/task/TID/stack: {why}"
    return [_KERNEL_LINE.sub("", ln).strip() for ln in text.splitlines() if ln.strip()], None


def _check_process(proc: Path, pid: int) -> None:
    """``pid`` is a process, not a thread of one: /proc/TID exists for every
    thread (not listed), and would show the whole process under the thread's id."""
    raw = _read(proc / str(pid) / "status")
    tgid = status_tgid(raw) if raw is not None else None
    if tgid is not None and tgid != pid:
        raise UsageError(f"{pid} is a thread of process {tgid}, not a process; give -p {tgid}")


def _tasks(proc: Path, pid: int) -> tuple[list[ThreadDump], str | None]:
    try:
        # The main thread first (its tid is the pid), then in tid order.
        tids = sorted((int(n) for n in os.listdir(proc / str(pid) / "task")), key=lambda t: (t != pid, t))
    except FileNotFoundError:
        raise NoSuchProcess(f"no such process: {pid}") from None
    except OSError as e:
        raise NotPermitted(f"cannot list the threads of pid {pid} ({e.strerror})") from None
    out: list[ThreadDump] = []
    kernel_error: str | None = None
    for tid in tids:
        task = proc / str(pid) / "task" / str(tid)
        state = _task_state(task)
        if state is None:
            continue  # exited since the listing
        name = (_read(task / "comm") or b"").decode("utf-8", "replace").rstrip("\n")
        kernel, why = _kernel_stack(task)
        kernel_error = kernel_error or why
        out.append(ThreadDump(tid, name, state, _wchan(task), kernel))
    if not out:
        raise NoSuchProcess(f"no such process: {pid} (it has exited)")
    return out, kernel_error


def _check_readable(proc: Path, pid: int) -> None:
    """Reading a process's maps takes the right to ptrace-read it: say so
    plainly, rather than let the probe take the process for gone."""
    try:
        with open(proc / str(pid) / "maps", "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise NoSuchProcess(f"no such process: {pid}") from None
    except PermissionError:
        raise NotPermitted(f"cannot read the memory maps of pid {pid}: {ptrace_advice(pid)}") from None
    except OSError:
        pass  # a zombie's maps read as empty or fail: its threads are still dumped


# ---- Python frames ------------------------------------------------------


def _version_text(version: tuple[int, int], hexversion: int | None) -> str:
    if not hexversion:
        return f"{version[0]}.{version[1]}"
    micro = (hexversion >> 8) & 0xFF
    level = (hexversion >> 4) & 0xF
    serial = hexversion & 0xF
    tail = {0xA: f"a{serial}", 0xB: f"b{serial}", 0xC: f"rc{serial}"}.get(level, "")
    return f"{version[0]}.{version[1]}.{micro}{tail}"


def _reader(dump: ProcessDump) -> int:
    """The task whose /proc entries show the process's memory: the main
    thread, unless it has exited (a zombie) while other threads still run --
    a process whose main thread called pthread_exit() -- whose maps and
    memory /proc then shows through a live thread only."""
    leader = next((t for t in dump.threads if t.tid == dump.pid), None)
    if leader is None or leader.state not in ("Z", "X"):
        return dump.pid
    live = [t.tid for t in dump.threads if t.state not in ("Z", "X")]
    return live[0] if live else dump.pid


def _add_python(dump: ProcessDump, proc: Path, reader: int, pyspy: str | None) -> None:
    """Python frames of every thread, matched to its task; else ``python_error``.
    ``reader``: the task whose memory is read (:func:`_reader`); ``pyspy``:
    the py-spy for versions the walker has no layout for (None: not found)."""
    from flamed.sampling.cpython.process import Refusal, probe
    from flamed.sampling.cpython.symbolize import CodeSymbolizer
    from flamed.sampling.cpython.walk import walk_memory

    target = probe(reader, proc)
    if isinstance(target, Refusal):
        dump.python_error = target.reason
        if target.version is not None:
            _add_pyspy(dump, proc, reader, target.version, pyspy)
        return
    dump.python_version = _version_text(target.version, target.hexversion)
    dump.interpreter = target.interpreter
    dump.python_reader = "flamed"
    mem = target.memory()
    if mem.read(target.interp_addr, 8) is None and mem.last_errno == errno.EPERM:
        raise NotPermitted(f"cannot read the memory of pid {dump.pid}: {ptrace_advice(dump.pid)}")
    st = target.state(mem)
    for attempt in range(VALIDATE_TRIES):
        if st.kind != "ready":
            break
        st = target.validate(mem)
        if st.kind != "invalid" or attempt == VALIDATE_TRIES - 1:
            break
        time.sleep(0.05)
    # not_yet after state() said ready: no thread has a Python frame to check against.
    if st.kind == "invalid" or (st.kind == "not_yet" and target.state(mem).kind != "ready"):
        dump.python_error = st.reason
        return
    walk = walk_memory(mem, target.layout, target.interp_addr, max_threads=MAX_THREADS, max_depth=MAX_DEPTH)
    if walk is None:
        dump.python_error = f"cannot read the interpreter of pid {dump.pid} any more (errno {mem.last_errno})"
        return
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    pythreads = [PyThread(t.thread_id, t.native_thread_id, [PyFrame.parse(f) for f in sym.symbolize(t.frames)],
                          t.truncated or t.deep) for t in walk.threads]
    _place(dump, proc, reader, pythreads, namespaced=target.in_pid_namespace)
    if walk.bounded:
        bound = f"more than {MAX_THREADS} Python threads: the oldest are not shown"
        dump.unmatched_reason = f"{dump.unmatched_reason}; {bound}" if dump.unmatched_reason else bound


def _place(dump: ProcessDump, proc: Path, reader: int, pythreads: list[PyThread], *, namespaced: bool) -> None:
    """Each Python thread under its task, or in ``unmatched``."""
    tids = _match_threads(dump, proc, pythreads, reader, namespaced=namespaced)
    by_tid = {t.tid: t for t in dump.threads}
    why: list[str] = []
    for pt, tid in zip(pythreads, tids):
        if tid is not None and tid in by_tid and by_tid[tid].python is None:
            by_tid[tid].python = pt
            continue
        dump.unmatched.append(pt)
        if tid is None and dump.unmatched_reason:
            continue  # _match_threads said why
        if tid is None or tid not in by_tid:
            said = ("a thread's task was not among those listed (it started or ended between the listing "
                    "of tasks and the read of the interpreter)")
        else:
            said = f"task {tid} holds more than one Python thread state (a subinterpreter's?)"
        if said not in why:
            why.append(said)
    if why:
        extra = "; ".join(why)
        dump.unmatched_reason = f"{dump.unmatched_reason}; {extra}" if dump.unmatched_reason else extra


def _add_pyspy(dump: ProcessDump, proc: Path, reader: int, version: tuple[int, int], pyspy: str | None) -> None:
    """The Python frames of a CPython the walker has no layout for, from
    ``py-spy dump --json --nonblocking`` (it reads 2.7 and 3.3 on); the
    walker's refusal stays in ``python_error`` when py-spy is missing or fails."""
    refused = dump.python_error or f"CPython {version[0]}.{version[1]}: no frame layout"
    if pyspy is None:
        dump.python_error = f"{refused}; py-spy, which reads it, was not found (install it, or put it on PATH)"
        return
    cmd = [pyspy, "dump", "--pid", str(reader), "--json", "--nonblocking"]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=PYSPY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        dump.python_error = f"{refused}; py-spy dump did not answer in {PYSPY_TIMEOUT_S:g} s"
        return
    except OSError as e:
        dump.python_error = f"{refused}; cannot run {pyspy}: {e.strerror}"
        return
    try:
        doc = json.loads(r.stdout) if r.returncode == 0 else None
        pythreads = [_pyspy_thread(t) for t in doc] if isinstance(doc, list) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        pythreads = None
    if pythreads is None:
        err = r.stderr.decode("utf-8", "replace").strip().splitlines()
        said = err[-1] if err else f"exit {r.returncode}, no thread list on its output"
        dump.python_error = f"{refused}; py-spy dump failed: {said}"
        return
    dump.python_error = None
    dump.python_version = f"{version[0]}.{version[1]}"
    try:
        dump.interpreter = os.readlink(proc / str(reader) / "exe")
    except OSError:
        dump.interpreter = None
    dump.python_reader = "py-spy"
    from flamed.sampling.cpython.process import nspids

    _place(dump, proc, reader, pythreads, namespaced=len(nspids(proc / str(reader) / "status")) > 1)


def _pyspy_thread(t: dict[str, Any]) -> PyThread:
    """One thread of ``py-spy dump --json``: its ids and frames (innermost first, as py-spy lists them)."""
    frames = [PyFrame(str(f["name"]), str(f["filename"]) if f.get("filename") is not None else None,
                      int(f["line"]) if isinstance(f.get("line"), int) else None) for f in t["frames"]]
    os_tid = t.get("os_thread_id")
    return PyThread(int(t["thread_id"]), int(os_tid) if isinstance(os_tid, int) else None, frames)


def _match_threads(dump: ProcessDump, proc: Path, threads: list[PyThread], reader: int, *,
                   namespaced: bool) -> list[int | None]:
    """The host tid of each thread state (None: not found); ``reader``: the
    task whose memory is read (:func:`_reader`)."""
    if any(t.native_thread_id is None for t in threads):
        # Before 3.11 a thread state holds only pthread_self(): the tid is in glibc's struct pthread.
        from flamed.pyspy.threadids import ThreadIds

        mapping, why = ThreadIds(str(proc)).resolve(reader, [t.thread_id for t in threads])
        if why:
            dump.unmatched_reason = why
        return [mapping.get(t.thread_id) for t in threads]
    if not namespaced:
        return [t.native_thread_id for t in threads]
    # 3.11+ in its own PID namespace: the namespace's tids, the last of each task's NSpid.
    from flamed.sampling.cpython.process import nspids

    host: dict[int, int] = {}
    for t in dump.threads:
        ns = nspids(proc / str(dump.pid) / "task" / str(t.tid) / "status")
        if ns:
            host[ns[-1]] = t.tid
    return [host.get(t.native_thread_id or 0) for t in threads]


def _cmdline(proc: Path, task: int) -> list[str]:
    raw = _read(proc / str(task) / "cmdline") or b""
    return [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")[:-1]]


def dump_process(pid: int, proc: Path = Path("/proc"), *, pyspy: str | None = None) -> ProcessDump:
    """Every thread of ``pid`` now; raises NoSuchProcess, NotPermitted, or
    UsageError (``pid`` is a thread of another process).  ``pyspy``: the
    py-spy for interpreters the walker cannot read (None: none)."""
    if pid <= 0:
        raise NoSuchProcess(f"no such process: {pid}")
    _check_process(proc, pid)
    _check_readable(proc, pid)
    threads, kernel_error = _tasks(proc, pid)
    dump = ProcessDump(pid, _cmdline(proc, pid), threads, kernel_error=kernel_error)
    reader = _reader(dump)
    if not dump.cmdline and reader != pid:  # the exited main thread's command line reads as empty
        dump.cmdline = _cmdline(proc, reader)
    _add_python(dump, proc, reader, pyspy)
    return dump


# ---- output -------------------------------------------------------------


def _py_json(t: PyThread) -> dict[str, Any]:
    return {
        "thread_id": t.thread_id,
        "native_thread_id": t.native_thread_id,
        "truncated": t.truncated,
        "frames": [{"function": f.function, "file": f.file, "line": f.line} for f in t.frames],
    }


def to_json(dump: ProcessDump) -> dict[str, Any]:
    """The ``--json`` document (schema in docs/dump.md)."""
    return {
        "schema": JSON_SCHEMA,
        "pid": dump.pid,
        "cmdline": dump.cmdline,
        "python": None if dump.python_version is None else {"version": dump.python_version,
                                                             "interpreter": dump.interpreter,
                                                             "read_by": dump.python_reader},
        "python_error": dump.python_error,
        "kernel_error": dump.kernel_error,
        "threads": [
            {
                "tid": t.tid,
                "name": t.name,
                "state": t.state,
                "state_name": t.state_name,
                "wchan": t.wchan,
                "kernel": t.kernel,
                "python": None if t.python is None else _py_json(t.python),
            }
            for t in dump.threads
        ],
        "unmatched_python_threads": [_py_json(t) for t in dump.unmatched],
        "unmatched_reason": dump.unmatched_reason,
    }


def _frames_text(lines: list[str], t: PyThread) -> None:
    lines.extend(f"    {f.text()}" for f in t.frames)
    if t.truncated:
        lines.append("    [truncated python stack]")


def format_text(dump: ProcessDump) -> str:
    """py-spy dump's layout: a process header, then each thread, innermost frame first."""
    lines = [f"Process {dump.pid}: {' '.join(dump.cmdline) or '[no command line]'}"]
    if dump.python_version is not None:
        by = ", frames read by py-spy" if dump.python_reader == "py-spy" else ""
        lines.append(f"Python {dump.python_version} ({dump.interpreter}{by})")
    if dump.python_error is not None:
        lines.append(f"no Python frames: {dump.python_error}")
    if dump.kernel_error is not None:
        lines.append(f"no kernel stacks: {dump.kernel_error}")
    for t in dump.threads:
        wchan = f", wchan {t.wchan}" if t.wchan else ""
        lines.append("")
        lines.append(f"Thread {t.tid} ({t.name}) {t.state} ({t.state_name}){wchan}")
        if t.python is not None:
            _frames_text(lines, t.python)
            if not t.python.frames:
                lines.append("    (no Python frame)")
        if t.kernel:
            lines.append("  kernel:")
            lines.extend(f"    {f}" for f in t.kernel)
    for p in dump.unmatched:
        ident = f"native id {p.native_thread_id}" if p.native_thread_id is not None else f"pthread 0x{p.thread_id:x}"
        lines.append("")
        lines.append(f"Python thread {ident} (no task matched)")
        _frames_text(lines, p)
    if dump.unmatched_reason:
        lines.append("")
        lines.append(f"unmatched Python threads: {dump.unmatched_reason}")
    # Thread names, command lines and code paths are any user's: one line each,
    # with nothing a terminal would act on.
    return "\n".join(printable(line) for line in lines) + "\n"
