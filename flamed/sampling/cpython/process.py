"""Is this pid a CPython process flamed can walk, and where is its runtime?

:func:`probe` decides from /proc/PID/maps and cached ELF facts of the mapped
files, without reading the process's memory (except 3.13's
``_Py_DebugOffsets``, read from the process once it is known to be 3.13), so
the common case -- a process that is not Python -- costs a maps read and a
cache look-up.  The interpreter is the file that holds ``_PyRuntime``: the
executable of a static build (Debian's /usr/bin/python3.X, non-PIE, symbols
in .dynsym) or a mapped libpython3.X.so (pyenv's shared builds).
:meth:`Target.state` says whether the interpreter is initialized yet and
:meth:`Target.validate` walks every thread in user space and refuses a
layout that reads garbage.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flamed.sampling.cpython import elf
from flamed.sampling.cpython.errors import CPythonError
from flamed.sampling.cpython.layout import (
    DEBUG_OFFSETS_SIZE_313,
    DEBUG_OFFSETS_VERSIONS,
    Layout,
    debug_offsets_version,
    layout_for,
    layout_from_debug_offsets,
)
from flamed.sampling.cpython.memory import ProcessMemory
from flamed.sampling.cpython.objects import read_unicode
from flamed.sampling.cpython.walk import MAX_DEPTH, MAX_THREADS, Frame, Walk, walk_memory
from flamed.sampling.mappedfile import DELETED, mapped_file

#: Thread states validation reads (the newest ones)
VALIDATE_THREADS = 64
from flamed.sampling.symbols import read_identity

PAGE = 4096
_LIB_RE = re.compile(r"libpython(\d)\.(\d+)[a-z]*\.so")
_EXE_RE = re.compile(r"python(\d)\.(\d+)[a-z]*$")
#: Names of the outermost frame of a main thread running its main module
#: (a script or -c; ``python -m`` starts in runpy).
MAIN_OUTERMOST = frozenset({"<module>", "_run_module_as_main"})


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str


def read_maps(pid: int, proc: Path) -> list[Mapping] | None:
    """Every file-backed mapping of ``pid`` (None when the process is gone)."""
    try:
        text = (proc / str(pid) / "maps").read_text(errors="surrogateescape")
    except OSError:
        return None
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, _, hi = parts[0].partition("-")
        try:
            out.append(Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), int(parts[4]), parts[5]))
        except ValueError:
            continue
    return out


@dataclass(frozen=True, slots=True)
class State:
    """``ready``: walkable now; ``not_yet``: retry later; ``invalid``: give up (``reason``)."""

    kind: Literal["ready", "not_yet", "invalid"]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``pid`` is not walked. ``not_yet``: it may become walkable (probe again)."""

    pid: int
    reason: str
    not_yet: bool = False
    #: A CPython whose version the walker has no layout for (2.7, 3.7...): the version
    version: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """A CPython process whose frames can be walked."""

    pid: int
    #: /proc/PID/stat field 22: tells a reused pid from this process
    start_time: int
    version: tuple[int, int]
    #: PY_VERSION_HEX when the binary says it (Py_Version, 3.11+), else None
    hexversion: int | None
    #: the file holding _PyRuntime (executable or libpython) as the maps show it
    interpreter: str
    runtime_addr: int
    layout: Layout
    proc_root: Path = Path("/proc")
    #: (kernel dev_t, inode) of the process's PID namespace when it is not the
    #: initial one (a container): its 3.11+ thread states hold that namespace's tids
    pid_ns: tuple[int, int] = (0, 0)
    #: st_size of the _PyRuntime symbol (0 if the table does not say)
    runtime_size: int = 0

    @property
    def gil_range(self) -> tuple[int, int]:
        """Where the main interpreter's GIL lives: inside _PyRuntime on 3.8-3.13
        (``ceval.gil`` up to 3.11, ``_main_interpreter._gil`` from 3.12)."""
        if not self.runtime_size or self.version >= (3, 14) or self.version < (3, 8):
            return (0, 0)
        return (self.runtime_addr, self.runtime_addr + self.runtime_size)

    @property
    def interp_head_addr(self) -> int:
        """Where ``_PyRuntime.interpreters.head`` is: the newest interpreter."""
        return self.runtime_addr + self.layout.runtime_interp_head

    @property
    def interp_addr(self) -> int:
        """Where ``_PyRuntime.interpreters.main`` is: the interpreter whose
        threads are walked (in BPF and from user space)."""
        return self.runtime_addr + self.layout.runtime_interp_main

    @property
    def in_pid_namespace(self) -> bool:
        return self.pid_ns != (0, 0)

    def pack(self) -> bytes:
        """The ``struct flamed_pyproc`` of this process for the BPF map."""
        return self.layout.pack(self.interp_addr, self.pid_ns, self.gil_range)

    def memory(self) -> ProcessMemory:
        return ProcessMemory(self.pid)

    def thread_states(self, memory: ProcessMemory | None = None, *, max_threads: int = 16384) -> dict[int, int]:
        """Host tid -> PyThreadState address of every thread whose state
        names its tid (3.11+; {} before, or when unreadable).  The BPF walker
        searches a thread list a bounded part per sample; a pool's old
        threads, at the list's end, are found at once when seeded from this."""
        if self.layout.tstate_native_thread_id is None:
            return {}
        result = walk_memory(memory or self.memory(), self.layout, self.interp_addr,
                             max_threads=max_threads, max_depth=0)
        if result is None:
            return {}
        by_id = {t.native_thread_id: t.tstate for t in result.threads if t.native_thread_id}
        if not self.in_pid_namespace:
            return {tid: ts for tid, ts in by_id.items() if ts}
        out: dict[int, int] = {}
        task_dir = self.proc_root / str(self.pid) / "task"
        try:
            tids = [int(n) for n in os.listdir(task_dir)]
        except (OSError, ValueError):
            return {}
        for tid in tids:
            ids = nspids(task_dir / str(tid) / "status")
            if ids and ids[-1] in by_id:
                out[tid] = by_id[ids[-1]]
        return out

    def state(self, memory: ProcessMemory | None = None) -> State:
        """Is the interpreter initialized (an interpreter with a thread state)?"""
        mem = memory or self.memory()
        raw = mem.read(self.interp_addr, 8)
        if raw is None:
            return State("invalid", f"cannot read _PyRuntime of pid {self.pid} (errno {mem.last_errno})")
        head = struct.unpack("<Q", raw)[0]
        if head == 0:
            return State("not_yet", "Py_Initialize has not created the interpreter yet")
        raw = mem.read(head + self.layout.interp_threads_head, 8)
        if raw is None:
            return State("invalid", f"interpreters.main 0x{head:x} is not readable")
        if struct.unpack("<Q", raw)[0] == 0:
            return State("not_yet", "the interpreter has no thread state yet")
        return State("ready")

    def validate(self, memory: ProcessMemory | None = None) -> State:
        """:meth:`state`, then walk every thread and check what the layout read makes sense."""
        mem = memory or self.memory()
        st = self.state(mem)
        if st.kind != "ready":
            return st
        # Validation looks at the newest threads only (the list is newest
        # first): a pool of thousands is walked in BPF a bounded part per sample.
        result = walk_memory(mem, self.layout, self.interp_addr, max_threads=VALIDATE_THREADS)
        if result is None:
            return State("invalid", "interpreters.main became unreadable")
        if result.threads and not any(t.frames for t in result.threads) and not any(t.truncated for t in result.threads):
            # Nothing to check a frame offset against (starting up, finalizing,
            # or blocked outside Python): a wrong layout would pass.  Later.
            return State("not_yet", "no Python frame yet to validate the layout against")
        problem = self._check_walk(mem, result)
        if problem:
            return State("invalid", f"CPython {self.version[0]}.{self.version[1]} layout does not validate: {problem}")
        return State("ready")

    def _check_walk(self, mem: ProcessMemory, result: Walk) -> str:
        if not result.threads:
            return "no thread state"
        if result.truncated:
            return "the thread list is unreadable"
        tasks = _tasks(self.proc_root, self.pid, namespaced=self.in_pid_namespace)
        anon = _all_ranges(self.proc_root, self.pid)
        code_type = 0
        for t in result.threads:
            if t.interp != result.head:
                return f"thread state 0x{t.tstate:x}: interp 0x{t.interp:x} is not the interpreter 0x{result.head:x}"
            if t.native_thread_id is not None and t.native_thread_id not in tasks:
                where = " in its PID namespace" if self.in_pid_namespace else ""
                return (f"thread state 0x{t.tstate:x}: native_thread_id {t.native_thread_id} "
                        f"is not a task of the process{where}")
            if t.native_thread_id is None and not any(lo <= t.thread_id < hi for lo, hi in anon):
                return f"thread state 0x{t.tstate:x}: thread_id 0x{t.thread_id:x} is not a mapped address"
            if t.truncated:
                return f"thread state 0x{t.tstate:x}: a frame is unreadable"
            for code_addr, _instr in t.frames:
                code = code_addr & ~1
                raw = mem.read(code + self.layout.object_type, 8)
                if raw is None:
                    return f"frame code object 0x{code:x} is unreadable"
                ob_type = struct.unpack("<Q", raw)[0]
                if code_type == 0:
                    if _type_name(mem, self.layout, ob_type) != b"code":
                        return f"frame object 0x{code:x} is not a code object (its type is not 'code')"
                    code_type = ob_type
                elif ob_type != code_type:
                    return f"frame object 0x{code:x} has type 0x{ob_type:x}, not the code type 0x{code_type:x}"
        # The first thread state created (the main thread's) is last in the list.
        main = result.threads[-1]
        if (main.frames and not main.deep and not result.bounded
                and _EXE_RE.search(_exe(self.proc_root, self.pid).removesuffix(DELETED))):
            # Only that it names something: during start-up (site, the
            # importer) and in embedded interpreters the outermost frame is
            # not the main module's, so '<module>' cannot be required.
            name = _code_name(mem, self.layout, main.frames[-1][0] & ~1)
            if not name:
                return "the main thread's outermost frame has no readable name"
        return ""


def _tasks(proc: Path, pid: int, *, namespaced: bool = False) -> set[int]:
    """The process's tids; for a process in its own PID namespace, the ids
    that namespace gives them (the last of each task's ``NSpid:``), which is
    what its interpreter stores."""
    try:
        tids = [int(n) for n in os.listdir(proc / str(pid) / "task")]
    except (OSError, ValueError):
        return set()
    if not namespaced:
        return set(tids)
    out: set[int] = set()
    for tid in tids:
        ids = nspids(proc / str(pid) / "task" / str(tid) / "status")
        if ids:
            out.add(ids[-1])
    return out


#: The inode of the initial PID namespace (PROC_PID_INIT_INO): the one whose
#: ids the BPF program's bpf_get_current_pid_tgid() gives.
INIT_PID_NS_INO = 0xEFFFFFFC


def nspids(status: Path) -> list[int]:
    """The ``NSpid:`` ids of a /proc status file, outermost namespace first ([] if unreadable)."""
    try:
        with open(status, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def pid_namespace(proc: Path, pid: int | Literal["self"]) -> tuple[int, int] | None:
    """(kernel dev_t, inode) of ``pid``'s PID namespace, (0, 0) for the initial
    one, None when it cannot be read (the process is gone, or no permission)."""
    try:
        st = os.stat(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None
    if st.st_ino == INIT_PID_NS_INO:
        return (0, 0)
    # The kernel's dev_t (MAJOR << 20 | MINOR), which bpf_get_ns_current_pid_tgid compares.
    return ((os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino)


def _all_ranges(proc: Path, pid: int) -> list[tuple[int, int]]:
    try:
        text = (proc / str(pid) / "maps").read_text(errors="surrogateescape")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        lo, _, rest = line.partition("-")
        hi = rest.split(None, 1)[0] if rest else ""
        try:
            out.append((int(lo, 16), int(hi, 16)))
        except ValueError:
            continue
    return out


def _exe(proc: Path, pid: int) -> str:
    try:
        return os.readlink(proc / str(pid) / "exe")
    except OSError:
        return ""


def _type_name(mem: ProcessMemory, layout: Layout, type_addr: int) -> bytes | None:
    raw = mem.read(type_addr + layout.type_name, 8)
    if raw is None:
        return None
    name = mem.read(struct.unpack("<Q", raw)[0], 16)
    return None if name is None else name.split(b"\0", 1)[0]


def _code_name(mem: ProcessMemory, layout: Layout, code: int) -> str | None:
    raw = mem.read(code + layout.code_name, 8)
    if raw is None:
        return None
    return read_unicode(mem, layout, struct.unpack("<Q", raw)[0])


def _version_from_name(path: str) -> tuple[int, int] | None:
    base = os.path.basename(path.removesuffix(DELETED))
    m = _LIB_RE.search(base) or _EXE_RE.search(base)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _open_path(proc: Path, pid: int, path: str, maps: list[Mapping]) -> str:
    # The process may live in another mount namespace or a chroot (mappedfile.py).
    m = maps[0]
    return mapped_file(pid, path, m.inode, m.start, m.end, proc=proc) or path


def _load_bias(facts: elf.ElfFacts, maps: list[Mapping]) -> int | None:
    if facts.etype == elf.ET_EXEC:
        return 0
    for seg in facts.segments:
        off_page = seg.offset & ~(PAGE - 1)
        for m in maps:
            if m.offset == off_page:
                return m.start - (seg.vaddr & ~(PAGE - 1))
    return None


def probe(
    pid: int, proc_root: Path = Path("/proc"), *, cache: elf.ElfCache | None = None
) -> Target | Refusal:
    """Find the CPython interpreter of ``pid``: a :class:`Target`, or why not."""
    cache = cache or elf.CACHE
    maps = read_maps(pid, proc_root)
    if maps is None:
        return Refusal(pid, "the process is gone")
    if not maps and read_identity(pid, proc_root) is None:
        # A zombie (exited, not reaped yet): its maps still open but are
        # empty and its exe link is unreadable, which otherwise reads as
        # "not a CPython process" for as long as its parent does not wait.
        return Refusal(pid, "the process is gone (exited, not reaped yet)")
    exe = _exe(proc_root, pid)
    by_path: dict[str, list[Mapping]] = {}
    for m in maps:
        by_path.setdefault(m.path, []).append(m)
    if exe and exe not in by_path and not exe.endswith(" (deleted)"):
        # Mid-exec: the kernel names the new executable (and the new comm)
        # before it maps it, so a sample can come first.  Not "not Python" yet.
        return Refusal(pid, f"{exe} is not mapped yet (exec in progress)", not_yet=True)
    # The executable first (static builds), then any mapped libpython.
    candidates = [p for p in by_path if p == exe] + [p for p in by_path if p != exe and _LIB_RE.search(os.path.basename(p))]
    exe_facts: elf.ElfFacts | None = None
    for path in candidates:
        try:
            facts = cache.get(_open_path(proc_root, pid, path, by_path[path]))
        except (OSError, CPythonError):
            continue
        if path == exe:
            exe_facts = facts
        if b"_PyRuntime" not in facts.symbols:
            version = _version_from_name(path)
            if version is not None and path != exe:
                return _no_table(pid, version, path, "no _PyRuntime symbol")
            continue
        return _target(pid, proc_root, path, facts, by_path[path])
    if exe_facts is not None:
        for lib in exe_facts.needed:
            version = _version_from_name(lib)
            if version is not None:
                if _supported(version):
                    return Refusal(pid, f"{lib} is not mapped yet (the dynamic loader has not run)", not_yet=True)
                return _no_table(pid, version, lib, "")
    version = _version_from_name(exe)
    if version is not None and not _supported(version):
        return _no_table(pid, version, exe, "")
    return Refusal(pid, "not a CPython process (no _PyRuntime in the executable or a mapped libpython)")


def _supported(version: tuple[int, int]) -> bool:
    try:
        layout_for(version)
    except CPythonError:
        return version in DEBUG_OFFSETS_VERSIONS
    return True


def _no_table(pid: int, version: tuple[int, int], path: str, detail: str) -> Refusal:
    try:
        layout_for(version)
    except CPythonError as e:
        return Refusal(pid, f"{path}: {e}", version=version)
    return Refusal(pid, f"{path}: CPython {version[0]}.{version[1]} but {detail}")


def _target(pid: int, proc_root: Path, path: str, facts: elf.ElfFacts, maps: list[Mapping]) -> Target | Refusal:
    identity = read_identity(pid, proc_root)
    if identity is None:
        return Refusal(pid, "the process is gone")
    bias = _load_bias(facts, maps)
    if bias is None:
        return Refusal(pid, f"{path}: cannot tell its load address from the mappings", not_yet=True)
    runtime = facts.symbols[b"_PyRuntime"][0] + bias
    hexversion = facts.hexversion(_open_path(proc_root, pid, path, maps))
    version = ((hexversion >> 24) & 0xFF, (hexversion >> 16) & 0xFF) if hexversion else _version_from_name(path)
    if version is None:
        return Refusal(pid, f"{path}: has _PyRuntime but no Py_Version and no version in its name")
    try:
        if version in DEBUG_OFFSETS_VERSIONS:
            data = ProcessMemory(pid).read(runtime, DEBUG_OFFSETS_SIZE_313)
            if data is None:
                return Refusal(pid, f"{path}: cannot read _Py_DebugOffsets at 0x{runtime:x} (need CAP_SYS_PTRACE)")
            if debug_offsets_version(data)[:2] != version:
                return Refusal(pid, f"{path}: _Py_DebugOffsets says another version than Py_Version")
            layout = layout_from_debug_offsets(data)
        else:
            try:
                layout = layout_for(version)
            except CPythonError as e:
                return Refusal(pid, f"{path}: {e}", version=version)  # no layout for this version
            layout.check()
    except CPythonError as e:
        return Refusal(pid, f"{path}: {e}")
    ns = pid_namespace(proc_root, pid)
    if ns is None:
        return Refusal(pid, "cannot read its PID namespace (/proc/PID/ns/pid)")
    size = facts.symbols[b"_PyRuntime"][1]
    return Target(pid, identity.start_time, version, hexversion, path, runtime, layout, proc_root, ns, size)


def walk(pid: int, *, max_threads: int = MAX_THREADS, max_depth: int = MAX_DEPTH) -> dict[int, list[Frame]]:
    """Frames of every thread of ``pid`` by the id the BPF walker matches
    (tid on 3.11+, pthread id on 3.8-3.10); {} when not (yet) walkable.

    Probes the process first; raises CPythonError when it is not a CPython
    process flamed can read.
    """
    target = probe(pid)
    if isinstance(target, Refusal):
        raise CPythonError(f"pid {pid}: {target.reason}")
    result = walk_memory(ProcessMemory(pid), target.layout, target.interp_addr,
                         max_threads=max_threads, max_depth=max_depth)
    if result is None:
        return {}
    return {t.key: t.frames for t in result.threads}
