"""The BPF stack sampler: bpf/profile.bpf.c loaded with bcc, drained into Windows.

:class:`BpfSampler` implements :class:`flamed.sampling.contract.Sampler`.  The program
counts ``{tgid, tid, comm, kernel stack id, user stack id}`` in the kernel, in
two generations of maps; :meth:`BpfSampler.drain` flips the generation, waits
until no program still writes the old one, reads and clears it, and returns it
symbolized as a :class:`~flamed.sampling.contract.Window`.  How and why is in
docs/bpf.md.

Everything that can degrade a sample is counted (``Window.lost``; reasons in
:data:`LOST_REASONS`) and shown as a placeholder frame:

* ``[lost stack: EEXIST]`` / ``[lost stack: ENOMEM]`` (``_[k]`` on the kernel
  side): no stack id; raise ``stack_storage_size``.
* ``[missing user stack]`` / ``[missing kernel stack]_[k]``: the task was
  interrupted on that side but no frame could be read.

Only ``map_full`` drops a sample (raise ``max_entries``); a watched task's
sample that finds the ring buffer full (``ringbuf_full``) is counted instead
of sent, so for every window::

    window.samples == sum(window.counts.values()) + len(window.events) + window.lost["map_full"]
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import logging
import os
import re
import select
import shlex
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from flamed.sampling.bpfload import adopt, close_bpf, find_bpf_dir
from flamed.errors import CapabilityError, ConfigError, FlamedError
from flamed.model import EMPTY_STACK_FRAME, KERNEL_SUFFIX, Stack
from flamed.sampling.contract import CountKey, SampleEvent, Window
from flamed.sampling.kallsyms import Kallsyms
from flamed.sampling.symbols import BccResolver, ProcessIdentity, Resolver, Symbolizer, read_identity
from flamed.sampling.pyframes import PythonFrames, parse_pystack, splice
from flamed.sampling.unwind import is_outermost, parse_ustack, truncated_frame
from flamed.sampling.unwind.tables import TableCache, Unwinder, UnwindStats

log = logging.getLogger("flamed.bpf")

MAX_FREQUENCY = 999
#: perf_event_open's type/config for the two events the sampler can use.
PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES = 0, 0
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK = 1, 0
EVENTS = {"cycles": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES), "cpu-clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK)}

#: Window.lost keys, in this order, always all present.
LOST_REASONS = (
    "map_full",
    "ringbuf_full",
    "kernel_stack_eexist",
    "kernel_stack_enomem",
    "kernel_stack_error",
    "kernel_stack_missing",
    "user_stack_eexist",
    "user_stack_enomem",
    "user_stack_error",
    "user_stack_missing",
    "stack_read_failed",
)
#: The reasons that drop a sample (the others degrade its stack or its path).
DROPPING_REASONS = ("map_full",)

_STAT_TO_REASON = {
    "MAP_FULL": "map_full",
    "RINGBUF_FULL": "ringbuf_full",
    "KSTACK_EEXIST": "kernel_stack_eexist",
    "KSTACK_ENOMEM": "kernel_stack_enomem",
    "KSTACK_ERROR": "kernel_stack_error",
    "KSTACK_MISSING": "kernel_stack_missing",
    "USTACK_EEXIST": "user_stack_eexist",
    "USTACK_ENOMEM": "user_stack_enomem",
    "USTACK_ERROR": "user_stack_error",
    "USTACK_MISSING": "user_stack_missing",
}

#: struct flamed_py_new of bpf/python.bpf.c: tgid, generation, stack id.
_PY_NEW = struct.Struct("<IIQ")
#: FLAMED_STAT_PY_* counters, by the names _take_stats gives them.
_PY_STATS = ("PY_SAMPLES", "PY_STACKS", "PY_NO_THREAD", "PY_NO_FRAME", "PY_READ_FAULT", "PY_TRUNCATED",
             "PY_STACKS_FULL", "PY_NS")
#: FLAMED_STAT_UW_* counters, by the names _take_stats gives them.
_UW_STATS = ("UW_SAMPLES", "UW_COMPLETE", "UW_NO_TABLE", "UW_UNSUPPORTED", "UW_DEPTH", "UW_READ_FAULT",
             "UW_STACKS_FULL", "UW_FP_FRAMES", "UW_NS", "UW_TAIL_FAILED")
#: A sample whose unwound stack id names no stack the drain could read.
_UW_LOST_FRAME = "[lost stack: unwound]"
#: A sample whose Python stack id names no stack the drain could read.
_PY_LOST_FRAME = "[lost python stack]"

# struct flamed_key and struct flamed_event of bpf/flamed.h.
_KEY = struct.Struct("<IIii16sQQ")
_EVENT = struct.Struct("<QIIIIii16sQ")
_COMM_LEN = 16

_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39


# ---------------------------------------------------------------------------
# Options and the program text


def default_bpf_dir() -> Path:
    """Where bpf/profile.bpf.c is: $FLAMED_BPF_DIR, the source checkout, or the
    installed copy (<prefix>/share/flamed/bpf, /usr/share/flamed/bpf)."""
    return find_bpf_dir("profile.bpf.c")


@dataclass(frozen=True)
class BpfSamplerOptions:
    """Everything the BPF sampler can be told.  Defaults are the daemon's."""

    #: Samples per second per CPU, 1..999.
    frequency: int = 19
    #: ``auto`` (CPU cycles, falling back to cpu-clock when the hardware event
    #: is missing, as in most VMs), ``cycles`` or ``cpu-clock``.
    event: str = "auto"
    #: CPUs to sample; ``None``: every online CPU, including CPUs that come
    #: online later (checked at each drain).
    cpus: tuple[int, ...] | None = None
    #: Also count the idle task (pid 0).
    include_idle: bool = False
    #: Kernel-side filters; ``None`` disables one.  Within a filter any entry
    #: matches; all enabled filters must match.  Watched processes are sampled
    #: whatever the filters say.
    pids: frozenset[int] | None = None  # process ids (tgid)
    tids: frozenset[int] | None = None  # thread ids
    cgroups: frozenset[int | str] | None = None  # cgroup v2 ids or paths (/sys/fs/cgroup/...)
    comms: frozenset[str] | None = None  # exact comm (first 15 bytes)
    #: Stack ids per generation (the stack map is preallocated: about
    #: 8 * stack_depth + 32 bytes each, twice).  Raise on ``*_stack_eexist``.
    stack_storage_size: int = 16384
    #: Frames kept per stack, <= 127.
    stack_depth: int = 127
    #: Count-map entries per generation (distinct task/stack keys per
    #: drain interval).  Raise on ``map_full``.
    max_entries: int = 65536
    #: Ring buffer for watched processes, in pages (a power of 2).  Raise on
    #: ``ringbuf_full``, or call :meth:`BpfSampler.poll_events` more often.
    ringbuf_pages: int = 1024
    max_watched: int = 1024
    #: Entries of each filter map.
    filter_max: int = 1024
    #: Directory holding profile.bpf.c and flamed.h (``None``: :func:`default_bpf_dir`).
    bpf_dir: Path | None = None
    #: How long a drain waits for a CPU still running the program on the old
    #: generation before it reads anyway (and counts ``quiesce_timeouts``).
    quiesce_timeout: float = 1.0
    #: Read /proc/PID/maps of each process image (tgid + comm) as soon as it
    #: is first sampled (the program reports it through a perf buffer), so
    #: processes that exit before the next drain still get their user frames
    #: named.  Off: maps are read at the drain, for the processes alive then.
    prime: bool = True
    #: Process images remembered as already reported (LRU).
    seen_max: int = 16384
    #: Per-CPU perf buffer of those reports, in pages (a power of 2).
    prime_pages: int = 8
    #: At most this many /proc reads per second for priming (~90 us of CPU
    #: each, so the default bounds it near 2 % of a core on a host that
    #: starts processes faster); reports beyond it are skipped and counted.
    prime_rate: int = 200
    #: Read the Python frames of CPython processes in the BPF program
    #: (bpf/python.bpf.c): each process image is probed when first sampled
    #: (needs ``prime``), and its Python stack goes with every sample.
    python: bool = False
    #: Python frames kept per stack (a power of 2, 8..512); deeper stacks
    #: lose their outermost frames and end in ``[truncated python stack]``.
    python_depth: int = 128
    #: Distinct Python stacks per generation (preallocated: about
    #: 12 * python_depth + 8 bytes each, twice).
    python_stack_entries: int = 2048
    #: CPython processes described to the program at once.
    python_max_procs: int = 4096
    #: Time every walk in the program (two clock reads a sample) and report
    #: the sum in ``SamplerStats.python_total["PY_NS"]``: for benchmarks.
    python_timing: bool = False
    #: Unwind user stacks in the program from tables built out of each
    #: binary's .eh_frame (bpf/unwind.bpf.c), so code built without frame
    #: pointers keeps its callers; a stack cut short ends in a
    #: ``[truncated: REASON]`` frame.  Needs ``prime`` (processes are
    #: described when first sampled).  Off: frame-pointer stacks.
    unwind: bool = False
    #: Frames kept per unwound stack, 8..127.
    unwind_depth: int = 64
    #: Table rows of all binaries together (8 bytes each, preallocated): the
    #: bound of the tables' memory.  libc takes ~28 k rows, CPython ~65 k,
    #: libLLVM ~980 k.  Binaries beyond it keep frame-pointer stacks.
    unwind_rows: int = 2_097_152
    #: Mappings with a table per process (a power of 2, 8..256); beyond it
    #: the smallest binaries of the process use frame pointers.
    unwind_maps: int = 64
    #: Processes described at once (about 32 * unwind_maps bytes each).
    unwind_max_procs: int = 4096
    #: Distinct unwound stacks per generation (preallocated: about
    #: 8 * unwind_depth + 8 bytes each, twice).
    unwind_stack_entries: int = 8192
    #: Where built tables are kept by build id (``None``: not kept, rebuilt
    #: at each start).
    unwind_cache_dir: Path | None = None
    #: Time every walk in the program and report the sum in
    #: ``SamplerStats.unwind_total["UW_NS"]``: for benchmarks.
    unwind_timing: bool = False

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""

        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"sampler option {name}={getattr(self, name)!r}: {why}")

        if not 1 <= self.frequency <= MAX_FREQUENCY:
            raise bad("frequency", f"must be 1..{MAX_FREQUENCY} Hz")
        if self.event not in ("auto", *EVENTS):
            raise bad("event", "must be auto, cycles or cpu-clock")
        if self.cpus is not None and (not self.cpus or any(c < 0 for c in self.cpus)):
            raise bad("cpus", "must be a non-empty list of CPU numbers, or unset for all")
        if not 1 <= self.stack_depth <= 127:
            raise bad("stack_depth", "must be 1..127 frames")
        for name in ("stack_storage_size", "max_entries", "max_watched", "filter_max", "seen_max"):
            if not 1 <= getattr(self, name) <= 1 << 24:
                raise bad(name, "must be 1..16777216")
        p = self.ringbuf_pages
        if p < 1 or p & (p - 1) or p > 1 << 18:
            raise bad("ringbuf_pages", "must be a power of 2, at most 262144")
        for name in ("pids", "tids", "cgroups", "comms"):
            v = getattr(self, name)
            if v is not None and len(v) > self.filter_max:
                raise bad(name, f"more entries than filter_max={self.filter_max}")
        for c in self.comms or ():
            if not c or len(c.encode()) > _COMM_LEN - 1:
                raise bad("comms", f"{c!r}: a comm is 1..15 bytes")
        if self.quiesce_timeout <= 0:
            raise bad("quiesce_timeout", "must be > 0 seconds")
        p = self.prime_pages
        if p < 1 or p & (p - 1) or p > 1024:
            raise bad("prime_pages", "must be a power of 2, at most 1024")
        if not 1 <= self.prime_rate <= 1_000_000:
            raise bad("prime_rate", "must be 1..1000000 reads per second")
        d = self.python_depth
        if d < 8 or d > 512 or d & (d - 1):
            raise bad("python_depth", "must be a power of 2, 8..512 frames")
        for name in ("python_stack_entries", "python_max_procs"):
            if not 1 <= getattr(self, name) <= 1 << 20:
                raise bad(name, "must be 1..1048576")
        if self.python and not self.prime:
            raise bad("python", "needs prime (processes are probed when first sampled)")
        if not 8 <= self.unwind_depth <= 127:
            raise bad("unwind_depth", "must be 8..127 frames")
        if not 1024 <= self.unwind_rows <= 1 << 26:
            raise bad("unwind_rows", "must be 1024..67108864 rows")
        m = self.unwind_maps
        if m < 8 or m > 256 or m & (m - 1):
            raise bad("unwind_maps", "must be a power of 2, 8..256")
        for name in ("unwind_max_procs", "unwind_stack_entries"):
            if not 1 <= getattr(self, name) <= 1 << 20:
                raise bad(name, "must be 1..1048576")
        if self.unwind and not self.prime:
            raise bad("unwind", "needs prime (processes are described when first sampled)")


@dataclass(frozen=True)
class BpfProgram:
    """The exact source and compiler flags that :class:`BpfSampler` loads."""

    path: Path
    text: str
    cflags: tuple[str, ...]
    header_path: Path
    header: str
    #: Files appended to ``path`` into the one text bcc compiles (bcc
    #: rewrites map calls only in that text, not in included files).
    parts: tuple[tuple[Path, str], ...] = ()

    @property
    def source(self) -> str:
        """The text bcc compiles."""
        return self.text + "".join(f"\n// ---- {p.name} ----\n{t}" for p, t in self.parts)

    def render(self) -> str:
        """What ``flamed daemon --print-bpf`` prints: the flags, the shared
        header, then the program (whose ``#include "flamed.h"`` the header's
        include guard then makes a no-op, so the output compiles as is)."""
        flags = " ".join(shlex.quote(c) for c in self.cflags)
        return (
            f"// flamed BPF program, as bcc would load it\n// bcc cflags: {flags}\n"
            f"// ---- {self.header_path} ----\n{self.header}"
            f"// ---- {self.path} ----\n{self.source}"
        )


def bpf_program(options: BpfSamplerOptions = BpfSamplerOptions(), *, fsbase_offset: int = -1) -> BpfProgram:
    """The program and -D flags the options select (reads the files).

    ``fsbase_offset``: where the running kernel keeps a task's fs base in
    ``task_struct`` (from its BTF, :func:`task_fsbase_offset`), for matching
    the threads of CPython 3.8-3.10; -1: unknown.
    """
    d = options.bpf_dir or default_bpf_dir()
    path = d / "profile.bpf.c"
    header = d / "flamed.h"
    parts: list[tuple[Path, str]] = []
    try:
        text = path.read_text()
        header_text = header.read_text()
        if options.python:
            pp = d / "python.bpf.c"
            parts.append((pp, pp.read_text()))
        if options.unwind:
            up = d / "unwind.bpf.c"
            parts.append((up, up.read_text()))
    except OSError as e:
        raise CapabilityError(
            f"BPF source {e.filename} not readable ({e.strerror}); set FLAMED_BPF_DIR to the directory "
            "holding profile.bpf.c and flamed.h"
        ) from None
    defines = {
        "FLAMED_STACK_ENTRIES": options.stack_storage_size,
        "FLAMED_STACK_DEPTH": options.stack_depth,
        "FLAMED_MAX_ENTRIES": options.max_entries,
        "FLAMED_RINGBUF_PAGES": options.ringbuf_pages,
        "FLAMED_MAX_WATCHED": options.max_watched,
        "FLAMED_FILTER_MAX": options.filter_max,
        "FLAMED_INCLUDE_IDLE": int(options.include_idle),
        "FLAMED_FILTER_PIDS": int(options.pids is not None),
        "FLAMED_FILTER_TIDS": int(options.tids is not None),
        "FLAMED_FILTER_CGROUPS": int(options.cgroups is not None),
        "FLAMED_FILTER_COMMS": int(options.comms is not None),
        "FLAMED_PRIME": int(options.prime),
        "FLAMED_SEEN_MAX": options.seen_max,
        "FLAMED_PYTHON": int(options.python),
        "FLAMED_UNWIND": int(options.unwind),
    }
    if options.python:
        defines.update({
            "FLAMED_PY_DEPTH": options.python_depth,
            "FLAMED_PY_STACK_ENTRIES": options.python_stack_entries,
            "FLAMED_PY_MAX_PROCS": options.python_max_procs,
            "FLAMED_TASK_FSBASE_OFF": fsbase_offset,
            "FLAMED_PY_TIMING": int(options.python_timing),
        })
    if options.unwind:
        defines.update({
            "FLAMED_UW_DEPTH": options.unwind_depth,
            "FLAMED_UW_ROWS": options.unwind_rows,
            "FLAMED_UW_ROW_STEPS": options.unwind_rows.bit_length() + 1,
            "FLAMED_UW_MAPS": options.unwind_maps,
            "FLAMED_UW_MAX_PROCS": options.unwind_max_procs,
            "FLAMED_UW_STACK_ENTRIES": options.unwind_stack_entries,
            "FLAMED_UW_TIMING": int(options.unwind_timing),
        })
    cflags = (f"-I{d}", *(f"-D{k}={v}" for k, v in defines.items()))
    return BpfProgram(path=path, text=text, cflags=cflags, header_path=header, header=header_text,
                      parts=tuple(parts))


def task_fsbase_offset() -> int:
    """Offset of ``thread.fsbase`` in the running kernel's ``task_struct``
    (from /sys/kernel/btf/vmlinux), or -1 with a logged reason."""
    try:
        from flamed.sampling.cpython import btf

        return int(btf.fsbase_offset())
    except Exception as e:  # noqa: BLE001 -- only 3.8-3.10 thread matching needs it
        log.warning("no task_struct fs base offset from the kernel's BTF (%s): threads of CPython "
                    "3.8-3.10 cannot be matched in BPF", e)
        return -1


def print_bpf(options: BpfSamplerOptions = BpfSamplerOptions(), file: TextIO | None = None) -> None:
    fs = task_fsbase_offset() if options.python else -1
    (file or sys.stdout).write(bpf_program(options, fsbase_offset=fs).render())


def _stat_indices(header: Path) -> dict[str, int]:
    """FLAMED_STAT_* from flamed.h, the one place they are defined."""
    found = {m[1]: int(m[2]) for m in re.finditer(r"\bFLAMED_STAT_(\w+)\s*=\s*(\d+)", header.read_text())}
    n = re.search(r"\bFLAMED_NSTATS\s*=\s*(\d+)", header.read_text())
    if not found or n is None:
        raise FlamedError(f"{header}: no FLAMED_STAT_* indices found")
    found["__N__"] = int(n[1])
    return found


# ---------------------------------------------------------------------------
# Counters for metrics


@dataclass
class SamplerStats:
    """Cumulative counters and last-drain figures, for metrics and status."""

    event: str = ""  # "cycles" or "cpu-clock" once started
    frequency: int = 0
    cpus: tuple[int, ...] = ()
    samples_total: int = 0  # sum of Window.samples over all drains
    #: The program's own never-reset count of samples that passed the filters,
    #: as of the last drain.  After stop() and a final drain it equals
    #: samples_total: no sample was lost or counted twice between windows.
    bpf_samples_total: int = 0
    counted_total: int = 0
    events_total: int = 0  # samples sent as events (watched processes)
    idle_total: int = 0  # idle samples skipped (include_idle=False)
    filtered_total: int = 0  # samples the filters excluded
    lost_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOST_REASONS, 0))
    drains_total: int = 0
    quiesce_timeouts: int = 0
    last_drain_seconds: float = 0.0  # whole drain, symbolization included
    last_symbolize_seconds: float = 0.0
    last_drain_cpu_seconds: float = 0.0  # CPU time of the draining thread (less than wall on a busy host)
    last_keys: int = 0  # count-map entries read in the last drain
    last_stack_ids: int = 0  # distinct stack ids read in the last drain
    last_unwound_stacks: int = 0  # distinct unwound user stacks read in the last drain
    last_stacks: int = 0  # distinct (tgid, tid, comm, stack) in the last Window
    last_events: int = 0
    count_map_fill: float = 0.0  # last_keys / max_entries
    stack_map_fill: float = 0.0  # stack ids used / stack map buckets
    max_entries: int = 0
    stack_buckets: int = 0
    symbol_processes: int = 0  # processes with a live symbol cache
    symbol_addresses: int = 0  # cached address -> frame results
    #: Process images whose maps were read when first sampled; those already
    #: gone by then; reports the perf buffer lost (user space fell behind).
    #: The user frames of the last two are named only if alive at the drain.
    primed_total: int = 0
    prime_missed_total: int = 0
    prime_lost_total: int = 0
    prime_throttled_total: int = 0  # skipped: over prime_rate
    #: FLAMED_STAT_PY_* summed over drains (PY_SAMPLES, PY_STACKS, PY_NO_THREAD...).
    python_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PY_STATS, 0))
    #: FLAMED_STAT_UW_* summed over drains (UW_SAMPLES, UW_COMPLETE, UW_NO_TABLE...).
    unwind_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_UW_STATS, 0))
    #: The unwinder's tables and processes (``options.unwind``), as of the last drain.
    unwind: UnwindStats | None = None

    def copy(self) -> SamplerStats:
        c = SamplerStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        c.lost_total = dict(self.lost_total)
        c.python_total = dict(self.python_total)
        c.unwind_total = dict(self.unwind_total)
        c.unwind = self.unwind.copy() if self.unwind is not None else None
        return c


# ---------------------------------------------------------------------------
# Helpers around bcc


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def _check_privileges() -> None:
    caps = _effective_caps()

    def has(c: int) -> bool:
        return bool(caps >> c & 1)

    if has(_CAP_SYS_ADMIN) or (has(_CAP_BPF) and has(_CAP_PERFMON)):
        return
    # Name what is missing: under a unit's CapabilityBoundingSet it is usually one of them.
    missing = " and ".join(n for c, n in ((_CAP_BPF, "CAP_BPF"), (_CAP_PERFMON, "CAP_PERFMON")) if not has(c))
    raise CapabilityError(
        f"the BPF sampler is missing {missing}: it needs root, or CAP_BPF and CAP_PERFMON (plus "
        f"CAP_SYS_PTRACE to read other processes' symbols; effective capabilities now: {caps:#x}); "
        "run as root, or through the systemd unit, which grants them"
    )


def _import_bcc() -> Any:
    try:
        import bcc
    except Exception as e:  # noqa: BLE001 -- any import failure means the same thing
        raise CapabilityError(
            f"the bcc Python binding does not import ({e}); install Debian's python3-bpfcc and run "
            f"flamed with /usr/bin/python3 or a venv made with --system-site-packages (now: {sys.executable})"
        ) from None
    return bcc


def _headers_hint() -> str:
    rel = os.uname().release
    build = Path("/lib/modules") / rel / "build"
    src = os.environ.get("BCC_KERNEL_SOURCE")
    if src:
        return f"BCC_KERNEL_SOURCE={src} is used; check that it holds kernel headers"
    if not build.exists():
        return (
            f"no kernel headers for {rel} ({build} missing): install linux-headers-{rel}, or run "
            "packaging/setup.sh to link the distribution's headers, or set BCC_KERNEL_SOURCE"
        )
    return f"kernel headers from {build.resolve()}"


def _with_captured_stderr(fn: Callable[[], Any]) -> tuple[Any, str, BaseException | None]:
    """Run ``fn`` with fd 2 captured: clang and libbpf report there, not in exceptions."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- bcc raises plain Exception
            error = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
    return result, text, error


def _tail(text: str, lines: int = 12) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n  ".join(kept[-lines:])


def online_cpus(sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """CPU numbers from ``online`` (``0-3,5``)."""
    text = (sysfs / "online").read_text().strip()
    out: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _default_resolver(pid: int) -> Resolver:
    """kallsyms read by flamed for the kernel (bcc's needs euid 0), bcc per process."""
    return Kallsyms() if pid < 0 else BccResolver(pid)


#: errnos of a kernel without lookup-and-delete on stack-trace maps (524: ENOTSUPP)
_NO_LOOKUP_AND_DELETE = (errno.EINVAL, 524, errno.EOPNOTSUPP)


def _placeholder(sid: int, kernel: bool) -> Stack:
    """Frames standing for a stack id that is an error (see bpf/flamed.h)."""
    if sid == -errno.EFAULT:
        return ()
    suffix = KERNEL_SUFFIX if kernel else ""
    if sid == -errno.ENODATA:
        return (f"[missing {'kernel' if kernel else 'user'} stack]{suffix}",)
    name = errno.errorcode.get(-sid, str(-sid))
    return (f"[lost stack: {name}]{suffix}",)


# ---------------------------------------------------------------------------
# The sampler


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _age_s(ident: ProcessIdentity) -> float:
    """Seconds since the process started (/proc/PID/stat's start time is in
    clock ticks since boot)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ident.start_time / _CLK_TCK


def _alive(pid: int) -> bool:
    """Is ``pid`` a user process that has not exited?  (``read_identity``
    says None for an exited one or a zombie; a kernel thread has no code
    mapped, start_code 0, and no maps to read.)"""
    ident = read_identity(pid)
    return ident is not None and ident.start_code != 0


class BpfSampler:
    """bpf/profile.bpf.c through bcc; implements :class:`flamed.sampling.contract.Sampler`.

    ``symbolizer`` and ``clock`` (wall-clock ns) can be passed in; the
    defaults are bcc's symbol caches and :func:`time.time_ns`.
    """

    def __init__(
        self,
        options: BpfSamplerOptions = BpfSamplerOptions(),
        *,
        symbolizer: Symbolizer | None = None,
        clock: Callable[[], int] = time.time_ns,
        python_frames: PythonFrames | None = None,
    ) -> None:
        options.validate()
        self.options = options
        self._python = python_frames if python_frames is not None else (PythonFrames() if options.python else None)
        self._py_new: list[tuple[int, int, int]] = []  # (tgid, gen, stack id) reported new, from the perf buffer
        self._py_retry: deque[tuple[float, int, float]] = deque()  # (due, tgid, delay) of probes to repeat
        self._py_described: set[int] = set()
        self._fsbase_offset = -1
        self._py_forget: set[int] = set()  # exited: dropped after the next drain
        self._py_retry_lock = threading.Lock()
        self._py_gone: set[int] = set()  # found exited at the last drain, forgotten at this one
        self._clock = clock
        self._symbolizer = symbolizer
        self._lock = threading.RLock()
        self._bpf: Any = None
        self._lib: Any = None
        self._perf_fds: dict[int, int] = {}
        self._prog_fd = -1
        self._gen = 0
        self._window_start = 0
        self._watched: set[int] = set()
        self._pids: set[int] = set(options.pids or ())
        self._raw_events: list[tuple[int, int, int, int, int, int, int, bytes, int]] = []
        self._global_seen: dict[str, int] = {"IDLE": 0, "FILTERED": 0, "SAMPLES": 0}
        self._stats = SamplerStats(frequency=options.frequency)
        self._stat_idx: dict[str, int] = {}
        self._started = False
        self._stopped = False
        self._closed = False
        self._event_name = ""
        # Buffers reused by every drain.
        self._keys_buf: Any = None
        self._vals_buf: Any = None
        self._stack_buf: Any = None
        self._comm_cache: dict[bytes, str] = {}
        self._lookup_and_delete = True  # until the kernel says otherwise
        self._primer: threading.Thread | None = None
        self._prime_stop = threading.Event()
        self._prime_wake = -1  # eventfd: close() wakes the priming thread's epoll wait with it
        self._new_images: list[int] = []  # tgids reported, filled by perf_buffer_poll's callback
        #: (due, tgid, tries) of reads to repeat, in due order: tries 0 is the
        #: second read of a young process, tries >= 1 a first read that failed
        #: while the process was still there (it was exec'ing).
        self._reprime: deque[tuple[float, int, int]] = deque()
        self._unwinder: Unwinder | None = None
        self._uw_forget: set[int] = set()  # exited: their uw_procs entry goes after the next drain
        self._stack_bufs: dict[str, tuple[Any, Any]] = {}  # reused by every drain, per stack map kind
        self._prime_tokens = float(options.prime_rate)  # token bucket of prime_rate reads per second
        self._prime_refill = time.monotonic()

    # -- Sampler protocol -------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self._closed:
                raise FlamedError("sampler already closed; make a new one")
            try:
                self._start()
            except BaseException:
                self._teardown()
                raise
            self._started = True
            if self.options.prime:
                self._prime_wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                self._primer = threading.Thread(target=self._prime_loop, name="flamed-prime", daemon=True)
                self._primer.start()

    def drain(self) -> Window:
        with self._lock:
            if not self._started or self._closed:
                raise FlamedError("sampler not started")
            return self._drain()

    def watch(self, tgid: int) -> None:
        with self._lock:
            self._watched.add(tgid)
            if self._bpf is not None:
                self._map_set("watched", tgid, ct.c_uint32)

    def unwatch(self, tgid: int) -> None:
        with self._lock:
            self._watched.discard(tgid)
            if self._bpf is not None:
                self._map_del("watched", tgid, ct.c_uint32)

    def close(self) -> None:
        self._stop_primer()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._teardown()

    # -- priming: maps of new processes, read while they run ---------------
    def _stop_primer(self) -> None:
        self._prime_stop.set()
        if self._prime_wake >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._prime_wake, 1)
        t = self._primer
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)
            if t.is_alive():
                log.warning("the priming thread did not stop within 10 s")
                return  # it may still wait on the eventfd: leave it open
        if self._prime_wake >= 0 and (t is None or not t.is_alive()):
            os.close(self._prime_wake)
            self._prime_wake = -1

    #: A process first read within PRIME_YOUNG_S of its start is read again
    #: PRIME_REREAD_S later: right after exec the dynamic loader has not
    #: mapped the libraries yet.  Measured with bench/short_lived.py, 20 ms
    #: processes at 999 Hz: 2.0 % of their samples stayed [unknown] without
    #: the second read, 0.5 % with it; a read costs ~90 us of CPU.
    PRIME_REREAD_S = 0.02
    PRIME_YOUNG_S = 0.1
    #: A first read that fails while the process is still there (it read
    #: the identity of an image that exec replaced in the middle of the
    #: read) is tried again PRIME_REREAD_S later, up to this many times.
    #: Without it, about 1 in 200 short Python processes started from a Python
    #: parent was never described (tests/integration/test_python_bpf.py).
    PRIME_FIRST_TRIES = 4

    def _prime_loop(self) -> None:
        # Latency matters here (a process's maps and its Python description
        # must be read while it runs, within milliseconds of its first
        # sample), CPU does not (a few reads a second): run ahead of ordinary
        # work on a busy host.  Not permitted without CAP_SYS_NICE: fine.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        except OSError:
            pass
        # One epoll over the perf buffers and the close() eventfd, with no
        # timeout unless a second read or a Python probe retry is due: an
        # idle host wakes this thread only when a process execs.
        readers = list(self._bpf.perf_buffers.values())
        ep = select.epoll()
        try:
            for r in readers:
                ep.register(self._lib.perf_reader_fd(r), select.EPOLLIN)
            ep.register(self._prime_wake, select.EPOLLIN)
            self._prime_wait(ep, readers)
        finally:
            ep.close()

    def _prime_wait(self, ep: select.epoll, readers: list[Any]) -> None:
        failures = 0
        arr = (ct.c_void_p * len(readers))(*readers)
        while not self._prime_stop.is_set():
            try:
                due = [q[0][0] for q in (self._reprime, self._py_retry) if q]
                wait = max(0.0, min(due) - time.monotonic()) if due else -1.0
                ep.poll(wait)
                if self._prime_stop.is_set():
                    break  # close() joins this thread before it tears the buffers down
                # Reads every buffer's pending records and calls their callbacks.
                self._lib.perf_reader_consume(len(readers), arr)
                self._prime_reported()
                self._prime_again()
                if self._python is not None:
                    self._py_warm_new()
                    self._py_retry_due()
                failures = 0
            except Exception as e:  # noqa: BLE001 -- keep sampling; the drain reads maps anyway
                failures += 1
                if failures in (1, 100):
                    log.warning("reading the maps of new processes failed: %s", e)
                if self._prime_stop.wait(0.1):
                    break

    def _on_new_image(self, _cpu: int, data: Any, size: int) -> None:
        if size >= 4:
            self._new_images.append(ct.cast(data, ct.POINTER(ct.c_uint32))[0])

    def _on_uw_miss(self, _cpu: int, data: Any, size: int) -> None:
        # A stack met an address without a table: read the maps again, and
        # load the binary of that address.
        if size >= 16 and self._unwinder is not None:
            tgid, _pad, addr = struct.unpack("<IIQ", ct.string_at(data, 16))
            self._unwinder.submit(tgid, addr)

    def _on_new_image_lost(self, lost: int) -> None:
        self._stats.prime_lost_total += int(lost)

    def _prime_token(self) -> bool:
        """May the priming thread read /proc once more now (prime_rate)?"""
        now = time.monotonic()
        rate = self.options.prime_rate
        self._prime_tokens = min(float(rate), self._prime_tokens + (now - self._prime_refill) * rate)
        self._prime_refill = now
        if self._prime_tokens >= 1.0:
            self._prime_tokens -= 1.0
            return True
        self._stats.prime_throttled_total += 1
        return False

    def _read_and_prime(self, tgid: int, *, first: bool, tries: int | None = None) -> ProcessIdentity | None:
        """Read ``tgid``'s identity and maps and hand them to the symbolizer
        (in the priming thread); the identity primed, or ``None`` when
        throttled, gone or closed.  Only first reads are counted as primed
        or missed.  ``tries``: how many times this first read failed already;
        a failed one of a process still there is tried again soon."""
        sym = self._symbolizer
        if sym is None or not self._prime_token():
            return None
        prepared = sym.prepare(tgid)  # /proc reads: outside the lock, a drain may hold it
        if prepared is None and tries is not None and tries + 1 < self.PRIME_FIRST_TRIES and _alive(tgid):
            self._reprime.append((time.monotonic() + self.PRIME_REREAD_S, tgid, tries + 1))
            return None
        with self._lock:
            if self._closed:
                return None
            if prepared is None:
                if first:
                    self._stats.prime_missed_total += 1
                return None
            sym.prime(tgid, prepared)
            if first:
                self._stats.primed_total += 1
        return prepared[0]

    def _prime_reported(self) -> None:
        """First reads of every process image reported since the last call."""
        tasks, self._new_images = self._new_images, []
        for tgid in dict.fromkeys(tasks):
            if self._prime_stop.is_set():
                break
            self._prime_first(tgid, 0)

    def _prime_first(self, tgid: int, tries: int) -> None:
        """The first read of a process image, then its unwinder and Python
        descriptions."""
        ident = self._read_and_prime(tgid, first=True, tries=tries)
        if ident is None:
            return
        if self._unwinder is not None:
            self._unwinder.submit(tgid)
        if _age_s(ident) < self.PRIME_YOUNG_S:
            self._reprime.append((time.monotonic() + self.PRIME_REREAD_S, tgid, 0))
        if self._python is not None:
            self._py_describe(tgid, 0.002)

    # -- Python processes: described to the program when first sampled -----
    #: Longest wait between two probes of a process that is not ready yet.
    PY_RETRY_MAX_S = 0.5

    def _py_describe(self, tgid: int, delay: float) -> None:
        """Probe ``tgid``; install its flamed_pyproc, or probe again later."""
        py = self._python
        assert py is not None
        res = py.describe(tgid)
        if res is True:
            # Gently growing: the interpreter of a new process is ready
            # within milliseconds, an embedded one maybe much later.
            with self._py_retry_lock:
                self._py_retry.append((time.monotonic() + delay, tgid, min(delay * 1.25, self.PY_RETRY_MAX_S)))
            return
        with self._lock:
            if self._bpf is None or self._closed:
                return
            t = self._bpf["pyprocs"]
            if isinstance(res, bytes):
                leaf = t.Leaf()
                if len(res) != ct.sizeof(leaf):
                    log.warning("flamed_pyproc of %d bytes, the program's is %d: not installed", len(res),
                                ct.sizeof(leaf))
                    return
                ct.memmove(ct.byref(leaf), res, len(res))
                t[ct.c_uint32(tgid)] = leaf
                self._py_described.add(tgid)
            elif tgid in self._py_described:
                self._map_del("pyprocs", tgid, ct.c_uint32)
                self._py_described.discard(tgid)

    def _py_retry_due(self) -> None:
        now = time.monotonic()
        with self._py_retry_lock:
            due = [r for r in self._py_retry if r[0] <= now]
            self._py_retry = deque(sorted(r for r in self._py_retry if r[0] > now))
        for _due, tgid, delay in due:
            self._py_describe(tgid, delay)

    def python_claim(self, tgid: int) -> tuple[bool | None, str]:
        """Does the program read ``tgid``'s Python frames itself?  ``(True,
        "walked")``; ``(False, reason)`` (then py-spy may); ``(None, "")``: not
        ready yet, ask again.  Probes the process now if it has not been."""
        py = self._python
        if py is None:
            return False, "bpf_walker_off"
        if tgid in self._py_described:
            return True, "walked"
        if py.verdict(tgid) is None:
            self._py_describe(tgid, 0.002)
            if tgid in self._py_described:
                return True, "walked"
        v = py.verdict(tgid)
        if v in (None, "pending"):
            return None, ""
        if v == "bpf":
            return True, "walked"
        return False, str(v)

    def _on_py_new(self, _cpu: int, data: Any, size: int) -> None:
        if size >= _PY_NEW.size:
            self._py_new.append(_PY_NEW.unpack(ct.string_at(data, _PY_NEW.size)))

    def _py_warm_new(self) -> None:
        """Name the code objects of the stacks the program reported new."""
        py = self._python
        assert py is not None
        new, self._py_new = self._py_new, []
        b = self._bpf
        if not new or b is None:
            return
        key = ct.c_uint64(0)
        for tgid, gen, sid in dict.fromkeys(new):
            if self._prime_stop.is_set():
                break
            try:
                t = b[f"pystacks{gen & 1}"]
                key.value = sid
                leaf = t.Leaf()
                if self._lib.bpf_lookup_elem(t.map_fd, ct.byref(key), ct.byref(leaf)) != 0:
                    continue  # drained meanwhile: the drain names it
            except Exception:  # noqa: BLE001 -- closing
                return
            frames, _flags = parse_pystack(bytes(leaf), self.options.python_depth)
            py.warm(tgid, frames)

    def _prime_again(self) -> None:
        """The due second reads of recently primed young processes."""
        now = time.monotonic()
        while self._reprime and self._reprime[0][0] <= now:
            _due, tgid, tries = self._reprime.popleft()
            if tries:
                self._prime_first(tgid, tries)
            elif self._read_and_prime(tgid, first=False) is not None and self._unwinder is not None:
                self._unwinder.submit(tgid)  # libraries mapped since the first read

    def stop(self) -> None:
        """Stop sampling but keep the maps: a last :meth:`drain` then returns
        everything up to now (what a daemon does on SIGTERM)."""
        with self._lock:
            self._detach()
            self._stopped = True

    # -- beyond the protocol ---------------------------------------------
    def __enter__(self) -> BpfSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def event(self) -> str:
        """``cycles`` or ``cpu-clock``: the perf event in use (after start)."""
        return self._event_name

    @property
    def watched(self) -> frozenset[int]:
        return frozenset(self._watched)

    def add_pid(self, tgid: int) -> None:
        """Add a process to the pid filter (``options.pids`` must be set)."""
        with self._lock:
            self._need_pid_filter()
            self._pids.add(tgid)
            if self._bpf is not None:
                self._map_set("filter_pids", tgid, ct.c_uint32)

    def remove_pid(self, tgid: int) -> None:
        with self._lock:
            self._need_pid_filter()
            self._pids.discard(tgid)
            if self._bpf is not None:
                self._map_del("filter_pids", tgid, ct.c_uint32)

    def forget(self, pid: int) -> None:
        """``pid`` exited or exec'd: drop its symbols once the next drain has
        symbolized the samples it still has in flight."""
        with self._lock:
            if self._symbolizer is not None:
                self._symbolizer.forget(pid)
            if self._python is not None:
                self._py_forget.add(pid)
            if self._unwinder is not None:
                self._uw_forget.add(pid)

    def poll_events(self) -> int:
        """Move events from the ring buffer into the sampler (returned by the
        next drain).  Call it between drains when watched processes produce
        more events per drain interval than the ring buffer holds; returns how
        many were read."""
        with self._lock:
            if self._bpf is None:
                return 0
            before = len(self._raw_events)
            self._bpf.ring_buffer_consume()
            return len(self._raw_events) - before

    def stats(self) -> SamplerStats:
        with self._lock:
            s = self._stats.copy()
            if self._symbolizer is not None:
                s.symbol_processes = self._symbolizer.stats.processes
                s.symbol_addresses = self._symbolizer.stats.addresses_cached
            return s

    def program(self) -> BpfProgram:
        return bpf_program(self.options, fsbase_offset=self._fsbase_offset)

    @property
    def unwinder(self) -> Unwinder | None:
        """The native unwinder's tables (``options.unwind``), for tests and status."""
        return self._unwinder

    def unwind_ready(self, tgid: int) -> bool:
        """Has ``tgid`` been described to the unwinder (its stacks are unwound from tables)?"""
        u = self._unwinder
        return u is not None and u.described(tgid)

    @property
    def python_frames(self) -> PythonFrames | None:
        """The CPython side (``options.python``), for metrics and status."""
        return self._python

    # -- start -----------------------------------------------------------
    def _start(self) -> None:
        bcc = _import_bcc()
        _check_privileges()
        if self.options.python:
            self._fsbase_offset = task_fsbase_offset()
            if self._python is not None:
                self._python.fsbase_known = self._fsbase_offset >= 0
        prog = bpf_program(self.options, fsbase_offset=self._fsbase_offset)
        self._stat_idx = _stat_indices(prog.path.parent / "flamed.h")
        # Compile from the files' text with -D flags; the header comes through -I.
        b, text, err = _with_captured_stderr(
            lambda: bcc.BPF(text=prog.source.encode(), cflags=list(prog.cflags))
        )
        if err is not None or b is None:
            raise CapabilityError(
                f"bcc could not compile {prog.path} ({_headers_hint()}):\n  {_tail(text) or err}"
            )
        self._bpf = adopt(b)  # its exit cleanup is flamed's (quiet without tracefs)
        from bcc.libbcc import lib

        self._lib = lib
        fn, text, err = _with_captured_stderr(lambda: b.load_func(b"flamed_sample", bcc.BPF.PERF_EVENT))
        if err is not None or fn is None:
            raise CapabilityError(
                f"the kernel refused the BPF program (verifier or privileges):\n  {_tail(text) or err}"
            )
        self._prog_fd = fn.fd
        if self.options.unwind:
            self._load_unwind_programs(bcc)
        self._check_layout()
        self._symbolizer = self._symbolizer or Symbolizer(resolver_factory=_default_resolver)
        for t in self._watched:
            self._map_set("watched", t, ct.c_uint32)
        for t in self._pids:
            self._map_set("filter_pids", t, ct.c_uint32)
        for t in self.options.tids or ():
            self._map_set("filter_tids", t, ct.c_uint32)
        for cg in self.options.cgroups or ():
            self._map_set("filter_cgroups", self._cgroup_id(cg), ct.c_uint64)
        comms = b["filter_comms"]
        for c in self.options.comms or ():
            k = comms.Key()
            k.comm = c.encode()
            comms[k] = comms.Leaf(1)
        b["events"].open_ring_buffer(self._on_event)
        if self.options.prime:
            b["new_images"].open_perf_buffer(
                self._on_new_image, page_cnt=self.options.prime_pages, lost_cb=self._on_new_image_lost
            )
        if self.options.unwind:
            cache = TableCache(self.options.unwind_cache_dir)
            self._unwinder = Unwinder(b, lib, rows_capacity=self.options.unwind_rows,
                                      max_maps=self.options.unwind_maps,
                                      max_procs=self.options.unwind_max_procs, cache=cache,
                                      skip=frozenset({os.getpid()}))
            self._unwinder.start()
            b["uw_miss"].open_perf_buffer(self._on_uw_miss, page_cnt=self.options.prime_pages,
                                          lost_cb=lambda _n: None)
        if self.options.python:
            b["py_new"].open_perf_buffer(self._on_py_new, page_cnt=self.options.prime_pages,
                                         lost_cb=lambda _n: None)
        n = self.options.max_entries
        key_t, leaf_t = b["counts0"].Key, b["counts0"].Leaf
        self._keys_buf = (key_t * n)()
        self._vals_buf = (leaf_t * n)()
        self._stack_buf = (ct.c_uint64 * self.options.stack_depth)()
        self._gen = 0
        self._map_write_gen(0)
        self._stats.max_entries = n
        self._stats.stack_buckets = 1 << max(0, (self.options.stack_storage_size - 1).bit_length())
        self._window_start = self._clock()
        self._attach()

    def _load_unwind_programs(self, bcc: Any) -> None:
        """flamed_unwind and flamed_finish into uw_progs (bpf/unwind.bpf.c's tail calls)."""
        b = self._bpf
        progs = b["uw_progs"]
        def loader(n: bytes) -> Callable[[], Any]:
            return lambda: b.load_func(n, bcc.BPF.PERF_EVENT)

        for i, name in enumerate((b"flamed_unwind", b"flamed_finish")):
            fn, text, err = _with_captured_stderr(loader(name))
            if err is not None or fn is None:
                raise CapabilityError(
                    f"the kernel refused the unwinder's program {name.decode()} (verifier):\n  {_tail(text) or err}"
                )
            progs[ct.c_int(i)] = ct.c_int(fn.fd)

    def _check_layout(self) -> None:
        """The ctypes/struct mirrors must match what clang laid out."""
        got = ct.sizeof(self._bpf["counts0"].Key)
        if got != _KEY.size:
            raise FlamedError(f"struct flamed_key is {got} bytes in BPF, {_KEY.size} in Python: rebuild both")

    def _cgroup_id(self, cg: int | str) -> int:
        if isinstance(cg, int):
            return cg
        try:
            # The cgroup v2 id that bpf_get_current_cgroup_id returns is the
            # inode number of the cgroup's directory.
            return os.stat(cg).st_ino
        except OSError as e:
            raise ConfigError(f"sampler option cgroups: {cg}: {e.strerror}") from None

    def _attach(self) -> None:
        wanted = self.options.event
        cpus = list(self.options.cpus) if self.options.cpus is not None else online_cpus()
        order = ["cycles", "cpu-clock"] if wanted == "auto" else [wanted]
        last_err = 0
        errors: dict[str, int] = {}
        for name in order:
            ok, last_err = self._attach_event(name, cpus)
            if ok:
                self._event_name = name
                self._stats.event = name
                self._stats.cpus = tuple(sorted(self._perf_fds))
                if "cycles" in errors:
                    log.info(
                        "hardware event cpu-cycles unavailable (%s); sampling with the software cpu-clock",
                        os.strerror(errors["cycles"]),
                    )
                log.info("sampling %s at %d Hz on CPUs %s", name, self.options.frequency, self._stats.cpus)
                return
            errors[name] = last_err
        hint = (
            "need CAP_PERFMON (or root) and kernel.perf_event_paranoid <= 2"
            if last_err in (errno.EACCES, errno.EPERM)
            else "the perf event is not supported here; try event=cpu-clock"
        )
        raise CapabilityError(
            f"perf_event_open({'/'.join(order)}) refused on CPU(s) {cpus}: "
            f"{os.strerror(last_err) if last_err else 'error'}; {hint}"
        )

    def _attach_event(self, name: str, cpus: Iterable[int]) -> tuple[bool, int]:
        ev_type, ev_config = EVENTS[name]
        opened: dict[int, int] = {}
        for cpu in cpus:
            fd = self._open_perf(ev_type, ev_config, cpu)
            if fd < 0:
                err = -fd
                for f in opened.values():
                    self._lib.bpf_close_perf_event_fd(f)
                return False, err
            opened[cpu] = fd
        self._perf_fds.update(opened)
        return True, 0

    def _open_perf(self, ev_type: int, ev_config: int, cpu: int) -> int:
        """fd, or -errno."""

        def call() -> int:
            # Explicit ctypes: bcc declares no argtypes for this function.
            fd: int = self._lib.bpf_attach_perf_event(
                ct.c_int(self._prog_fd), ct.c_uint32(ev_type), ct.c_uint32(ev_config),
                ct.c_uint64(0), ct.c_uint64(self.options.frequency),
                ct.c_int(-1), ct.c_int(cpu), ct.c_int(-1),
            )
            return fd if fd >= 0 else -(ct.get_errno() or errno.EINVAL)

        fd, _text, _err = _with_captured_stderr(call)
        return int(fd) if fd is not None else -errno.EINVAL

    def _refresh_cpus(self) -> None:
        """Attach to CPUs that came online since the last look."""
        if self.options.cpus is not None or not self._event_name or self._stopped:
            return
        try:
            new = [c for c in online_cpus() if c not in self._perf_fds]
        except OSError:
            return
        if new:
            ok, err = self._attach_event(self._event_name, new)
            if ok:
                log.info("CPUs %s came online: sampling them too", new)
                self._stats.cpus = tuple(sorted(self._perf_fds))
            else:
                log.warning("could not attach to new CPUs %s: %s", new, os.strerror(err))

    def _detach(self) -> None:
        for fd in self._perf_fds.values():
            self._lib.bpf_close_perf_event_fd(fd)
        self._perf_fds.clear()

    def _teardown(self) -> None:
        self._detach()
        if self._unwinder is not None:
            self._unwinder.stop()
        if self._bpf is not None:
            try:
                close_bpf(self._bpf)
            finally:
                self._bpf = None
        if self._symbolizer is not None:
            self._symbolizer.close()
        self._keys_buf = self._vals_buf = None

    # -- small map helpers -------------------------------------------------
    def _map_set(self, name: str, key: int, ktype: Any) -> None:
        t = self._bpf[name]
        t[ktype(key)] = t.Leaf(1)

    def _map_del(self, name: str, key: int, ktype: Any) -> None:
        t = self._bpf[name]
        try:
            del t[ktype(key)]
        except KeyError:
            pass

    def _map_write_gen(self, gen: int) -> None:
        t = self._bpf["generation"]
        t[ct.c_int(0)] = ct.c_uint32(gen)

    def _need_pid_filter(self) -> None:
        if self.options.pids is None:
            raise FlamedError("the pid filter is off (options.pids is None); set pids=frozenset() to use add_pid")

    def _on_event(self, _ctx: Any, data: Any, size: int) -> int:
        if size < _EVENT.size:
            return 0
        self._raw_events.append(_EVENT.unpack(ct.string_at(data, _EVENT.size)))
        return 0

    # -- drain -------------------------------------------------------------
    def _drain(self) -> Window:
        t0 = time.perf_counter()
        c0 = time.thread_time()
        old = self._gen
        self._gen = old ^ 1
        self._map_write_gen(self._gen)
        end_ns = self._clock()
        start_ns, self._window_start = self._window_start, end_ns
        self._quiesce()

        counters = self._take_stats(old)
        keys = self._take_counts(old)
        pystacks = self._take_pystacks(old) if self._python is not None else {}
        ustacks = self._take_ustacks(old) if self._unwinder is not None else {}
        self._bpf.ring_buffer_consume()
        raw_events = [e for e in self._raw_events if e[4] == old]
        self._raw_events = [e for e in self._raw_events if e[4] != old]

        ids: set[int] = set()
        for _tgid, _tid, kid, uid, _comm, _py, _nid, _n in keys:
            ids.add(kid)
            ids.add(uid)
        for e in raw_events:
            ids.add(e[5])
            ids.add(e[6])
        ids = {i for i in ids if i >= 0}
        stacks = self._read_stacks(old, ids)
        self._clear_stacks(old)
        t1 = time.perf_counter()

        sym = self._symbolizer
        assert sym is not None
        sym.begin_drain()
        if self._python is not None:
            self._python.begin_drain()
        lost = dict.fromkeys(LOST_REASONS, 0)
        for reason, n in counters.items():
            if reason in lost:
                lost[reason] += n
        lost["stack_read_failed"] = sum(1 for i in ids if i not in stacks)
        counts, events = self._symbolize(keys, raw_events, stacks, pystacks, ustacks)
        sym.end_drain()
        if self._unwinder is not None and self._uw_forget:
            gone, self._uw_forget = self._uw_forget, set()
            for pid in gone:
                self._unwinder.forget(pid)
        if self._python is not None and (self._py_forget or self._py_described):
            # Exited processes are forgotten one drain after they are found
            # gone: the generation that began at this drain's flip may still
            # hold their last samples, named from the cache.
            gone, self._py_forget = self._py_forget, set()
            gone.update(self._py_gone)
            self._py_gone = set(self._python.gone()) - gone
            for pid in gone:
                self._python.forget(pid)
                if pid in self._py_described:
                    self._map_del("pyprocs", pid, ct.c_uint32)
                    self._py_described.discard(pid)
        self._refresh_cpus()
        t2 = time.perf_counter()

        samples = counters.get("SAMPLES", 0)
        s = self._stats
        s.samples_total += samples
        s.counted_total += counters.get("COUNTED", 0)
        s.events_total += counters.get("EVENTS", 0)
        for name in _PY_STATS:
            s.python_total[name] += counters.get(name, 0)
        for name in _UW_STATS:
            s.unwind_total[name] += counters.get(name, 0)
        if self._unwinder is not None:
            s.unwind = self._unwinder.stats.copy()
        for r, n in lost.items():
            s.lost_total[r] += n
        s.drains_total += 1
        s.last_drain_seconds = t2 - t0
        s.last_drain_cpu_seconds = time.thread_time() - c0
        s.last_symbolize_seconds = t2 - t1
        s.last_keys = len(keys)
        s.last_stack_ids = len(ids)
        s.last_unwound_stacks = len(ustacks)
        s.last_stacks = len(counts)
        s.last_events = len(events)
        s.count_map_fill = len(keys) / self.options.max_entries
        s.stack_map_fill = len(ids) / s.stack_buckets if s.stack_buckets else 0.0
        return Window(
            start_ns=start_ns,
            end_ns=end_ns,
            counts=counts,
            events=events,
            samples=samples,
            lost=lost,
            sample_rate=float(self.options.frequency),
        )

    def _read_percpu(self, name: str, index: int) -> list[int]:
        return [int(v) for v in self._bpf[name][ct.c_int(index)]]

    def _quiesce(self) -> None:
        """Wait until every program that may have read the old generation is done.

        A program's per-CPU sequence is odd while it runs.  The short sleep
        first makes the flip visible everywhere (the sleep's context switch is
        a full barrier) and lets the microseconds-long programs finish; then
        any CPU still odd (a vCPU the hypervisor paused mid-program) is waited
        for until its sequence moves.
        """
        time.sleep(0.0005)
        seqs = self._read_percpu("inflight", 0)
        busy = {cpu: v for cpu, v in enumerate(seqs) if v & 1}
        deadline = time.monotonic() + self.options.quiesce_timeout
        while busy and time.monotonic() < deadline:
            time.sleep(0.0002)
            now = self._read_percpu("inflight", 0)
            busy = {cpu: v for cpu, v in busy.items() if now[cpu] == v}
        if busy:
            self._stats.quiesce_timeouts += 1
            log.warning("CPUs %s still in the BPF program after %.1fs; draining anyway", sorted(busy),
                        self.options.quiesce_timeout)

    def _take_stats(self, gen: int) -> dict[str, int]:
        """Read and zero the old generation's counters; deltas of the global ones."""
        idx = self._stat_idx
        nstats = idx["__N__"]
        t = self._bpf["stats"]
        out: dict[str, int] = {}
        zero = t.Leaf()
        for name, i in idx.items():
            if name == "__N__" or name in ("IDLE", "FILTERED"):
                continue
            slot = gen * nstats + i
            vals = t[ct.c_int(slot)]
            total = sum(int(v) for v in vals)
            if total:
                t[ct.c_int(slot)] = zero
            out[_STAT_TO_REASON.get(name, name)] = total
        for name in ("IDLE", "FILTERED", "SAMPLES"):
            total = sum(int(v) for v in t[ct.c_int(2 * nstats + idx[name])])
            delta = total - self._global_seen[name]
            self._global_seen[name] = total
            if name == "IDLE":
                self._stats.idle_total += delta
            elif name == "FILTERED":
                self._stats.filtered_total += delta
            else:
                self._stats.bpf_samples_total += delta
        return out

    def _take_pystacks(self, gen: int) -> dict[int, bytes]:
        """Read and delete the old generation's Python stacks: id -> raw
        ``struct flamed_pystack``."""
        return self._take_stack_map(f"pystacks{gen}", self.options.python_stack_entries)

    def _take_ustacks(self, gen: int) -> dict[int, bytes]:
        """Read and delete the old generation's unwound stacks: id -> raw
        ``struct flamed_ustack``."""
        return self._take_stack_map(f"ustacks{gen}", self.options.unwind_stack_entries)

    def _take_stack_map(self, name: str, cap: int) -> dict[int, bytes]:
        """Read and delete a (quiescent) hash of stacks the program built, keyed by a u64 hash."""
        table = self._bpf[name]
        vsz = ct.sizeof(table.Leaf)
        kind = name.rstrip("01")
        if kind not in self._stack_bufs:  # once: a drain must not allocate and zero megabytes
            self._stack_bufs[kind] = ((ct.c_uint64 * cap)(), (ct.c_uint8 * (vsz * cap))())
        keys, vals = self._stack_bufs[kind]
        total = self._take_batch(name, table, keys, 8, vals, vsz, cap)
        raw = memoryview(vals)[: total * vsz]
        out = {keys[i]: bytes(raw[i * vsz:(i + 1) * vsz]) for i in range(total)}
        for kb, vb in self._take_rest(table):
            out[int.from_bytes(kb, "little")] = vb
        return out

    def _take_counts(self, gen: int) -> list[tuple[int, int, int, int, bytes, int, int, int]]:
        """Read and delete every entry of the old count map (it is quiescent)."""
        table = self._bpf[f"counts{gen}"]
        keys, vals = self._keys_buf, self._vals_buf
        ksz = _KEY.size
        total = self._take_batch(f"counts{gen}", table, keys, ksz, vals, 8, self.options.max_entries)
        raw = bytes(memoryview(keys).cast("B")[: total * ksz])
        values = memoryview(vals).cast("B")[: total * 8].cast("Q").tolist()
        out = [(*k, n) for k, n in zip(_KEY.iter_unpack(raw), values)]
        out.extend((*_KEY.unpack(kb), int.from_bytes(vb, "little")) for kb, vb in self._take_rest(table))
        return out

    def _take_batch(self, name: str, table: Any, keys: Any, ksz: int, vals: Any, vsz: int, cap: int) -> int:
        """Read and delete entries of a (quiescent) hash map into ``keys``/``vals``,
        one syscall per few thousand entries; how many were read.  Stops early
        where the kernel lacks batch operations: :meth:`_take_rest` reads the rest."""
        lib = self._lib
        fd = table.map_fd
        total = 0
        in_batch = ct.c_uint32(0)  # a bucket index for hash maps
        out_batch = ct.c_uint32(0)
        count = ct.c_uint32(0)
        first = True
        while total < cap:
            count.value = cap - total
            res = lib.bpf_lookup_and_delete_batch(
                fd, None if first else ct.byref(in_batch), ct.byref(out_batch),
                ct.byref(keys, ksz * total), ct.byref(vals, vsz * total), ct.byref(count),
            )
            err = ct.get_errno()
            total += count.value
            if res != 0:
                if err != errno.ENOENT:
                    log.debug("batch lookup-and-delete of %s failed after %d entries (%s); reading key by key",
                              name, total, os.strerror(err))
                break
            in_batch.value = out_batch.value
            first = False
        return total

    def _take_rest(self, table: Any) -> list[tuple[bytes, bytes]]:
        """Whatever :meth:`_take_batch` left (no batch support, a partial batch),
        key by key, as raw (key, value) bytes; when the batch emptied the map
        this is a single get_next_key call."""
        lib = self._lib
        fd = table.map_fd
        key = table.Key()
        nxt = table.Key()
        val = table.Leaf()
        rest: list[tuple[bytes, bytes]] = []
        # Collect first: deleting the current key would restart the walk.
        found: list[bytes] = []
        if lib.bpf_get_next_key(fd, None, ct.byref(nxt)) != 0:
            return rest
        while True:
            found.append(bytes(nxt))
            ct.memmove(ct.byref(key), ct.byref(nxt), ct.sizeof(key))
            if lib.bpf_get_next_key(fd, ct.byref(key), ct.byref(nxt)) != 0:
                break
        for kb in found:
            ct.memmove(ct.byref(key), kb, len(kb))
            if lib.bpf_lookup_elem(fd, ct.byref(key), ct.byref(val)) == 0:
                rest.append((kb, bytes(val)))
                lib.bpf_delete_elem(fd, ct.byref(key))
        return rest

    def _read_stacks(self, gen: int, ids: set[int]) -> dict[int, list[int]]:
        """Stack id -> instruction pointers, leaf first; each entry is deleted as it is read.

        One BPF_MAP_LOOKUP_AND_DELETE_ELEM per stack (stack-trace maps have no
        batch operations) instead of a lookup and a delete: half the system
        calls of a drain with 100,000 stacks.  Kernels that refuse it for
        stack-trace maps get the two calls.
        """
        fd = self._bpf[f"stacks{gen}"].map_fd
        lib = self._lib
        lookup = lib.bpf_lookup_elem
        take = lookup
        if self._lookup_and_delete:
            take = lib.bpf_lookup_and_delete
            take.argtypes, take.restype = [ct.c_int, ct.c_void_p, ct.c_void_p], ct.c_int
        delete = lib.bpf_delete_elem
        buf = self._stack_buf
        pbuf = ct.byref(buf)
        key = ct.c_int(0)
        pkey = ct.byref(key)
        mb = memoryview(buf).cast("B")
        mv = mb.cast("Q")
        zero8 = bytes(8)
        out: dict[int, list[int]] = {}
        separate_delete = take is lookup
        for sid in ids:
            key.value = sid
            if take(fd, pkey, pbuf) != 0:
                if take is not lookup and ct.get_errno() in _NO_LOOKUP_AND_DELETE:
                    log.info("this kernel has no lookup-and-delete on stack-trace maps; using two calls")
                    self._lookup_and_delete = False
                    take, separate_delete = lookup, True
                    if take(fd, pkey, pbuf) != 0:
                        continue
                else:
                    continue
            if separate_delete:
                delete(fd, pkey)
            # The walk ends at the first zero slot: find it in the bytes (C speed)
            # and make ints only of the frames before it.
            raw = mb.tobytes()
            n = raw.find(zero8)
            while n > 0 and n & 7:  # an unaligned run of zero bytes across two addresses
                n = raw.find(zero8, n + 1)
            out[sid] = mv[: n >> 3].tolist() if n >= 0 else mv.tolist()
        return out

    def _clear_stacks(self, gen: int) -> None:
        """Empty what is left of the old generation's stack map: orphans (a
        stack id whose sample was dropped before it was counted) and ids that
        could not be read."""
        fd = self._bpf[f"stacks{gen}"].map_fd
        lib = self._lib
        key = ct.c_int(0)
        pkey = ct.byref(key)
        nxt = ct.c_int(0)
        orphans: list[int] = []
        if lib.bpf_get_next_key(fd, None, ct.byref(nxt)) == 0:
            while True:
                orphans.append(nxt.value)
                key.value = nxt.value
                if lib.bpf_get_next_key(fd, pkey, ct.byref(nxt)) != 0:
                    break
        for sid in orphans:
            key.value = sid
            lib.bpf_delete_elem(fd, pkey)

    # -- symbolization -----------------------------------------------------
    def _comm(self, raw: bytes) -> str:
        c = self._comm_cache.get(raw)
        if c is None:
            c = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if len(self._comm_cache) > 65536:
                self._comm_cache.clear()
            self._comm_cache[raw] = c
        return c

    def _symbolize(
        self,
        keys: list[tuple[int, int, int, int, bytes, int, int, int]],
        raw_events: list[tuple[int, int, int, int, int, int, int, bytes, int]],
        stacks: dict[int, list[int]],
        pystacks: dict[int, bytes] | None = None,
        ustacks: dict[int, bytes] | None = None,
    ) -> tuple[dict[CountKey, int], list[SampleEvent]]:
        sym = self._symbolizer
        assert sym is not None
        kmemo: dict[int, Stack] = {}
        umemo: dict[tuple[int, int], Stack] = {}
        read_failed = ("[lost stack: read failed]",)

        def kstack(kid: int) -> Stack:
            s = kmemo.get(kid)
            if s is None:
                if kid < 0:
                    s = _placeholder(kid, True)
                else:
                    ips = stacks.get(kid)
                    s = sym.kernel_stack(ips) if ips is not None else (read_failed[0] + KERNEL_SUFFIX,)
                kmemo[kid] = s
            return s

        unwinding = self._unwinder is not None

        def ustack(tgid: int, uid: int) -> Stack:
            s = umemo.get((tgid, uid))
            if s is None:
                if uid < 0:
                    s = _placeholder(uid, False)
                else:
                    ips = stacks.get(uid)
                    s = sym.user_stack(tgid, ips) if ips is not None else read_failed
                    if unwinding and s and not is_outermost(s[0]):
                        # A frame-pointer stack where tables are expected: a
                        # process sampled before it was described, or whose
                        # binaries have none.  Its end is not known to be the end.
                        s = (truncated_frame("no_table"),) + s
                umemo[(tgid, uid)] = s
            return s

        nmemo: dict[tuple[int, int], Stack] = {}

        def nstack(tgid: int, nid: int) -> Stack:
            s = nmemo.get((tgid, nid))
            if s is None:
                raw = (ustacks or {}).get(nid)
                if raw is None:
                    s = (_UW_LOST_FRAME,)
                else:
                    ips, end = parse_ustack(raw)
                    s = sym.user_stack(tgid, ips)
                    if end != "complete":
                        s = (truncated_frame(end),) + s
                nmemo[(tgid, nid)] = s
            return s

        py = self._python
        pymemo: dict[tuple[int, int], list[Stack]] = {}
        depth = self.options.python_depth

        def pyruns(tgid: int, pid_: int) -> list[Stack]:
            r = pymemo.get((tgid, pid_))
            if r is None:
                raw = (pystacks or {}).get(pid_)
                if raw is None or py is None:
                    r = [(_PY_LOST_FRAME,)]
                else:
                    frames, flags = parse_pystack(raw, depth)
                    r = py.stack(tgid, frames, flags)
                pymemo[(tgid, pid_)] = r
            return r

        counts: dict[CountKey, int] = {}
        comm = self._comm
        for tgid, tid, kid, uid, rc, pyid, nid, n in keys:
            user = nstack(tgid, nid) if nid else ustack(tgid, uid)
            if pyid:
                stack = splice(user, pyruns(tgid, pyid)) + kstack(kid)
            else:
                stack = user + kstack(kid)
            ck = (tgid, tid, comm(rc), stack or (EMPTY_STACK_FRAME,))
            counts[ck] = counts.get(ck, 0) + n
        events = [
            SampleEvent(
                ktime_ns=kt, tgid=tgid, tid=tid, comm=comm(rc),
                user_stack=nstack(tgid, nid) if nid else ustack(tgid, uid), kernel_stack=kstack(kid), cpu=cpu,
            )
            for kt, tgid, tid, cpu, _gen, kid, uid, rc, nid in raw_events
        ]
        events.sort(key=lambda e: (e.ktime_ns, e.cpu, e.tid))
        return counts, events


# ---------------------------------------------------------------------------
# The daemon's [sampling] table


def options_from_config(cfg: Any) -> BpfSamplerOptions:
    """BpfSamplerOptions from the daemon's ``SamplingConfig`` (or anything with
    the same attribute names).  Empty filter lists mean "no filter"; keys the
    config does not have keep the sampler's defaults."""
    d = BpfSamplerOptions()

    def get(name: str, default: Any) -> Any:
        return getattr(cfg, name, default)

    def filt(name: str) -> frozenset[Any] | None:
        v = get(name, None)
        return frozenset(v) if v else None

    cpus = get("cpus", None)
    bpf_dir = get("bpf_dir", None)
    return BpfSamplerOptions(
        frequency=int(get("frequency", d.frequency)),
        event=str(get("event", d.event)),
        cpus=tuple(cpus) if cpus else None,
        include_idle=bool(get("include_idle", d.include_idle)),
        pids=filt("pids"),
        tids=filt("tids"),
        cgroups=filt("cgroups"),
        comms=filt("comms"),
        stack_storage_size=int(get("stack_map_size", get("stack_storage_size", d.stack_storage_size))),
        stack_depth=int(get("stack_depth", d.stack_depth)),
        max_entries=int(get("counts_map_size", get("max_entries", d.max_entries))),
        ringbuf_pages=int(get("ringbuf_pages", d.ringbuf_pages)),
        prime=bool(get("prime_new_processes", get("prime", d.prime))),
        prime_rate=int(get("prime_rate", d.prime_rate)),
        bpf_dir=Path(bpf_dir) if bpf_dir else None,
    )


def from_config(cfg: Any) -> BpfSampler:
    """The daemon's sampler: a :class:`BpfSampler` for its ``[sampling]`` table."""
    return BpfSampler(options_from_config(cfg))


def program_text_for_config(cfg: Any) -> str:
    """``flamed daemon --print-bpf``: the flags and source that would load."""
    opts = options_from_config(cfg)
    return bpf_program(opts, fsbase_offset=task_fsbase_offset() if opts.python else -1).render()
