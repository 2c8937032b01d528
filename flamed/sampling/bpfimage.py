"""Compiled BPF programs kept on disk, so that a start needs no compiler.

bcc compiles C with clang/LLVM inside the process each time a program is
made: about a second of CPU for the sampler, and tens of MB of LLVM heap that
stay in the process afterwards.  It offers no way to load a compiled object
back.  What a compile produces is small, though: each function's BPF
instructions, and the list of maps (type, sizes, flags, and the C layout of
key and value that bcc describes as JSON).  The instructions name a map by
the file descriptor bcc created it with (``ld_imm64`` with
``BPF_PSEUDO_MAP_FD``); that is the one thing a new process must change.

An :class:`Image` is that: maps and functions, with every map reference
rewritten to the map's index.  :class:`ImageCache` keeps images in a
directory, named by a hash of everything the compile depends on (the source
text, the flags, bcc's version, the kernel's release and build, the number of
possible CPUs).  :class:`ImageBPF` is a ``bcc.BPF`` made from an image: it
creates the maps itself, loads a function (the verifier still runs) with the
indices turned into its own map fds, and hands out bcc's own table classes,
so the rest of flamed cannot tell it from a compiled one.

:func:`load_bpf` puts it together: an image from the cache, or a compile
(in this process, or in a short-lived child so that LLVM never grows a
long-lived process: the daemon's choice), stored for the next start.  A
cache that cannot be read, written or trusted (owned by someone else, or
writable by others: root loads what is in it) is said once in the log and
the compile goes on as before.

The child: ``python -m flamed.sampling.bpfimage`` reads ``{"source",
"cflags"}`` as JSON on stdin and writes the image on stdout.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes as ct
import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("flamed.bpf")

#: Bumped whenever the file layout or what goes into the key changes.
FORMAT = 1
#: Images kept per directory (the least recently used go first).
KEEP = 16
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD = 1
_INSN = 8


class ImageError(Exception):
    """An image cannot be made, read or loaded; says why."""


class CompileError(ImageError):
    """The compiler process failed; the text is its last lines of stderr."""


class ChildOutputError(ImageError):
    """The compiler process ended without handing over a whole image (its
    output cut short or damaged, or the process killed by a signal): nothing
    is wrong with the program, another compile may well succeed."""


# ---------------------------------------------------------------------------
# bcc without its compiler

#: Set by :func:`runtime_only`: bcc's Python side runs over libbcc_bpf.so.
_RUNTIME_ONLY = False
#: What bcc's library calls its runtime half (no clang, no LLVM).
RUNTIME_LIBRARY = "libbcc_bpf.so.0"
_TABLE_INFO = frozenset({"bpf_table_type_id", "bpf_table_flags_id", "bpf_table_max_entries_id"})


class _CompilerOnly:
    """A libbcc function that only the compiler half has: declarable, not callable."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.restype: Any = None
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        if self.name in _TABLE_INFO:
            return -1  # what libbcc answers without a module; ImageBPF sets the real values
        raise RuntimeError(f"{self.name} is part of bcc's compiler, not loaded in this process")


class _RuntimeLibrary:
    """Stands for libbcc.so in bcc's Python side: libbcc_bpf.so's functions,
    and :class:`_CompilerOnly` for the rest."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            f = getattr(self._real, name)
        except AttributeError:
            f = _CompilerOnly(name)
        self.__dict__[name] = f
        return f


def runtime_only() -> bool:
    """Make this process load bcc over its runtime library only: maps,
    programs, perf and ring buffers, symbols, but no clang and no LLVM
    (importing bcc maps LLVM in and costs ~65 MB of RSS; its runtime half,
    ~2 MB).  Every compile then runs in a child process (:func:`load_bpf`).
    Call before bcc is first imported; False (and nothing changes) when it
    already was, or when this bcc has no runtime library."""
    global _RUNTIME_ONLY
    if _RUNTIME_ONLY:
        return True
    if "bcc" in sys.modules or "bcc.libbcc" in sys.modules:
        return False
    try:
        real = ct.CDLL(RUNTIME_LIBRARY, use_errno=True)
    except OSError:
        return False
    plain = ct.CDLL

    def cdll(name: Any, *args: Any, **kw: Any) -> Any:
        if name == "libbcc.so.0":
            return _RuntimeLibrary(real)
        return plain(name, *args, **kw)

    ct.CDLL = cdll  # type: ignore[misc,assignment]
    try:
        import bcc  # noqa: F401, PLC0415 - bcc.libbcc takes its library now
    except ImportError:
        return False
    finally:
        ct.CDLL = plain  # type: ignore[misc]
    _RUNTIME_ONLY = True
    return True


@dataclass(frozen=True)
class MapSpec:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str
    leaf_desc: str


@dataclass(frozen=True)
class Image:
    """The maps and functions of one compile; map references are map indices."""

    maps: tuple[MapSpec, ...]
    funcs: dict[str, bytes]
    license: str
    kern_version: int

    def map_index(self, name: str) -> int:
        for i, m in enumerate(self.maps):
            if m.name == name:
                return i
        raise KeyError(name)

    # -- file form: JSON with the instructions in base64, and a digest of the rest
    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "license": self.license,
            "kern_version": self.kern_version,
            "maps": [m.__dict__ for m in self.maps],
            "funcs": {k: base64.b64encode(v).decode() for k, v in sorted(self.funcs.items())},
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(text).hexdigest().encode() + b"\n" + text

    @classmethod
    def from_bytes(cls, data: bytes) -> Image:
        digest, _, text = data.partition(b"\n")
        if hashlib.sha256(text).hexdigest().encode() != digest:
            raise ImageError("digest mismatch (truncated or altered)")
        try:
            body = json.loads(text)
            if body.get("format") != FORMAT:
                raise ImageError(f"format {body.get('format')!r}, not {FORMAT}")
            maps = tuple(MapSpec(**m) for m in body["maps"])
            funcs = {k: base64.b64decode(v) for k, v in body["funcs"].items()}
            image = cls(maps=maps, funcs=funcs, license=str(body["license"]), kern_version=int(body["kern_version"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ImageError(f"unreadable: {e}") from None
        for name, insns in image.funcs.items():
            _map_refs(insns, len(image.maps), name)  # every reference names a map of the image
        return image


def image_key(source: str, cflags: Sequence[str]) -> str:
    """What a compile's result depends on, hashed: a changed input is a new key."""
    h = hashlib.sha256()
    u = os.uname()
    for part in (str(FORMAT), _bcc_version(), u.release, u.version, u.machine, _possible_cpus(),
                 "\0".join(cflags), source):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()[:40]


def _bcc_version() -> str:
    """bcc's version, read without importing bcc (which maps its library)."""
    import importlib.util  # noqa: PLC0415
    import re  # noqa: PLC0415

    try:
        spec = importlib.util.find_spec("bcc")
        for d in (spec.submodule_search_locations or []) if spec else []:
            m = re.search(r"""__version__\s*=\s*['"]([^'"]+)""", (Path(d) / "version.py").read_text())
            if m:
                return m.group(1)
    except (ImportError, OSError, ValueError):
        pass
    return "?"


def _possible_cpus() -> str:
    # bcc sizes a perf output map by the possible CPUs at compile time
    try:
        return Path("/sys/devices/system/cpu/possible").read_text().strip()
    except OSError:
        return str(os.cpu_count())


def _map_ref_offsets(insns: bytes, fname: str) -> list[tuple[int, int]]:
    """(offset, immediate) of each ``ld_imm64`` map-by-fd reference; ImageError
    for anything an image cannot carry (other ``ld_imm64`` kinds, partial instructions)."""
    if len(insns) % _INSN:
        raise ImageError(f"{fname}: {len(insns)} bytes is not whole instructions")
    refs: list[tuple[int, int]] = []
    i, n = 0, len(insns)
    while i < n:
        if insns[i] == _LD_IMM64:
            src = insns[i + 1] >> 4
            if src == _PSEUDO_MAP_FD:
                refs.append((i, int.from_bytes(insns[i + 4:i + 8], "little", signed=True)))
            elif src != 0:
                raise ImageError(f"{fname}: ld_imm64 of kind {src} (only map fds are carried)")
            i += 2 * _INSN
        else:
            i += _INSN
    return refs


def _map_refs(insns: bytes, n_maps: int, fname: str) -> list[int]:
    """Instruction offsets of the map references, each naming a map of ``n_maps``."""
    refs = _map_ref_offsets(insns, fname)
    for _off, idx in refs:
        if not 0 <= idx < n_maps:
            raise ImageError(f"{fname}: map reference {idx} out of range")
    return [off for off, _idx in refs]


def _rewrite(insns: bytes, table: dict[int, int], fname: str) -> bytes:
    """``insns`` with each map reference's immediate replaced through ``table``."""
    out = bytearray(insns)
    for off, old in _map_ref_offsets(insns, fname):
        if old not in table:
            raise ImageError(f"{fname}: reference to map fd/index {old}, which the module does not own")
        out[off + 4:off + 8] = table[old].to_bytes(4, "little", signed=True)
    return bytes(out)


def _libbcc() -> Any:
    from bcc.libbcc import lib  # noqa: PLC0415 - bcc only where BPF is used

    # declared here: bcc's Python side does not use (so does not declare) these
    lib.bpf_num_tables.restype = ct.c_ulonglong
    lib.bpf_num_tables.argtypes = [ct.c_void_p]
    lib.bpf_table_name.restype = ct.c_char_p
    lib.bpf_table_name.argtypes = [ct.c_void_p, ct.c_ulonglong]
    lib.bpf_table_fd_id.restype = ct.c_int
    lib.bpf_table_fd_id.argtypes = [ct.c_void_p, ct.c_ulonglong]
    for f in (lib.bpf_table_key_size_id, lib.bpf_table_leaf_size_id):
        f.restype = ct.c_size_t
        f.argtypes = [ct.c_void_p, ct.c_ulonglong]
    for f in (lib.bpf_table_key_desc_id, lib.bpf_table_leaf_desc_id):
        f.restype = ct.c_char_p
        f.argtypes = [ct.c_void_p, ct.c_ulonglong]
    lib.bcc_create_map.restype = ct.c_int
    lib.bcc_create_map.argtypes = [ct.c_int, ct.c_char_p, ct.c_int, ct.c_int, ct.c_int, ct.c_int]
    lib.bcc_prog_load.restype = ct.c_int
    lib.bcc_prog_load.argtypes = [ct.c_int, ct.c_char_p, ct.c_void_p, ct.c_int, ct.c_char_p, ct.c_uint,
                                  ct.c_int, ct.c_char_p, ct.c_uint]
    return lib


def image_of(bpf: Any) -> Image:
    """The image of a freshly compiled ``bcc.BPF`` (ImageError if it has
    anything an image cannot carry)."""
    lib = _libbcc()
    mod = bpf.module
    maps: list[MapSpec] = []
    by_fd: dict[int, int] = {}
    for i in range(int(lib.bpf_num_tables(mod))):
        name = (lib.bpf_table_name(mod, i) or b"").decode()
        fd = int(lib.bpf_table_fd_id(mod, i))
        if not name or fd < 0:
            raise ImageError(f"table {i} has no name or fd")
        by_fd[fd] = len(maps)
        maps.append(MapSpec(
            name=name, type=int(lib.bpf_table_type_id(mod, i)),
            key_size=int(lib.bpf_table_key_size_id(mod, i)), value_size=int(lib.bpf_table_leaf_size_id(mod, i)),
            max_entries=int(lib.bpf_table_max_entries_id(mod, i)), flags=int(lib.bpf_table_flags_id(mod, i)),
            key_desc=(lib.bpf_table_key_desc_id(mod, i) or b"").decode(),
            leaf_desc=(lib.bpf_table_leaf_desc_id(mod, i) or b"").decode(),
        ))
    funcs: dict[str, bytes] = {}
    for i in range(int(lib.bpf_num_functions(mod))):
        raw = lib.bpf_function_name(mod, i)
        start, size = lib.bpf_function_start(mod, raw), lib.bpf_function_size(mod, raw)
        if not start or not size:
            continue
        name = raw.decode()
        funcs[name] = _rewrite(ct.string_at(start, size), by_fd, name)
    return Image(maps=tuple(maps), funcs=funcs, license=(lib.bpf_module_license(mod) or b"GPL").decode(),
                 kern_version=int(lib.bpf_module_kern_version(mod)))


# ---------------------------------------------------------------------------
# The cache directory


class ImageCache:
    """Images in ``directory``, one file per key (``<key>.bpfimg``).

    Nothing is loaded from a directory or file that this user does not own,
    or that others may write: root would put what is in it into the kernel.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._warned = False

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("compiled-program cache %s: %s; compiling instead", self.directory, what)

    def _trusted(self, st: os.stat_result, what: str) -> bool:
        if st.st_uid != os.geteuid():
            self._warn(f"{what} is owned by uid {st.st_uid}, not {os.geteuid()}: not used")
            return False
        if st.st_mode & 0o022:
            self._warn(f"{what} is writable by others (mode {st.st_mode & 0o777:o}): not used")
            return False
        return True

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.bpfimg"

    def get(self, key: str) -> Image | None:
        p = self.path(key)
        try:
            dst = os.stat(self.directory)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn(e.strerror or str(e))
            return None
        if not self._trusted(dst, "the directory"):
            return None
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn(f"{p.name}: {e.strerror}")
            return None
        try:
            if not self._trusted(os.fstat(fd), p.name):
                return None
            with os.fdopen(fd, "rb") as f:
                fd = -1
                data = f.read()
        finally:
            if fd >= 0:
                os.close(fd)
        try:
            image = Image.from_bytes(data)
        except ImageError as e:
            log.warning("compiled-program cache: %s is %s; compiling again", p, e)
            return None
        try:
            os.utime(p)  # the least recently used go first
        except OSError:
            pass
        return image

    def put(self, key: str, image: Image) -> bool:
        """Store ``image``; False (said once) where the directory cannot be written."""
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            if not self._trusted(os.stat(self.directory), "the directory"):
                return False
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".bpfimg")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(image.to_bytes())
                os.replace(tmp, self.path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            self._warn(f"cannot store ({e.strerror or e})")
            return False
        self._trim()
        return True

    def _trim(self) -> None:
        try:
            files = sorted(self.directory.glob("*.bpfimg"), key=lambda p: p.stat().st_mtime, reverse=True)
            for old in files[KEEP:]:
                old.unlink()
        except OSError:
            pass


# ---------------------------------------------------------------------------
# A bcc.BPF made from an image


def image_bpf_class() -> Any:
    """:class:`ImageBPF`, defined on first use (it subclasses bcc's ``BPF``)."""
    global _IMAGE_BPF
    if _IMAGE_BPF is None:
        _IMAGE_BPF = _define_image_bpf()
    return _IMAGE_BPF


_IMAGE_BPF: Any = None


def _define_image_bpf() -> Any:
    from bcc import BPF  # noqa: PLC0415
    from bcc import table as bt  # noqa: PLC0415

    classes = {
        bt.BPF_MAP_TYPE_HASH: bt.HashTable, bt.BPF_MAP_TYPE_ARRAY: bt.Array,
        bt.BPF_MAP_TYPE_PROG_ARRAY: bt.ProgArray, bt.BPF_MAP_TYPE_PERF_EVENT_ARRAY: bt.PerfEventArray,
        bt.BPF_MAP_TYPE_PERCPU_HASH: bt.PerCpuHash, bt.BPF_MAP_TYPE_PERCPU_ARRAY: bt.PerCpuArray,
        bt.BPF_MAP_TYPE_LPM_TRIE: bt.LpmTrie, bt.BPF_MAP_TYPE_STACK_TRACE: bt.StackTrace,
        bt.BPF_MAP_TYPE_LRU_HASH: bt.LruHash, bt.BPF_MAP_TYPE_LRU_PERCPU_HASH: bt.LruPerCpuHash,
        bt.BPF_MAP_TYPE_CGROUP_ARRAY: bt.CgroupArray, bt.BPF_MAP_TYPE_RINGBUF: bt.RingBuf,
    }
    with_reducer = {bt.BPF_MAP_TYPE_PERCPU_HASH, bt.BPF_MAP_TYPE_PERCPU_ARRAY}
    with_name = {bt.BPF_MAP_TYPE_PERF_EVENT_ARRAY, bt.BPF_MAP_TYPE_RINGBUF}

    class ImageBPF(BPF):  # type: ignore[misc]
        """bcc's ``BPF`` over an :class:`Image`: maps made here, functions loaded on demand."""

        def __init__(self, image: Image) -> None:  # noqa: D107 - no compile: BPF.__init__ is not called
            # the state BPF.__init__ sets up, without a module
            self.kprobe_fds: dict[Any, Any] = {}
            self.uprobe_fds: dict[Any, Any] = {}
            self.tracepoint_fds: dict[Any, Any] = {}
            self.raw_tracepoint_fds: dict[Any, Any] = {}
            self.kfunc_entry_fds: dict[Any, Any] = {}
            self.kfunc_exit_fds: dict[Any, Any] = {}
            self.lsm_fds: dict[Any, Any] = {}
            self.perf_buffers: dict[Any, Any] = {}
            self.open_perf_events: dict[Any, Any] = {}
            self._ringbuf_manager = None
            self.tracefile = None
            self.debug = 0
            self.funcs: dict[bytes, Any] = {}
            self.tables: dict[Any, Any] = {}
            self.module = None
            self.image = image
            self.map_fds: list[int] = []
            self._lib = _libbcc()
            atexit.register(self.cleanup)
            try:
                for m in image.maps:
                    fd = self._lib.bcc_create_map(m.type, m.name.encode(), m.key_size, m.value_size,
                                                  m.max_entries, m.flags)
                    if fd < 0:
                        err = ct.get_errno() or errno.EINVAL
                        raise ImageError(f"cannot create map {m.name} (type {m.type}, {m.max_entries} entries): "
                                         f"{os.strerror(err)}")
                    self.map_fds.append(fd)
            except BaseException:
                self.close()
                raise

        def load_func(self, func_name: Any, prog_type: int, device: Any = None, attach_type: int = -1) -> Any:
            name = func_name.encode() if isinstance(func_name, str) else bytes(func_name)
            if name in self.funcs:
                return self.funcs[name]
            insns = self.image.funcs.get(name.decode())
            if insns is None:
                raise Exception(f"Unknown program {name.decode()}")  # bcc's own words and type
            code = _rewrite(insns, dict(enumerate(self.map_fds)), name.decode())
            buf = ct.create_string_buffer(code, len(code))
            lic = self.image.license.encode()
            fd = self._lib.bcc_prog_load(prog_type, name, buf, len(code), lic, self.image.kern_version, 0, None, 0)
            if fd < 0:
                err = ct.get_errno()
                if err == errno.EPERM:
                    raise Exception("Need super-user privileges to run")
                # again with the verifier's log, for the error's text
                size = 16 << 20
                logbuf = ct.create_string_buffer(size)
                fd2 = self._lib.bcc_prog_load(prog_type, name, buf, len(code), lic, self.image.kern_version,
                                              1, logbuf, size)
                if fd2 >= 0:  # refused once, taken now (a transient failure)
                    fd = fd2
                else:
                    tail = "\n".join(logbuf.value.decode(errors="replace").strip().splitlines()[-12:])
                    raise Exception(f"Failed to load BPF program {name.decode()}: {os.strerror(err)}\n{tail}")
            fn = BPF.Function(self, name, fd)
            self.funcs[name] = fn
            return fn

        def get_table(self, name: Any, keytype: Any = None, leaftype: Any = None, reducer: Any = None) -> Any:
            sname = name.decode() if isinstance(name, bytes) else str(name)
            try:
                idx = self.image.map_index(sname)
            except KeyError:
                raise KeyError(name) from None
            m = self.image.maps[idx]
            cls = classes.get(m.type)
            if cls is None:
                raise Exception(f"Unknown table type {m.type}")
            key = keytype or (BPF._decode_table_type(json.loads(m.key_desc)) if m.key_desc else ct.c_int)
            leaf = leaftype or BPF._decode_table_type(json.loads(m.leaf_desc))
            kw: dict[str, Any] = {"reducer": reducer} if m.type in with_reducer else {}
            args: tuple[Any, ...] = (self, idx, self.map_fds[idx], key, leaf)
            if m.type in with_name:
                args += (sname.encode(),)
            t = cls(*args, **kw)
            # what bcc would have asked its module for
            t.ttype, t.flags, t.max_entries = m.type, m.flags, m.max_entries
            return t

        def close(self) -> None:
            super().close()
            for fd in self.map_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.map_fds = []

    return ImageBPF


# ---------------------------------------------------------------------------
# Putting it together


@dataclass
class LoadInfo:
    """How a program came to be: ``cache`` (an image read back), ``compiled``
    here, or ``child`` (compiled in a short-lived process); and the seconds."""

    how: str
    seconds: float
    key: str = ""


def _compile_here(source: str, cflags: Sequence[str]) -> Any:
    from bcc import BPF  # noqa: PLC0415

    return BPF(text=source.encode(), cflags=list(cflags))


def compile_in_child(source: str, cflags: Sequence[str], timeout: float = 600.0) -> Image:
    """Compile in ``python -m flamed.sampling.bpfimage``; ImageError with its
    last lines of stderr if it fails."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # flamed's parent, so the child imports this flamed
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run([sys.executable, "-m", "flamed.sampling.bpfimage"],
                              input=json.dumps({"source": source, "cflags": list(cflags)}).encode(),
                              capture_output=True, timeout=timeout, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageError(f"the compiler process failed: {e}") from None
    if proc.returncode < 0:  # the OOM killer, an operator's kill: not the program's fault
        raise ChildOutputError(f"the compiler process was killed by {_signal_name(-proc.returncode)} "
                               f"after writing {len(proc.stdout)} bytes")
    if proc.returncode != 0:
        tail = "\n  ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-15:])
        raise CompileError(f"the compiler process exited with {proc.returncode}:\n  {tail}")
    try:
        return Image.from_bytes(proc.stdout)
    except ImageError as e:
        # The child says it succeeded; what reached this end of the pipe is not its image.
        raise ChildOutputError(f"the compiler process exited 0 but its output ({len(proc.stdout)} bytes) is not a "
                               f"whole image: {e}") from None


def _signal_name(num: int) -> str:
    import signal  # noqa: PLC0415

    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


#: Compiles in a child process tried, when the child hands over no whole image.
CHILD_ATTEMPTS = 2


def _compile_in_children(source: str, cflags: Sequence[str]) -> Image:
    """:func:`compile_in_child`, once more if the child's output did not arrive whole."""
    for attempt in range(1, CHILD_ATTEMPTS + 1):
        try:
            return compile_in_child(source, cflags)
        except ChildOutputError as e:
            if attempt == CHILD_ATTEMPTS:
                raise ChildOutputError(f"{e} (attempt {attempt} of {CHILD_ATTEMPTS})") from None
            log.warning("BPF compile: %s; compiling again in a new process", e)
    raise AssertionError("unreachable")


def load_bpf(source: str, cflags: Sequence[str], *, cache_dir: Path | None, isolated: bool) -> tuple[Any, LoadInfo]:
    """A ``bcc.BPF`` of ``source``: from the cache when it has it, else
    compiled (in a child if ``isolated``) and stored.  Compile errors are
    bcc's exceptions, as from ``BPF(text=...)``, with their text on stderr."""
    t0 = time.perf_counter()
    key = image_key(source, cflags)
    cache = ImageCache(cache_dir) if cache_dir is not None else None
    image = cache.get(key) if cache is not None else None
    if image is not None:
        b = image_bpf_class()(image)
        return b, LoadInfo("cache", time.perf_counter() - t0, key)
    if isolated or _RUNTIME_ONLY:
        try:
            image = _compile_in_children(source, cflags)
        except ImageError as e:
            if _RUNTIME_ONLY:
                raise  # this process cannot compile
            # the same compile here gives bcc's own error (and its text on stderr)
            (log.warning if isinstance(e, ChildOutputError) else log.debug)(
                "isolated compile failed (%s); compiling in this process", e)
        else:
            if cache is not None:
                cache.put(key, image)
            b = image_bpf_class()(image)
            return b, LoadInfo("child", time.perf_counter() - t0, key)
    b = _compile_here(source, cflags)
    if cache is not None:
        try:
            cache.put(key, image_of(b))
        except ImageError as e:
            log.info("this program cannot be kept compiled (%s): it is compiled at each start", e)
    return b, LoadInfo("compiled", time.perf_counter() - t0, key)


def _main() -> int:
    req = json.loads(sys.stdin.buffer.read())
    b = _compile_here(req["source"], req["cflags"])
    data = image_of(b).to_bytes()
    b.cleanup()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except ImageError as e:
        print(f"flamed: {e}", file=sys.stderr)
        sys.exit(3)
    except Exception as e:  # noqa: BLE001 - bcc raises plain Exception; its text is already on stderr
        print(f"flamed: compile failed: {e}", file=sys.stderr)
        sys.exit(1)
