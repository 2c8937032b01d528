"""The BPF program: its options, its text, and its life in the kernel.

:class:`BpfSamplerOptions` selects what bpf/profile.bpf.c (plus python.bpf.c
and unwind.bpf.c when on) is compiled with; :func:`bpf_program` is that exact
text and flags (``flamed daemon --print-bpf``).  :class:`KernelProgram` owns
bcc's ``BPF`` object: it compiles and loads the program, opens one perf event
per CPU (and on CPUs that come online later), writes the small maps and tears
it all down.  What is read back out of the maps is flamed.sampling.drain's.
"""

from __future__ import annotations

import ctypes as ct
import errno
import functools
import logging
import os
import platform
import re
import shlex
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from flamed.errors import CapabilityError, ConfigError, FlamedError
from flamed.procstat import effective_caps, kernel_at_least
from flamed.sampling.bpfimage import ChildOutputError, CompileError, ImageCache, ImageError, LoadInfo, image_key, load_bpf
from flamed.sampling.bpfload import adopt, close_bpf, find_bpf_dir
from flamed.sampling.cgroups import CgroupError, CgroupSpec, Hierarchy, parse_cgroup_spec

log = logging.getLogger("flamed.bpf")

MAX_FREQUENCY = 999
#: perf_event_open's type/config for the two events the sampler can use.
PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES = 0, 0
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK = 1, 0
EVENTS = {"cycles": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES), "cpu-clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK)}

# struct flamed_key and struct flamed_event of bpf/flamed.h.
KEY = struct.Struct("<IIii16sQQQQ")
EVENT = struct.Struct("<QIIIIii16sQQQII")
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
    #: cgroup v2 paths (/sys/fs/cgroup/..., /sys/fs/cgroup/unified/...,
    #: /system.slice/x.service), unit names or ids (see
    #: :func:`flamed.sampling.cgroups.parse_cgroup_spec`); a path or unit
    #: stands for its subtree and follows re-creations (a restarted unit).
    cgroups: frozenset[int | str] | None = None
    #: systemd units (nginx.service, a scope, a slice) wherever they are in
    #: the tree; with ``cgroups``, a task in either is sampled.
    units: frozenset[str] | None = None
    #: A path or unit naming no cgroup at start is logged and waited for (the
    #: daemon: the unit may start later) instead of refused as a likely typo.
    cgroups_missing_ok: bool = False
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
    #: Also send every counted sample's time through the ring buffer, so that
    #: the window's ``timeline`` holds each sample with its time and stack
    #: (``flamed record --timeline``); the counts are unchanged.
    timeline: bool = False
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
    #: With ``prime``: have the program report code a process maps after it
    #: was read (an mmap of a file with PROT_EXEC: a library loaded late), and
    #: read its maps again then, so that those frames are named even if it
    #: exits before the drain.  Costs every process on the host a hash lookup
    #: per release of its memory-map lock (0-3 % of a fork+exec here).
    new_code: bool = True
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
    #: Where compiled programs are kept (flamed.sampling.bpfimage): a start
    #: whose program is there needs no compiler.  ``None``: compiled each time.
    bpf_cache_dir: Path | None = None
    #: Compile in a short-lived child process, so that LLVM's memory never
    #: stays in this one (the daemon's choice; ~0.3 s more per compile).
    bpf_compile_isolated: bool = False
    #: Time every walk in the program and report the sum in
    #: ``SamplerStats.unwind_total["UW_NS"]``: for benchmarks.
    unwind_timing: bool = False
    #: Also measure off-CPU time (bpf/offcpu.bpf.c on the sched_switch raw
    #: tracepoint): every wait of a selected task, with its stacks, in
    #: ``Window.offcpu`` (ns).  See docs/offcpu.md.
    offcpu: bool = False
    #: Shortest wait counted, in microseconds (shorter ones are counted in
    #: ``offcpu_total["OFF_BELOW"]`` only).
    offcpu_min_us: int = 1000
    #: Waits open at once (one per waiting selected thread); beyond it a
    #: wait is lost (``OFF_START_FULL``).
    offcpu_starts: int = 16384
    #: Distinct off-CPU keys per generation (``OFF_MAP_FULL`` beyond).
    offcpu_entries: int = 16384
    #: Waits spanning a drain, per generation (``OFF_CARRY_FULL`` beyond).
    offcpu_carried: int = 4096
    #: With the pid filter (``pids``): a process that a filtered process
    #: starts (fork, vfork, clone without CLONE_THREAD) is filtered in by the
    #: program itself from its first instruction, and leaves the filter when
    #: it exits (bpf/profile.bpf.c, flamed_forked/flamed_exited): what a
    #: command starts is sampled before user space could know of it.
    follow_forks: bool = False
    #: Remember one switch-out in N, at random, and count its wait N times:
    #: the stack walks at switch-out are the cost (bench/offcpu.py).  1: all.
    offcpu_every: int = 1

    @property
    def filters_cgroups(self) -> bool:
        return self.cgroups is not None or self.units is not None

    def cgroup_specs(self, hierarchy: Hierarchy | None = None) -> tuple[CgroupSpec, ...]:
        """``cgroups`` and ``units`` parsed, in a stable order; :class:`CgroupError` says what to write.

        The one parser of these keys: ``flamed daemon --check-config`` and the
        daemon's start go through it, so a spec passes both or neither.
        """
        specs = [parse_cgroup_spec(c, hierarchy, key="cgroups") for c in sorted(self.cgroups or (), key=str)]
        for u in sorted(self.units or ()):
            spec = parse_cgroup_spec(u, hierarchy, key="units")
            if spec.kind != "unit":
                raise CgroupError(f"units: {u!r}: not a unit name; write e.g. nginx.service or "
                                  "getty@.service here, and paths or ids in cgroups")
            specs.append(spec)
        return tuple(specs)

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
        for name in ("pids", "tids", "cgroups", "units", "comms"):
            v = getattr(self, name)
            if v is not None and len(v) > self.filter_max:
                raise bad(name, f"more entries than filter_max={self.filter_max}")
        self.cgroup_specs()
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
        if self.follow_forks and self.pids is None:
            raise bad("follow_forks", "needs the pid filter (pids=frozenset() at least)")
        if not 0 <= self.offcpu_min_us <= 3_600_000_000:
            raise bad("offcpu_min_us", "must be 0..3600000000 microseconds")
        for name in ("offcpu_starts", "offcpu_entries", "offcpu_carried", "offcpu_every"):
            if not 1 <= getattr(self, name) <= 1 << 22:
                raise bad(name, "must be 1..4194304")


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


def bpf_program(options: BpfSamplerOptions = BpfSamplerOptions(), *, fsbase_offset: int = -1,
                pid_offset: int = -1) -> BpfProgram:
    """The program and -D flags the options select (reads the files).

    ``fsbase_offset``: where the running kernel keeps a task's fs base in
    ``task_struct`` (from its BTF, :func:`task_fsbase_offset`), for matching
    the threads of CPython 3.8-3.10; -1: unknown.  ``pid_offset``: where it
    keeps the task's pid (:func:`task_pid_offset`), which off-CPU and
    ``follow_forks`` need (:func:`needs_pid_offset`).
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
        if options.offcpu:
            op = d / "offcpu.bpf.c"
            parts.append((op, op.read_text()))
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
        "FLAMED_TIMELINE": int(options.timeline),
        "FLAMED_FILTER_MAX": options.filter_max,
        "FLAMED_INCLUDE_IDLE": int(options.include_idle),
        "FLAMED_FILTER_PIDS": int(options.pids is not None),
        "FLAMED_FILTER_TIDS": int(options.tids is not None),
        "FLAMED_FILTER_CGROUPS": int(options.filters_cgroups),
        "FLAMED_FILTER_COMMS": int(options.comms is not None),
        "FLAMED_PRIME": int(options.prime),
        "FLAMED_SEEN_MAX": options.seen_max,
        "FLAMED_TASK_EXEC_ID_OFF": task_exec_id_offset() if options.prime else -1,
        "FLAMED_PYTHON": int(options.python),
        "FLAMED_UNWIND": int(options.unwind),
        "FLAMED_FOLLOW_FORKS": int(options.follow_forks),
    }
    if needs_pid_offset(options):
        defines["FLAMED_TASK_PID_OFF"] = pid_offset
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
            "FLAMED_UW_MAPS": options.unwind_maps,
            "FLAMED_UW_MAX_PROCS": options.unwind_max_procs,
            "FLAMED_UW_STACK_ENTRIES": options.unwind_stack_entries,
            "FLAMED_UW_TIMING": int(options.unwind_timing),
        })
    if options.offcpu:
        defines.update({
            "FLAMED_OFFCPU": 1,
            "FLAMED_OFF_MIN_NS": options.offcpu_min_us * 1000,
            "FLAMED_OFF_STARTS": options.offcpu_starts,
            "FLAMED_OFF_ENTRIES": options.offcpu_entries,
            "FLAMED_OFF_CARRIED": options.offcpu_carried,
            "FLAMED_OFF_EVERY": options.offcpu_every,
            "FLAMED_GIL_WAIT": int(options.python and gil_wait_supported()),
        })
    cflags = (f"-I{d}", *(f"-D{k}={v}" for k, v in defines.items()))
    return BpfProgram(path=path, text=text, cflags=cflags, header_path=header, header=header_text,
                      parts=tuple(parts))


def gil_wait_supported() -> bool:
    """Can the off-CPU program tell GIL waits (docs/offcpu.md)?  It reads the
    futex(2) number and address from x86-64 user registers through
    bpf_task_pt_regs(), which kernels have from 5.15."""
    return platform.machine() == "x86_64" and kernel_at_least(5, 15)


@functools.cache
def task_fsbase_offset() -> int:
    """Offset of ``thread.fsbase`` in the running kernel's ``task_struct``
    (from /sys/kernel/btf/vmlinux), or -1 with a logged reason.  Read once
    per process (~0.15 s: `record` asks before and while it loads)."""
    try:
        from flamed.sampling.cpython import btf

        return int(btf.fsbase_offset())
    except Exception as e:  # noqa: BLE001 -- only 3.8-3.10 thread matching needs it
        log.warning("no task_struct fs base offset from the kernel's BTF (%s): threads of CPython "
                    "3.8-3.10 cannot be matched in BPF", e)
        return -1


@functools.cache
def task_exec_id_offset() -> int:
    """Offset of ``self_exec_id`` in the running kernel's ``task_struct`` (from
    /sys/kernel/btf/vmlinux), which every exec advances, or -1 (logged): then a
    process that execs without changing its comm (a program that execs itself)
    is not reported as a new image, and is described again only after the
    drains that follow the exec."""
    try:
        from flamed.sampling.cpython import btf

        return int(btf.Btf.load().member_offset("task_struct", "self_exec_id"))
    except Exception as e:  # noqa: BLE001 -- only the report of such execs needs it
        log.info("no task_struct self_exec_id offset from the kernel's BTF (%s): a process that execs "
                 "under the same name is described again only after the next drains", e)
        return -1


def needs_pid_offset(options: BpfSamplerOptions) -> bool:
    """Do the options' programs read a task's pid from ``task_struct``?"""
    return options.offcpu or options.follow_forks


@functools.cache
def task_pid_offset() -> int:
    """Offset of ``pid`` in the running kernel's ``task_struct`` (from
    /sys/kernel/btf/vmlinux); CapabilityError when the BTF does not say."""
    try:
        from flamed.sampling.cpython import btf

        return int(btf.Btf.load().member_offset("task_struct", "pid"))
    except Exception as e:  # noqa: BLE001 -- any failure means the same: off-CPU cannot run
        raise CapabilityError(f"off-CPU and following forks need task_struct.pid's offset from the kernel's BTF "
                              f"(/sys/kernel/btf/vmlinux): {e}") from None


def program_is_cached(options: BpfSamplerOptions) -> bool:
    """Does ``options.bpf_cache_dir`` hold this program compiled?  Found
    without importing bcc, so that a caller can load it over bcc's runtime
    library only (flamed.sampling.bpfimage.runtime_only)."""
    if options.bpf_cache_dir is None:
        return False
    try:
        prog = bpf_program(options, fsbase_offset=task_fsbase_offset() if options.python else -1,
                           pid_offset=task_pid_offset() if needs_pid_offset(options) else -1)
    except FlamedError:
        return False
    try:
        return ImageCache(options.bpf_cache_dir).path(image_key(prog.source, prog.cflags)).is_file()
    except OSError:
        # A cache this user may not look into (another user's, e.g. root's under a HOME
        # kept by sudo or setpriv) holds nothing for it: not cached.
        return False


def print_bpf(options: BpfSamplerOptions = BpfSamplerOptions(), file: TextIO | None = None) -> None:
    fs = task_fsbase_offset() if options.python else -1
    pid = task_pid_offset() if needs_pid_offset(options) else -1
    (file or sys.stdout).write(bpf_program(options, fsbase_offset=fs, pid_offset=pid).render())


def stat_indices(header: Path) -> dict[str, int]:
    """FLAMED_STAT_* from flamed.h, the one place they are defined."""
    found = {m[1]: int(m[2]) for m in re.finditer(r"\bFLAMED_STAT_(\w+)\s*=\s*(\d+)", header.read_text())}
    n = re.search(r"\bFLAMED_NSTATS\s*=\s*(\d+)", header.read_text())
    if not found or n is None:
        raise FlamedError(f"{header}: no FLAMED_STAT_* indices found")
    found["__N__"] = int(n[1])
    return found


# ---------------------------------------------------------------------------
# Helpers around bcc


def _check_privileges() -> None:
    caps = effective_caps() or 0

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


def _check_pid_namespace(proc: str = "/proc") -> None:
    """Refuse a /proc that does not show the host's pids: the kernel names
    every sampled process by its pid in the initial PID namespace, so in a
    container with a PID namespace (and /proc) of its own no sample would be
    attributed, and a pid could name another process there."""
    from flamed.sampling.cpython.process import pid_namespace

    # The namespace of the /proc mounted here is its pid 1's (else, unreadable, our own).
    ns = pid_namespace(Path(proc), 1) or pid_namespace(Path(proc), "self")
    if ns is not None and ns != (0, 0):
        raise CapabilityError(
            f"{proc} here shows the processes of a PID namespace other than the host's (a container "
            "without the host's PID namespace?): the kernel names sampled processes by their host pids, "
            "which it does not show, so no sample could be attributed; run flamed in the host's PID "
            "namespace (docker run --pid=host, Kubernetes hostPID: true)"
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
    """Run ``fn`` with fd 2 captured: clang and libbpf report there, not in exceptions.
    The log's lines (a stderr handler of the ``flamed`` logger: the daemon's, off
    systemd) go past the capture meanwhile, not into it: a warning said during the
    load (an untrusted compiled-program cache) was lost with the captured text."""
    from flamed.daemon.logs import logs_past_fd2

    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp, logs_past_fd2():
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


#: The BPF maps whose size a setting gives, by name without the generation
#: digit: (the daemon's setting, the BpfSamplerOptions field it sets).
MAP_SIZE_SETTINGS = {
    "counts": ("sampling.counts_map_size", "max_entries"),
    "stacks": ("sampling.stack_map_size", "stack_storage_size"),
    "pystacks": ("sampling.python_stack_map_size", "python_stack_entries"),
    "ustacks": ("sampling.unwind_stack_map_size", "unwind_stack_entries"),
}
#: bcc's words when the kernel refuses to create a map of the program.
_MAP_REFUSED = re.compile(r"could not open bpf map: (\w+), error: ([^\n]+)")


def map_refused(text: str, options: BpfSamplerOptions) -> str:
    """What bcc's output ``text`` says of a map the kernel would not create, with
    the setting that sizes it; "" when it says nothing of the kind.  (bcc
    reports it as a failed compile, which sent users to the kernel headers.)"""
    m = _MAP_REFUSED.search(text)
    if m is None:
        return ""
    name, why = m.group(1), m.group(2).strip()
    known = MAP_SIZE_SETTINGS.get(name.rstrip("01"))
    if known is None:
        return f"the kernel would not create the BPF map {name}: {why}"
    setting, field = known
    return (f"the kernel would not create the BPF map {name} of {getattr(options, field)} entries: {why}; "
            f"{setting} sizes it (two such maps, one per generation): set it smaller")


def _tail(text: str, lines: int = 12) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n  ".join(kept[-lines:])


def _load_funcs(b: Any, wanted: list[tuple[bytes, int, str]]) -> list[tuple[Any, BaseException | None]]:
    """``b.load_func`` of each (name, type) in its own thread: (function, error) each."""
    def one(item: tuple[bytes, int, str]) -> tuple[Any, BaseException | None]:
        try:
            return b.load_func(item[0], item[1]), None
        except Exception as e:  # noqa: BLE001 -- bcc raises plain Exception
            return None, e

    if len(wanted) == 1:
        return [one(wanted[0])]
    with ThreadPoolExecutor(max_workers=min(len(wanted), os.cpu_count() or 1), thread_name_prefix="flamed-verify") as ex:
        return list(ex.map(one, wanted))


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



# ---------------------------------------------------------------------------
# The program in the kernel


class KernelProgram:
    """bcc's ``BPF`` object of one sampler: compiled and loaded by :meth:`load`,
    sampling once :meth:`attach` opened a perf event per CPU, gone after
    :meth:`close`.

    ``bpf`` is ``None`` before :meth:`load` and after :meth:`close`, and every
    map write is done by a holder of the sampler's lock that checked it.
    """

    def __init__(self, options: BpfSamplerOptions) -> None:
        self.options = options
        self.bpf: Any = None
        self.lib: Any = None  # bcc's libbcc, for the calls bcc's Python side does not offer
        self.prog_fd = -1
        #: FLAMED_STAT_* indices of the loaded header, and ``__N__``.
        self.stat_idx: dict[str, int] = {}
        #: ``cycles`` or ``cpu-clock`` once attached.
        self.event_name = ""
        #: Set by :meth:`stop`: CPUs coming online then stay unattached.
        self.stopped = False
        self._perf_fds: dict[int, int] = {}
        #: Raw tracepoints with a program attached (off-CPU, new code).
        self._raw_attached: list[bytes] = []
        #: How :meth:`load` got the program: from the cache, or compiled.
        self.load_info: LoadInfo | None = None

    @property
    def cpus(self) -> tuple[int, ...]:
        """The CPUs with a perf event open."""
        return tuple(sorted(self._perf_fds))

    def load(self, fsbase_offset: Callable[[], int]) -> None:
        """Compile and load the program (``fsbase_offset`` is asked once the
        privileges are known to be there); raise CapabilityError saying why not."""
        bcc = _import_bcc()
        _check_privileges()
        _check_pid_namespace()
        pid_off = task_pid_offset() if needs_pid_offset(self.options) else -1
        prog = bpf_program(self.options, fsbase_offset=fsbase_offset(), pid_offset=pid_off)
        self.stat_idx = stat_indices(prog.path.parent / "flamed.h")
        made, text, err = _with_captured_stderr(
            lambda: load_bpf(prog.source, prog.cflags, cache_dir=self.options.bpf_cache_dir,
                             isolated=self.options.bpf_compile_isolated)
        )
        if err is not None or made is None:
            refused = map_refused(f"{err}\n{text}", self.options)
            if refused:
                raise CapabilityError(f"cannot load {prog.path}: {refused}")
            if isinstance(err, ChildOutputError):  # the child's image did not arrive whole, twice: not final
                raise FlamedError(f"cannot compile {prog.path}: {err}; the program is not at fault (a restart "
                                  "compiles it again)")
            if isinstance(err, CompileError):  # compiled in a child process, which failed
                raise CapabilityError(f"bcc could not compile {prog.path} ({_headers_hint()}):\n  {err}")
            if isinstance(err, ImageError):  # the program compiled, its image did not load
                raise CapabilityError(f"cannot load the compiled {prog.path}: {err}")
            raise CapabilityError(
                f"bcc could not compile {prog.path} ({_headers_hint()}):\n  {_tail(text) or err}"
            )
        b, self.load_info = made
        self.bpf = adopt(b)  # its exit cleanup is flamed's (quiet without tracefs)
        from bcc.libbcc import lib

        self.lib = lib
        # The verifier runs in the loading thread, and ctypes lets go of the
        # GIL: the programs are verified side by side (0.97 s one after
        # another on this 2-core machine for the full set, 0.55 s together).
        wanted = [(b"flamed_sample", bcc.BPF.PERF_EVENT, "the BPF program (verifier or privileges)")]
        if self.options.unwind:
            wanted += [(n, bcc.BPF.PERF_EVENT, f"the unwinder's program {n.decode()} (verifier)")
                       for n in (b"flamed_unwind", b"flamed_finish")]
        if self.options.python:  # tail-called at the end of a sample that stored a new Python stack
            wanted.append((b"flamed_pyguard", bcc.BPF.PERF_EVENT, "the Python guard program (verifier)"))
        if self.options.prime and self.options.new_code:  # attached with the perf events
            wanted.append((b"flamed_code_mapped", bcc.BPF.RAW_TRACEPOINT, "the new-code program (verifier)"))
        if self.options.offcpu:  # loaded (verified) now, attached with the perf events
            wanted.append((b"flamed_offcpu", bcc.BPF.RAW_TRACEPOINT, "the off-CPU program (verifier)"))
        if self.options.follow_forks:  # attached with the perf events
            wanted += [(n, bcc.BPF.RAW_TRACEPOINT, f"the fork-following program {n.decode()} (verifier)")
                       for n in (b"flamed_forked", b"flamed_exited")]
        loaded, text, err = _with_captured_stderr(lambda: _load_funcs(b, wanted))
        for (name, _kind, what), (fn, ferr) in zip(wanted, loaded or [(None, err)] * len(wanted)):
            if ferr is not None or fn is None:
                raise CapabilityError(f"the kernel refused {what}:\n  {_tail(text) or ferr or err}")
        self.prog_fd = loaded[0][0].fd
        if self.options.unwind:
            progs = b["uw_progs"]
            for i in range(2):
                progs[ct.c_int(i)] = ct.c_int(loaded[1 + i][0].fd)
        if self.options.python:
            at = [n for n, _k, _w in wanted].index(b"flamed_pyguard")
            b["py_progs"][ct.c_int(0)] = ct.c_int(loaded[at][0].fd)
        self._check_layout()

    def fill_filters(self) -> None:
        """The filters fixed by the options: tids, comms (the pid filter
        changes while sampling: the process manager writes it; the cgroup
        filter follows re-created cgroups: :meth:`update_cgroup_filter`)."""
        for t in self.options.tids or ():
            self.map_set("filter_tids", t, ct.c_uint32)
        comms = self.bpf["filter_comms"]
        for c in self.options.comms or ():
            k = comms.Key()
            k.comm = c.encode()
            comms[k] = comms.Leaf(1)

    def _check_layout(self) -> None:
        """The ctypes/struct mirrors must match what clang laid out."""
        got = ct.sizeof(self.bpf["counts0"].Key)
        if got != KEY.size:
            raise FlamedError(f"struct flamed_key is {got} bytes in BPF, {KEY.size} in Python: rebuild both")

    def attach(self) -> None:
        """Open the perf events on every CPU sampled: the program runs from now."""
        wanted = self.options.event
        cpus = list(self.options.cpus) if self.options.cpus is not None else online_cpus()
        order = ["cycles", "cpu-clock"] if wanted == "auto" else [wanted]
        last_err = 0
        errors: dict[str, int] = {}
        for name in order:
            ok, last_err = self._attach_event(name, cpus)
            if ok:
                self.event_name = name
                self._attach_offcpu()
                self._attach_code_mapped()
                self._attach_forks()
                if "cycles" in errors:
                    log.info(
                        "hardware event cpu-cycles unavailable (%s); sampling with the software cpu-clock",
                        os.strerror(errors["cycles"]),
                    )
                log.info("sampling %s at %d Hz on CPUs %s", name, self.options.frequency, self.cpus)
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

    def _attach_raw(self, tp: bytes, fn_name: bytes) -> str | None:
        """Attach ``fn_name`` to the raw tracepoint ``tp`` (then in
        :attr:`_raw_attached`, for :meth:`detach`): None, or why not."""
        if tp in self._raw_attached:
            return None
        _, text, err = _with_captured_stderr(lambda: self.bpf.attach_raw_tracepoint(tp=tp, fn_name=fn_name))
        if err is not None:
            return _tail(text) or str(err)
        self._raw_attached.append(tp)
        return None

    def _attach_offcpu(self) -> None:
        if not self.options.offcpu:
            return
        err = self._attach_raw(b"sched_switch", b"flamed_offcpu")
        if err is not None:
            self.detach()
            raise CapabilityError(f"cannot attach the off-CPU program to the sched_switch raw tracepoint "
                                  f"(needs BTF raw tracepoints, kernel >= 4.17): {err}")

    def _attach_code_mapped(self) -> None:
        """The report of code mapped after a process was read (bpf/profile.bpf.c,
        flamed_code_mapped): without it sampling goes on, and libraries loaded
        late are named only for processes alive at the drain."""
        if not (self.options.prime and self.options.new_code):
            return
        err = self._attach_raw(b"mmap_lock_released", b"flamed_code_mapped")
        if err is not None:
            log.warning("no report of code mapped after start (the mmap_lock_released raw tracepoint: %s): "
                        "libraries that processes load later are named only if they live until a drain", err)

    def _attach_forks(self) -> None:
        """``follow_forks``: the programs that filter in what a filtered process
        starts, and let it go at its exit.  Without them sampling goes on, and
        a process is sampled from when user space adds it."""
        if not self.options.follow_forks:
            return
        for tp, fn in ((b"sched_process_exit", b"flamed_exited"), (b"task_newtask", b"flamed_forked")):
            err = self._attach_raw(tp, fn)
            if err is not None:
                log.warning("cannot follow forks in BPF (the %s raw tracepoint: %s): a new process is sampled "
                            "from when it is found (its exec, or a scan of /proc)", tp.decode(), err)
                return

    def _attach_event(self, name: str, cpus: Iterable[int]) -> tuple[bool, int]:
        ev_type, ev_config = EVENTS[name]
        opened: dict[int, int] = {}
        for cpu in cpus:
            fd = self._open_perf(ev_type, ev_config, cpu)
            if fd < 0:
                err = -fd
                for f in opened.values():
                    self.lib.bpf_close_perf_event_fd(f)
                return False, err
            opened[cpu] = fd
        self._perf_fds.update(opened)
        return True, 0

    def _open_perf(self, ev_type: int, ev_config: int, cpu: int) -> int:
        """fd, or -errno."""

        def call() -> int:
            # Explicit ctypes: bcc declares no argtypes for this function.
            fd: int = self.lib.bpf_attach_perf_event(
                ct.c_int(self.prog_fd), ct.c_uint32(ev_type), ct.c_uint32(ev_config),
                ct.c_uint64(0), ct.c_uint64(self.options.frequency),
                ct.c_int(-1), ct.c_int(cpu), ct.c_int(-1),
            )
            return fd if fd >= 0 else -(ct.get_errno() or errno.EINVAL)

        fd, _text, _err = _with_captured_stderr(call)
        return int(fd) if fd is not None else -errno.EINVAL

    def refresh_cpus(self) -> bool:
        """Attach to CPUs that came online since the last look; did any?"""
        if self.options.cpus is not None or not self.event_name or self.stopped:
            return False
        try:
            new = [c for c in online_cpus() if c not in self._perf_fds]
        except OSError:
            return False
        if new:
            ok, err = self._attach_event(self.event_name, new)
            if ok:
                log.info("CPUs %s came online: sampling them too", new)
                return True
            log.warning("could not attach to new CPUs %s: %s", new, os.strerror(err))
        return False

    def detach(self) -> None:
        """Close the perf events: the program runs no more, its maps stay."""
        for fd in self._perf_fds.values():
            self.lib.bpf_close_perf_event_fd(fd)
        self._perf_fds.clear()
        while self._raw_attached:
            tp = self._raw_attached.pop()
            try:
                self.bpf.detach_raw_tracepoint(tp=tp)
            except Exception as e:  # noqa: BLE001 -- bcc raises plain Exception; detaching must not fail a stop
                log.debug("detaching the program of the raw tracepoint %s: %s", tp.decode(), e)

    def stop(self) -> None:
        """Detach for good (a last drain may still read the maps)."""
        self.detach()
        self.stopped = True

    def close(self) -> None:
        """Unload the program and free its maps (detach first)."""
        if self.bpf is not None:
            try:
                close_bpf(self.bpf)
            finally:
                self.bpf = None

    # -- small map helpers -------------------------------------------------
    def update_cgroup_filter(self, add: Iterable[int], remove: Iterable[int] = ()) -> None:
        """Add and delete cgroup ids of the filter map (deletes first: the map has ``filter_max`` entries)."""
        for cg in remove:
            self.map_del("filter_cgroups", cg, ct.c_uint64)
        for cg in add:
            self.map_set("filter_cgroups", cg, ct.c_uint64)

    def map_set(self, name: str, key: int, ktype: Any) -> None:
        t = self.bpf[name]
        t[ktype(key)] = t.Leaf(1)

    def map_del(self, name: str, key: int, ktype: Any) -> None:
        t = self.bpf[name]
        try:
            del t[ktype(key)]
        except KeyError:
            pass

    def array_set(self, name: str, index: int, value: int) -> None:
        """Element ``index`` of the u32 array map ``name``."""
        self.bpf[name][ct.c_int(index)] = ct.c_uint32(value)

    def write_gen(self, gen: int) -> None:
        self.array_set("generation", 0, gen)

    def read_percpu(self, name: str, index: int) -> list[int]:
        return [int(v) for v in self.bpf[name][ct.c_int(index)]]

