"""Python frames the BPF program read, turned into named frames and spliced
into the native stack.

The sampler (``BpfSampler`` with ``options.python``) drives this:

* :meth:`PythonFrames.describe` when a process image is first sampled (the
  priming thread): is it a CPython we can walk?  Returns the packed
  ``struct flamed_pyproc`` to put in the program's ``pyprocs`` map, or asks to
  be called again (the interpreter is not mapped or not initialized yet), or
  refuses with a reason, which is logged once per (interpreter, reason) and
  counted.
* :meth:`PythonFrames.warm` when the program reports a Python stack new in
  its generation: names its code objects while the process still runs, so a
  process that exits before the drain keeps its Python frames.  The names
  are kept for that stack of that generation: the drain gives them, not
  names read again at the drain, when a code object of the stack may have
  been freed and its address taken by another (a module's top level, run
  once at import: the next code object made, a function of that module or
  of the program, would be named where the import was sampled).
* :meth:`PythonFrames.stack` at the drain: the raw frames as named frames,
  root first, and :func:`splice` to put them into the native stack.
"""

from __future__ import annotations

import itertools
import logging
import re
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from flamed.model import Stack
from flamed.sampling.pysource import refusal_code
from flamed.sampling.pystack import EVAL_FRAME, native_below_interpreter
from flamed.sampling.symbols import UNKNOWN, read_identity

log = logging.getLogger("flamed.python.bpf")

ENTRY_BIT = 1
#: flamed_pystack.flags (bpf/flamed.h)
PYSTACK_TRUNCATED = 1
PYSTACK_READ_FAULT = 2
#: guard[] holds each frame's code object guard (bpf/python.bpf.c flamed_pyguard)
PYSTACK_GUARDED = 4

TRUNCATED_FRAME = "[truncated python stack]"
READ_FAULT_FRAME = "[python stack: read fault]"

#: Python frames a raw frame list stands for: (code address with the entry bit, instruction position).
RawFrames = Sequence[tuple[int, int]]
#: Each frame's code object guard as the program read it when the stack was
#: new (0: not read), or None (read for no frame).
Guards = Sequence[int] | None


@dataclass
class PyProcStats:
    """Counters of the Python path, for metrics and status."""

    #: Processes whose frames the program walks, now.
    described: int = 0
    #: Refusals by reason (cumulative): ``unsupported_version``, ``invalid_layout``...
    refused: Counter[str] = field(default_factory=Counter)
    #: Processes given up on after retries (never initialized, exited).
    gave_up: int = 0
    #: Symbolization failures by reason (from the code symbolizers).
    symbolize_errors: Counter[str] = field(default_factory=Counter)
    stacks_named: int = 0


class _Proc:
    __slots__ = ("target", "symbolizer", "start_time", "version", "lock")

    def __init__(self, target: Any, symbolizer: Any, start_time: int, version: str) -> None:
        self.target = target
        self.symbolizer = symbolizer
        self.start_time = start_time
        self.version = version
        #: The priming thread (warm) and the drain both name with the symbolizer,
        #: whose cache and batch index are not thread-safe.
        self.lock = threading.Lock()


def _start_time(proc_root: Path, pid: int) -> int | None:
    ident = read_identity(pid, proc_root)
    return ident.start_time if ident is not None else None


class PythonFrames:
    """Per-process CPython targets and code symbolizers; see the module doc.

    ``probe`` and ``symbolizer_factory`` default to flamed.sampling.cpython's;
    tests pass others.  Thread-safe: the priming thread and the drain both
    call in.
    """

    #: How long a process that looks like CPython but is not ready (library
    #: not mapped, interpreter not initialized) is retried.
    RETRY_FOR_S = 10.0
    #: Validation failures in a row before a process is refused, spanning
    #: at least VALIDATE_SPAN_S: an interpreter starting up (imports, new
    #: threads) fails a walk from user space now and then for its first
    #: ~20 ms (14 of 2,200 probes of py_truth.py in its first 0.6 s; three in a
    #: row within 8 ms under load refused a good process in CI).
    VALIDATE_TRIES = 3
    VALIDATE_SPAN_S = 0.25
    #: Walks per probe before a failure counts: a program whose stack changes
    #: every microsecond (calls that do next to nothing) changes it under
    #: most walks of ~1 ms; measured on random recursion through 64 small
    #: functions, 20-45 % of single walks failed on a good layout.  A wrong
    #: layout fails every one.
    VALIDATE_WALKS = 4

    def __init__(
        self,
        *,
        proc_root: Path = Path("/proc"),
        probe: Callable[[int], Any] | None = None,
        symbolizer_factory: Callable[[int, Any], Any] | None = None,
        max_processes: int = 4096,
        on_refused: Callable[[int, str, str], None] | None = None,
    ) -> None:
        self._proc_root = proc_root
        if probe is None or symbolizer_factory is None:
            from flamed.sampling.cpython import process as cpy_process
            from flamed.sampling.cpython import symbolize as cpy_symbolize

            probe = probe or (lambda pid: cpy_process.probe(pid, proc_root=proc_root))
            symbolizer_factory = symbolizer_factory or (
                lambda _pid, target: cpy_symbolize.CodeSymbolizer.for_target(target, short_filenames=True)
            )
        self._probe = probe
        self._make_symbolizer = symbolizer_factory
        self._max = max_processes
        self._lock = threading.Lock()
        self._procs: OrderedDict[int, _Proc] = OrderedDict()
        self._pending: dict[int, float] = {}  # tgid -> first seen (monotonic), while not ready
        self._said: set[tuple[str, str]] = set()
        self._invalid: dict[int, tuple[int, float]] = {}  # tgid -> (failures in a row, first at)
        #: pid -> "bpf", "pending" or the code of the refusal ("not_python"...).
        self._verdicts: dict[int, str] = {}
        #: The program gives (instruction pointer - code address) where the
        #: frame holds a pointer; the symbolizers take the pointer.
        self._ptr_instr: dict[int, bool] = {}
        self._on_refused = on_refused
        self.stats = PyProcStats()
        #: Does the program know where the kernel keeps a task's fs base (from
        #: its BTF)?  CPython 3.8-3.10 threads are matched by it; without it
        #: they are refused (``no_fsbase``), so py-spy may take them.
        self.fsbase_known = True
        #: Names given by :meth:`warm`: (tgid, generation & 1, stack id) ->
        #: (that generation's epoch, names innermost first).
        self._warmed: dict[tuple[int, int, int], tuple[int, list[str]]] = {}
        #: Drains begun per generation parity: a name kept from before a
        #: generation's last drain belongs to an older generation.
        self._epochs = [0, 0]
        #: The drained generation's kept names: (tgid, stack id) -> names.
        self._drain_names: dict[tuple[int, int], list[str]] = {}

    # -- which processes ---------------------------------------------------
    def describe(self, tgid: int) -> bytes | None | bool:
        """``bytes``: the flamed_pyproc to install; ``None``: not ours (not
        CPython, or refused); ``True``: looks like CPython, not ready yet, call
        again soon."""
        try:
            res: Any = self._probe(tgid)
        except Exception as e:  # noqa: BLE001 -- a probe must never stop the sampler
            self._refuse(tgid, "probe_error", str(e), "")
            return None
        if res is None:
            self._verdicts[tgid] = "not_python"
            return None
        if not hasattr(res, "pack"):  # a refusal
            if getattr(res, "not_yet", False):
                return self._retry(tgid)
            code = str(getattr(res, "code", "") or refusal_code(str(getattr(res, "reason", res))))
            if code in ("not_python", "gone"):
                self._pending.pop(tgid, None)
                self._verdicts[tgid] = code
                return None
            self._refuse(tgid, code, str(getattr(res, "reason", res)), str(getattr(res, "interpreter", "")))
            return None
        target = res
        check = getattr(target, "validate", None) or target.state
        for _ in range(self.VALIDATE_WALKS):
            state = check()
            st_kind = getattr(state, "kind", state)
            if st_kind in ("ready", "not_yet"):
                break
        if st_kind == "not_yet":
            return self._retry(tgid)
        if st_kind != "ready":
            # A walk from user space races the running threads: a frame
            # freed under it reads as garbage once in a while.  Refuse only
            # a layout that fails again.
            n, first = self._invalid.get(tgid, (0, time.monotonic()))
            n += 1
            self._invalid[tgid] = (n, first)
            if n < self.VALIDATE_TRIES or time.monotonic() - first < self.VALIDATE_SPAN_S:
                return self._retry(tgid)
            self._invalid.pop(tgid, None)
            self._refuse(tgid, "invalid_layout", str(getattr(state, "reason", state)), str(target.interpreter))
            return None
        self._invalid.pop(tgid, None)
        layout = getattr(target, "layout", None)
        if not self.fsbase_known and layout is not None and getattr(layout, "tstate_native_thread_id", 0) is None:
            self._refuse(tgid, "no_fsbase", "its threads are matched by fs base, and the kernel's BTF "
                         "(/sys/kernel/btf/vmlinux) gave no task_struct fs base offset",
                         str(getattr(target, "interpreter", "")))
            return None
        self._pending.pop(tgid, None)
        self._verdicts[tgid] = "bpf"
        # The probe read it already; a test's stand-in target may not say.
        start = getattr(target, "start_time", None) or _start_time(self._proc_root, tgid) or 0
        sym = self._make_symbolizer(tgid, target)
        version = getattr(target, "version", "")
        if isinstance(version, tuple):
            version = ".".join(str(v) for v in version)
        self._ptr_instr[tgid] = getattr(getattr(target, "layout", None), "instr_size", 4) == 8
        with self._lock:
            self._procs[tgid] = _Proc(target, sym, start, str(version))
            self._procs.move_to_end(tgid)
            while len(self._procs) > self._max:
                self._procs.popitem(last=False)
            self.stats.described = len(self._procs)
        packed: bytes = target.pack()
        return packed

    def thread_states(self, tgid: int) -> dict[int, int]:
        """Host tid -> thread state address of a described process's threads
        ({} when not known; see ``Target.thread_states``)."""
        with self._lock:
            p = self._procs.get(tgid)
        fn = getattr(p.target, "thread_states", None) if p is not None else None
        if fn is None:
            return {}
        try:
            out: dict[int, int] = fn()
            return out
        except Exception as e:  # noqa: BLE001 -- only a head start for the program's search
            log.debug("thread states of %d: %s", tgid, e)
            return {}

    def _retry(self, tgid: int) -> bool | None:
        first = self._pending.setdefault(tgid, time.monotonic())
        if time.monotonic() - first > self.RETRY_FOR_S:
            self._pending.pop(tgid, None)
            self.stats.gave_up += 1
            self._verdicts[tgid] = "never_ready"
            return None
        self._verdicts[tgid] = "pending"
        return True

    def verdict(self, tgid: int) -> str | None:
        """What :meth:`describe` last decided for ``tgid`` (None: never asked);
        :mod:`flamed.sampling.pysource` makes it a choice of source."""
        return self._verdicts.get(tgid)

    def _refuse(self, tgid: int, code: str, reason: str, interpreter: str) -> None:
        self._pending.pop(tgid, None)
        self._verdicts[tgid] = code
        self.stats.refused[code] += 1
        key = (interpreter, code)
        if key not in self._said:
            self._said.add(key)
            log.info("Python frames of pid %d (%s) are not read in BPF (its native and kernel stacks are): %s",
                     tgid, interpreter or "?", reason)
        if self._on_refused is not None:
            self._on_refused(tgid, code, reason)

    def has(self, tgid: int) -> bool:
        with self._lock:
            return tgid in self._procs

    def forget(self, tgid: int) -> None:
        """The process exited (or exec'd): its code objects mean nothing now.
        Kept until the caller forgets it, so a drain after the exit still
        names what was warmed."""
        with self._lock:
            self._procs.pop(tgid, None)
            self.stats.described = len(self._procs)
        self._pending.pop(tgid, None)
        self._invalid.pop(tgid, None)
        self._ptr_instr.pop(tgid, None)
        self._verdicts.pop(tgid, None)

    def gone(self) -> list[int]:
        """Described processes that exited (or whose pid is another process
        now): nobody may have said so (the sampler describes every CPython on
        the host, the watcher follows only those it was asked to)."""
        with self._lock:
            procs = [(t, p.start_time) for t, p in self._procs.items()]
        return [t for t, start in procs if _start_time(self._proc_root, t) != start]

    def described(self) -> dict[int, str]:
        with self._lock:
            return {t: p.version for t, p in self._procs.items()}

    # -- naming ------------------------------------------------------------
    #: Stacks whose warm names are kept at once (beyond: named at the drain);
    #: the program holds 2,048 Python stacks per generation by default.
    MAX_WARMED = 1 << 14

    def warm_token(self, gen: int) -> int:
        """Taken before reading a stack of generation ``gen`` from the program,
        for :meth:`warm`: a drain of that generation begun in between makes
        the names belong to a generation already drained."""
        with self._lock:
            return self._epochs[gen & 1]

    def warm(self, tgid: int, frames: RawFrames, *, gen: int | None = None, sid: int | None = None,
             token: int | None = None, guards: Guards = None) -> None:
        """Name the code objects of a new stack now, while the process runs;
        with its generation, stack id and :meth:`warm_token`, keep the names
        for the drain of that generation.  ``guards``: the frames' guards
        (:func:`parse_pystack`): a frame whose code object is no longer the
        sampled one is named ``[stale python code ...]``."""
        with self._lock:
            p = self._procs.get(tgid)
        if p is None:
            return
        try:
            fresh = getattr(p.symbolizer, "symbolize_fresh", None) or p.symbolizer.symbolize
            with p.lock:
                names = fresh(self._absolute(tgid, frames)) if guards is None else \
                    fresh(self._absolute(tgid, frames), guards=guards)
        except Exception as e:  # noqa: BLE001
            log.debug("warming Python frames of %d: %s", tgid, e)
            return
        if gen is None or sid is None or token is None or not isinstance(names, list) or len(names) != len(frames):
            return
        with self._lock:
            if len(self._warmed) < self.MAX_WARMED:
                self._warmed[(tgid, gen & 1, sid)] = (token, names)

    def _absolute(self, tgid: int, frames: RawFrames) -> RawFrames:
        if not self._ptr_instr.get(tgid):
            return frames
        return [(c, (c & ~ENTRY_BIT) + i) for c, i in frames]

    def begin_drain(self, gen: int | None = None) -> None:
        """A drain begins (of generation ``gen``, whose stacks the program
        reported new were named by :meth:`warm`: those names are used)."""
        with self._lock:
            procs = list(self._procs.values())
            if gen is not None:
                parity = gen & 1
                epoch = self._epochs[parity]
                self._epochs[parity] = epoch + 1
                keep = {(t, s): names for (t, g, s), (e, names) in self._warmed.items() if g == parity and e == epoch}
                self._warmed = {k: v for k, v in self._warmed.items() if k[1] != parity}
                self._drain_names = keep
        for p in procs:
            begin = getattr(p.symbolizer, "begin_batch", None)
            if begin is not None:
                with p.lock:
                    begin()

    def stack(self, tgid: int, frames: RawFrames, flags: int, sid: int | None = None,
              guards: Guards = None) -> list[Stack]:
        """Named Python frames grouped by run of the evaluation loop, root first
        (the outermost run first, each run root first).  ``sid``: the stack's
        id in the drained generation, whose names :meth:`warm` kept;
        ``guards`` as for :meth:`warm`."""
        with self._lock:
            p = self._procs.get(tgid)
        kept = self._drain_names.get((tgid, sid)) if sid is not None else None
        if kept is not None and len(kept) == len(frames):
            names = kept
        elif p is None:
            names = [f"[python code 0x{c & ~ENTRY_BIT:x}]" for c, _ in frames]
        else:
            try:
                with p.lock:
                    raw = self._absolute(tgid, frames)
                    names = list(p.symbolizer.symbolize(raw) if guards is None else
                                 p.symbolizer.symbolize(raw, guards=guards))
            except Exception as e:  # noqa: BLE001
                log.debug("naming Python frames of %d: %s", tgid, e)
                names = [f"[python code 0x{c & ~ENTRY_BIT:x}]" for c, _ in frames]
        self.stats.stacks_named += 1
        return runs_root_first(frames, names, flags)

    def symbolizer_stats(self) -> Counter[str]:
        total: Counter[str] = Counter()
        with self._lock:
            procs = list(self._procs.values())
        for p in procs:
            st = getattr(p.symbolizer, "stats", None)
            if isinstance(st, dict):
                total.update({k: int(v) for k, v in st.items()})
        return total


def runs_root_first(frames: RawFrames, names: Sequence[str], flags: int) -> list[Stack]:
    """The named frames of one Python stack grouped by run of the evaluation
    loop, root first (the outermost run first, each run root first); a run
    ends (outward) at a frame with the entry bit.  A truncated stack or one
    whose walk faulted gets its marker frame as the outermost run."""
    n = len(names)
    rev = names[::-1]
    # Root-first positions where a run begins: the root, and each entry frame
    # (innermost-first index i is root-first position n - 1 - i: ascending
    # when i descends).  Called once per Python stack of every drain.
    out: list[Stack] = []
    if n:
        start = 0
        for i in range(min(n, len(frames)) - 1, -1, -1):
            if frames[i][0] & ENTRY_BIT:
                at = n - 1 - i
                if at > start:
                    out.append(tuple(rev[start:at]))
                    start = at
        out.append(tuple(rev[start:]))
    if flags & PYSTACK_TRUNCATED:
        out.insert(0, (TRUNCATED_FRAME,))
    elif flags & PYSTACK_READ_FAULT:
        out.insert(0, (READ_FAULT_FRAME,))
    return out


#: Frame -> 0 (not the interpreter's), 1 (an evaluation entry point: what
#: native_below_interpreter cuts below), 2 (an evaluation-loop frame, which a
#: run of Python frames replaces), 3 (a perf trampoline of 3.12+ run with -X
#: perf: its ``py::function:file`` frame, named from the process's perf map,
#: and ``py_trampoline_evaluator``, which calls it; left out where Python
#: frames are put in, which name the same function with its line).
#: Native stacks of Python processes are
#: nearly all distinct (the leaf is wherever the interpreter was), their
#: frames are not: one regex match per frame name, not per frame seen.
_FRAME_KIND: dict[str, int] = {}
_FRAME_KIND_MAX = 1 << 16


def _frame_kinds(user_stack: Stack) -> list[int]:
    try:
        return list(map(_FRAME_KIND.__getitem__, user_stack))
    except KeyError:
        pass
    if len(_FRAME_KIND) > _FRAME_KIND_MAX:
        _FRAME_KIND.clear()
    out = []
    for f in user_stack:
        k = _FRAME_KIND.get(f)
        if k is None:
            if f.startswith("py::") or f == "py_trampoline_evaluator":
                k = 3
            else:
                k = (2 if f.startswith("_PyEval_EvalFrame") else 1) if EVAL_FRAME.match(f) else 0
            _FRAME_KIND[f] = k
        out.append(k)
    return out


#: A stack in some encoding: a tuple of frames, or the bytes of its frame
#: numbers in a table (flamed/sampling/packed.py); both concatenate with ``+``.
P = TypeVar("P", Stack, bytes)


@dataclass(frozen=True, slots=True)
class SpliceParts(Generic[P]):
    """A native stack cut where Python frames go (:func:`splice`), each part
    encoded once, so that each Python stack is put in by joining parts."""

    #: The native frames between evaluation-loop frames, root first: one more
    #: than there are such frames.
    between: list[P]
    #: What stays below Python frames put on top (when the runs do not match
    #: the evaluation-loop frames one to one).
    below: P
    #: A greenlet's stack: the parts of the evaluation-loop frames from the
    #: innermost greenlet entry frame on (leafward), the first of them holding
    #: every native frame up to there, the outer evaluation-loop frames kept
    #: as they are; None without such a frame.
    greenlet: list[P] | None = None
    #: The native walk stopped short (its root frame is a ``[truncated: …]``
    #: marker): the outermost evaluation-loop frames may be missing from it.
    cut: bool = False
    #: That marker, when ``below`` would begin with it: put at the root, above
    #: Python frames put on top, where every cut stack has it.
    mark: P | None = None


def splice_parts(user_stack: Stack, encode: Callable[[Stack], P]) -> SpliceParts[P]:
    """``user_stack``'s parts for :func:`splice_into`, each ``encode``d."""
    kinds = _frame_kinds(user_stack)
    # A perf trampoline without a perf map (3.13's -X perf_jit writes a jitdump
    # instead) is a bare "[unknown]" (anonymous code) calling an evaluation loop.
    if UNKNOWN in user_stack:  # (a C-level scan: most stacks have none)
        for i in range(1, len(kinds)):
            if kinds[i] == 2 and kinds[i - 1] == 0 and user_stack[i - 1] == UNKNOWN:
                kinds[i - 1] = 3
    if 3 in kinds:
        user_stack = tuple(f for f, k in zip(user_stack, kinds) if k != 3)
        kinds = [k for k in kinds if k != 3]
    between: list[P] = []
    prev = 0
    for i, k in enumerate(kinds):
        if k == 2:
            between.append(encode(user_stack[prev:i]))
            prev = i + 1
    between.append(encode(user_stack[prev:]))
    if any(kinds):
        below = user_stack[max(itertools.compress(range(len(kinds)), kinds)) + 1:]
    else:
        below = native_below_interpreter(user_stack)
    greenlet: list[P] | None = None
    entry = _innermost_greenlet_entry(user_stack)
    if entry >= 0:
        loops = [i for i in range(entry + 1, len(kinds)) if kinds[i] == 2]
        if loops and len(loops) < len(between) - 1:
            greenlet = []
            prev = 0
            for i in loops:
                greenlet.append(encode(user_stack[prev:i]))
                prev = i + 1
            greenlet.append(encode(user_stack[prev:]))
    cut = bool(user_stack) and user_stack[0].startswith("[truncated")
    mark = None
    if cut and below and below[0] == user_stack[0]:
        mark, below = encode(below[:1]), below[1:]
    return SpliceParts(between, encode(below), greenlet, cut, mark)


#: The frame a greenlet's own C stack begins with (greenlet 2+ in C++,
#: greenlet 0.4-1.x in C): the thread state's Python frames, which greenlet
#: swaps at each switch, are this greenlet's only, while the native stack
#: still holds, above that frame, the evaluation loops of the greenlet that
#: started it (gevent's hub, the main greenlet).
_GREENLET_ENTRY = re.compile(r"(?:^|::)(?:inner_bootstrap|g_initialstub)\b")


def _innermost_greenlet_entry(user_stack: Stack) -> int:
    for i in range(len(user_stack) - 1, -1, -1):
        f = user_stack[i]
        if ("bootstrap" in f or "initialstub" in f) and _GREENLET_ENTRY.search(f):
            return i
    return -1


def splice_into(parts: SpliceParts[P], runs: Sequence[P], join: Callable[[list[P]], P]) -> P:
    """The native stack of ``parts`` with the Python ``runs`` put in (see :func:`splice`); ``runs`` not empty."""
    between = parts.between
    if len(between) != len(runs) + 1 and parts.greenlet is not None and len(parts.greenlet) == len(runs) + 1:
        between = parts.greenlet
    if len(between) == len(runs) + 1:
        pieces = [between[0]]
        for run, after in zip(runs, between[1:]):
            pieces.append(run)
            pieces.append(after)
        return join(pieces)
    if parts.cut and 1 < len(between) < len(runs) + 1:
        # The walk stopped before the outer loops (depth limit, no table):
        # the loops it found ran the innermost runs; the outer runs go on
        # top, above the marker of the cut.
        outer = len(runs) + 1 - len(between)
        pieces = list(runs[:outer])
        pieces.append(between[0])
        for run, after in zip(runs[outer:], between[1:]):
            pieces.append(run)
            pieces.append(after)
        return join(pieces)
    if parts.mark is not None:
        marked: list[P] = [parts.mark]
        marked.extend(runs)
        marked.append(parts.below)
        return join(marked)
    return join(list(runs) + [parts.below])


def join_frames(parts: list[Stack]) -> Stack:
    """Stacks (tuples of frames) end to end."""
    return tuple(itertools.chain.from_iterable(parts))


def unencoded(stack: Stack) -> Stack:
    """A stack as its own encoding (the tuple of its frames)."""
    return stack


def splice(user_stack: Stack, runs: Sequence[Stack]) -> Stack:
    """One native stack (root first) with Python frames put where the
    interpreter ran them.

    Where the native stack shows one evaluation-loop frame per run, each is
    replaced by its run's Python frames (so a C extension called from Python,
    and Python called back from C, read in order).  In a greenlet (the
    native stack has a greenlet entry frame, and the runs match the
    evaluation-loop frames leafward of the innermost one) the runs replace
    those, and the outer evaluation-loop frames, which ran another
    greenlet's Python frames that the thread state no longer holds, stay as
    they are.  A native stack cut short (its root a ``[truncated: …]``
    marker) with fewer such frames than runs has its frames replaced by the
    innermost runs, and the outer runs go on top, above the marker.
    Otherwise (the native
    walk did not reach the interpreter's frames: no frame pointers) the
    Python frames go on top and the native frames below the innermost
    evaluation frame, or the whole native stack, below them
    (:func:`~flamed.sampling.pystack.native_below_interpreter`); a cut
    stack's marker stays at the root, above the Python frames, so that a
    Python path reads the same under every cut stack.
    The frames of CPython's perf trampolines (``-X perf``: ``py::…`` and
    ``py_trampoline_evaluator``; ``-X perf_jit``: a bare ``[unknown]``
    calling an evaluation loop) are left out: the Python frames name them.
    """
    if not runs:
        return user_stack
    return splice_into(splice_parts(user_stack, unencoded), runs, join_frames)


#: FLAMED_PY_ID_NO_THREAD of bpf/flamed.h: the Python stack id of a sample of a
#: described process whose thread state the program did not find.
PY_ID_NO_THREAD = 0xFFFFFFFFFFFFFFF1
#: What such a sample shows where its Python frames would be: a native thread
#: of a Python process, or a thread of a long list not reached yet.
NO_THREAD_FRAME = "[python: thread not found]"

#: struct flamed_pystack header: len, flags.
PYSTACK_HEAD = struct.Struct("<II")


def parse_pystack(raw: bytes | memoryview, depth: int) -> tuple[list[tuple[int, int]], int, tuple[int, ...] | None]:
    """A ``struct flamed_pystack`` value: (frames innermost first, flags,
    guards innermost first or None).

    Whole, or cut to the frames it holds (``mapread.cut_pystacks``): the
    instruction offsets follow the codes, and the guards the instruction
    offsets, of as many frames as its length gives.  The guards are None
    unless the program read them (``PYSTACK_GUARDED``); a 0 among them is a
    code object the program could not read."""
    n, flags = PYSTACK_HEAD.unpack_from(raw, 0)
    depth = min(depth, (len(raw) - 8) // 16)
    n = min(n, depth)
    layout = _PYSTACK_LAYOUTS.get(n)
    if layout is None:
        layout = _PYSTACK_LAYOUTS[n] = (struct.Struct(f"<{n}Q"), struct.Struct(f"<{n}I"))
    codes = layout[0].unpack_from(raw, 8)
    instrs = layout[1].unpack_from(raw, 8 + 8 * depth)
    guards = layout[1].unpack_from(raw, 8 + 12 * depth) if flags & PYSTACK_GUARDED else None
    return list(zip(codes, instrs)), flags & ~PYSTACK_GUARDED, guards


#: The Structs of parse_pystack by frame count (one per depth seen, at most
#: python_depth + 1 of them).
_PYSTACK_LAYOUTS: dict[int, tuple[struct.Struct, struct.Struct]] = {}
