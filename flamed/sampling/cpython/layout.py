"""Where CPython keeps what a frame walker reads, per interpreter version.

One :class:`Layout` per supported x86-64 CPython minor version: the offsets of
the thread-state list, the frame chain and the code object fields that name a
frame.  3.8 to 3.12 come from hand tables (CPython's headers, each number
checked against the DWARF of a real build by tests/unit/test_cpython_layout.py);
3.13 publishes its own offsets in ``_Py_DebugOffsets`` at the start of
``_PyRuntime`` and :func:`layout_from_debug_offsets` builds the Layout from
those bytes.  :meth:`Layout.pack` gives the ``struct flamed_pyproc`` of
bpf/flamed.h the BPF walker reads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Literal

from flamed.sampling.cpython.errors import LayoutError, UnsupportedVersion

#: Mirrors of bpf/flamed.h (a test compares them with the header).
TSTATE_BYTES = 256
FRAME_BYTES = 128
CODE_BYTES = 128
PY_NONE = 0xFFFF
MATCH_TID = 0
MATCH_FSBASE = 1
FLAG_CFRAME = 1
ENTRY_BIT = 1

#: struct flamed_pyproc, little-endian C layout: u64, u16, u8, u8, 10 x u16,
#: u8, u8, u8, u8 (guard_len), u16 (guard_base), u8 x 4, then padding to the
#: u64 alignment (48 bytes), then 4 x u64.
PYPROC_FORMAT = "<QHBBHHHHHHHHHHBBBBHBBBB6xQQQQ"
#: Windows of a thread's frame stack one walk of a 3.11+ process reads at
#: most (bpf/python.bpf.c, FLAMED_PY_WINDOW): its frames sit one after the
#: other in the interpreter's data stack.  Earlier versions' frames are heap
#: objects: 0, one read per frame.
FRAME_WINDOWS = 8
PYPROC_SIZE = struct.calcsize(PYPROC_FORMAT)

#: Frame owner of a shim frame the evaluation loop pushes on the C stack
#: (FRAME_OWNED_BY_CSTACK, 3.12 and 3.13).
OWNER_CSTACK = 3

#: How the instruction field maps to the line table.
LineFormat = Literal["lnotab", "linetable310", "locations"]

#: _Py_DebugOffsets starts with this cookie (3.13+).
DEBUG_COOKIE = b"xdebugpy"


def _mix(h: int, v: int) -> int:
    """flamed_mix of bpf/profile.bpf.c."""
    h ^= v
    h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h ^ (h >> 29)


def code_guard(name: int, filename: int, firstlineno: int) -> int:
    """The guard bpf/python.bpf.c (py_guard) stores for a frame of a new stack:
    its code object's name and file name pointers and first line, in 32 bits,
    never 0."""
    h = _mix(_mix(_mix(0, name), filename), firstlineno & 0xFFFFFFFF)
    g = (h ^ (h >> 32)) & 0xFFFFFFFF
    return g or 1


@dataclass(frozen=True, slots=True)
class Layout:
    """Offsets in bytes of one CPython version's structures (x86-64).

    The first block is what the BPF walker needs (``struct flamed_pyproc``),
    the second what symbolization needs.  ``None`` means the field does not
    exist in this version.
    """

    version: tuple[int, int]
    #: _PyRuntime: interpreters.head (PyInterpreterState *)
    runtime_interp_head: int
    #: PyInterpreterState: first PyThreadState * (tstate_head, threads.head)
    interp_threads_head: int
    tstate_next: int
    tstate_interp: int
    #: PyThreadState: thread_id (pthread_self(), the fs base on x86-64 glibc)
    tstate_thread_id: int
    #: PyThreadState: native_thread_id (the kernel tid), 3.11+
    tstate_native_thread_id: int | None
    #: PyThreadState: frame (3.8-3.10), cframe (3.11-3.12), current_frame (3.13)
    tstate_frame: int
    #: _PyCFrame: current_frame, when tstate_frame points to a _PyCFrame
    cframe_frame: int | None
    frame_code: int
    frame_previous: int
    #: f_lasti (int) or prev_instr / instr_ptr (pointer): see ``instr_size``
    frame_instr: int
    instr_size: int
    #: frame owner byte, 3.12+ (3.11 has one but no C-stack shim frames)
    frame_owner: int | None
    #: _PyInterpreterFrame.is_entry, 3.11 only
    frame_is_entry: int | None

    code_name: int
    code_qualname: int | None
    code_filename: int
    code_firstlineno: int
    #: co_lnotab (3.8-3.9) or co_linetable (3.10+), a bytes object
    code_linetable: int
    line_format: LineFormat
    #: 3.11+: offset of co_code_adaptive from the code object's start; an
    #: instruction pointer ``p`` is code unit ``(p - code - adaptive) // 2``
    code_adaptive: int | None
    #: 3.8-3.10: bytes per unit of f_lasti (1: byte offset, 2: code units)
    lasti_unit: int

    object_type: int = 8
    type_name: int = 24
    #: PyASCIIObject.state (bits: kind 2-4, compact 5, ascii 6)
    unicode_state: int = 32
    unicode_length: int = 16
    #: sizeof(PyASCIIObject): where a compact ASCII string's data starts
    unicode_ascii_size: int = 48
    #: sizeof(PyCompactUnicodeObject): where a compact non-ASCII string's data starts
    unicode_compact_size: int = 72
    bytes_size: int = 16
    bytes_sval: int = 32

    @property
    def runtime_interp_main(self) -> int:
        """_PyRuntime: interpreters.main, the main interpreter, the pointer
        after ``interpreters.head`` in ``struct pyinterpreters`` (mutex, head,
        main, next_id) in every supported version.  ``head`` is the newest
        interpreter: once a subinterpreter is made it is that one, whose
        thread states (one on each thread that made or entered it) hold
        none of the main interpreter's frames."""
        return self.runtime_interp_head + 8

    @property
    def thread_match(self) -> int:
        return MATCH_TID if self.tstate_native_thread_id is not None else MATCH_FSBASE

    @property
    def tstate_thread(self) -> int:
        """The tstate field the BPF walker compares with the sampled thread."""
        if self.tstate_native_thread_id is not None:
            return self.tstate_native_thread_id
        return self.tstate_thread_id

    @property
    def version_code(self) -> int:
        return self.version[0] << 8 | self.version[1]

    @property
    def code_guard_name(self) -> int:
        """The name field of a frame's guard: what the symbolizer names a frame by."""
        return self.code_qualname if self.code_qualname is not None else self.code_name

    def guard_read(self) -> tuple[int, int, int, int, int] | None:
        """(base, length, name, file, line) of the one read of a code object
        the BPF program makes for a frame's guard, the fields' offsets from
        base; None when they do not fit CODE_BYTES (no guards then)."""
        fields = ((self.code_guard_name, 8), (self.code_filename, 8), (self.code_firstlineno, 4))
        base = min(off for off, _ in fields)
        end = max(off + size for off, size in fields)
        if end - base > CODE_BYTES or base > 0xFFFF:
            return None
        return base, end - base, self.code_guard_name - base, self.code_filename - base, \
            self.code_firstlineno - base

    def check(self) -> None:
        """Refuse a layout whose fields the BPF walker's fixed-size reads cannot reach."""
        tstate = {
            "tstate_next": self.tstate_next,
            "tstate_thread": self.tstate_thread,
            "tstate_frame": self.tstate_frame,
        }
        frame = {
            "frame_code": self.frame_code,
            "frame_previous": self.frame_previous,
            "frame_instr": self.frame_instr,
        }
        # bpf/flamed.h: every offset + 8 fits the read, one-byte fields too.
        for name, off in (("frame_owner", self.frame_owner), ("frame_is_entry", self.frame_is_entry)):
            if off is not None:
                frame[name] = off
        for what, fields, limit in (("PyThreadState", tstate, TSTATE_BYTES), ("frame", frame, FRAME_BYTES)):
            for name, off in fields.items():
                if off < 0 or off + 8 > limit:
                    raise LayoutError(
                        f"CPython {self.version[0]}.{self.version[1]}: {name} at offset {off} "
                        f"is beyond the {limit} bytes the BPF walker reads of a {what}; "
                        "this interpreter build cannot be walked in BPF"
                    )
        if self.instr_size not in (4, 8):
            raise LayoutError(f"instruction field of {self.instr_size} bytes: must be 4 or 8")
        for name, off in (("cframe_frame", self.cframe_frame),):
            if off is not None and off + 8 > 64:
                raise LayoutError(f"{name} at offset {off}: a _PyCFrame is not that large")

    def pack(self, interp_addr: int, pid_ns: tuple[int, int] = (0, 0),
             gil_range: tuple[int, int] = (0, 0)) -> bytes:
        """``struct flamed_pyproc`` for a process whose ``&_PyRuntime.interpreters.main`` is given;
        ``pid_ns`` is the (kernel dev_t, inode) of its PID namespace when that is not the host's;
        ``gil_range`` the addresses [lo, hi) holding its GIL, (0, 0) if not known."""
        self.check()
        flags = FLAG_CFRAME if self.cframe_frame is not None else 0
        guard = self.guard_read() or (0, 0, 0, 0, 0)
        return struct.pack(
            PYPROC_FORMAT,
            interp_addr,
            self.version_code,
            self.thread_match,
            flags,
            self.interp_threads_head,
            self.tstate_next,
            self.tstate_thread,
            self.tstate_frame,
            self.cframe_frame if self.cframe_frame is not None else PY_NONE,
            self.frame_code,
            self.frame_previous,
            self.frame_instr,
            self.frame_owner if self.frame_owner is not None else PY_NONE,
            self.frame_is_entry if self.frame_is_entry is not None else PY_NONE,
            OWNER_CSTACK if self.frame_owner is not None else 0xFF,
            self.instr_size,
            FRAME_WINDOWS if self.version_code >= 0x030B else 0,
            guard[1],
            guard[0],
            guard[2],
            guard[3],
            guard[4],
            0,
            pid_ns[0],
            pid_ns[1],
            gil_range[0],
            gil_range[1],
        )

    def with_offsets(self, **changes: int | None) -> Layout:
        """A copy with some offsets changed (tests use it to break a layout on purpose)."""
        return replace(self, **changes)  # type: ignore[arg-type]


# 3.8 and 3.9 share every offset flamed reads (Include/cpython/pystate.h,
# Include/frameobject.h, Include/code.h); f_lasti is a byte offset.
_PY38 = Layout(
    version=(3, 8),
    runtime_interp_head=32,
    interp_threads_head=8,
    tstate_next=8,
    tstate_interp=16,
    tstate_thread_id=176,
    tstate_native_thread_id=None,
    tstate_frame=24,
    cframe_frame=None,
    frame_code=32,
    frame_previous=24,
    frame_instr=104,
    instr_size=4,
    frame_owner=None,
    frame_is_entry=None,
    code_name=112,
    code_qualname=None,
    code_filename=104,
    code_firstlineno=40,
    code_linetable=120,
    line_format="lnotab",
    code_adaptive=None,
    lasti_unit=1,
)

_TABLES: dict[tuple[int, int], Layout] = {
    (3, 8): _PY38,
    (3, 9): replace(_PY38, version=(3, 9)),
    # 3.10: f_lasti moved and counts code units; co_linetable replaces co_lnotab.
    # tstate->frame is still the PyFrameObject (the 3.10 CFrame only holds use_tracing).
    (3, 10): replace(_PY38, version=(3, 10), frame_instr=96, line_format="linetable310", lasti_unit=2),
    # 3.11: frames are _PyInterpreterFrame, reached through tstate->cframe.
    (3, 11): Layout(
        version=(3, 11),
        runtime_interp_head=40,
        interp_threads_head=16,
        tstate_next=8,
        tstate_interp=16,
        tstate_thread_id=152,
        tstate_native_thread_id=160,
        tstate_frame=56,
        cframe_frame=8,
        frame_code=32,
        frame_previous=48,
        frame_instr=56,
        instr_size=8,
        frame_owner=None,
        frame_is_entry=68,
        code_name=120,
        code_qualname=128,
        code_filename=112,
        code_firstlineno=72,
        code_linetable=136,
        line_format="locations",
        code_adaptive=184,
        lasti_unit=2,
    ),
    # 3.12: is_entry gives way to shim frames owned by the C stack; compact
    # strings lost wstr (PyASCIIObject 40 bytes, PyCompactUnicodeObject 56).
    (3, 12): Layout(
        version=(3, 12),
        runtime_interp_head=40,
        interp_threads_head=72,
        tstate_next=8,
        tstate_interp=16,
        tstate_thread_id=136,
        tstate_native_thread_id=144,
        tstate_frame=56,
        cframe_frame=0,
        frame_code=0,
        frame_previous=8,
        frame_instr=56,
        instr_size=8,
        frame_owner=70,
        frame_is_entry=None,
        code_name=120,
        code_qualname=128,
        code_filename=112,
        code_firstlineno=68,
        code_linetable=136,
        line_format="locations",
        code_adaptive=192,
        lasti_unit=2,
        unicode_ascii_size=40,
        unicode_compact_size=56,
    ),
}

#: Versions with a hand table; 3.13 is read from _Py_DebugOffsets.
TABLE_VERSIONS = tuple(sorted(_TABLES))
DEBUG_OFFSETS_VERSIONS = ((3, 13),)


def layout_for(version: tuple[int, int]) -> Layout:
    """The hand table of ``version`` (major, minor); refuse versions without one."""
    table = _TABLES.get(version)
    if table is not None:
        return table
    shown = f"{version[0]}.{version[1]}"
    if version in DEBUG_OFFSETS_VERSIONS:
        raise UnsupportedVersion(
            f"CPython {shown}: its layout comes from _Py_DebugOffsets in the process or file "
            "(layout_from_debug_offsets), not from a table"
        )
    supported = ", ".join(f"{a}.{b}" for a, b in TABLE_VERSIONS + DEBUG_OFFSETS_VERSIONS)
    raise UnsupportedVersion(
        f"CPython {shown}: no frame layout for this version (supported: {supported})"
    )


# _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h): after the cookie,
# the version (PY_VERSION_HEX) and free_threaded, every field is a u64.  The
# struct grew in 3.14, so the byte positions below hold for 3.13 only.
_DEBUG_FIELDS_313 = {
    "runtime_interp_head": 40,
    "interp_threads_head": 72,
    "tstate_next": 168,
    "tstate_interp": 176,
    "tstate_frame": 184,
    "tstate_thread_id": 192,
    "tstate_native_thread_id": 200,
    "frame_previous": 232,
    "frame_code": 240,
    "frame_instr": 248,
    "frame_owner": 264,
    "code_filename": 280,
    "code_name": 288,
    "code_qualname": 296,
    "code_linetable": 304,
    "code_firstlineno": 312,
    "code_adaptive": 344,
    "object_type": 360,
    "type_name": 376,
    "bytes_size": 520,
    "bytes_sval": 528,
    "unicode_state": 544,
    "unicode_length": 552,
    "unicode_ascii_size": 560,
}
DEBUG_OFFSETS_SIZE_313 = 584


def debug_offsets_version(data: bytes) -> tuple[int, int, int]:
    """(major, minor, PY_VERSION_HEX) from the start of ``_Py_DebugOffsets``."""
    if len(data) < 24 or data[:8] != DEBUG_COOKIE:
        raise LayoutError(
            "no _Py_DebugOffsets cookie 'xdebugpy' at the start of _PyRuntime: "
            "not a CPython 3.13+ runtime, or the address is wrong"
        )
    hexversion = struct.unpack_from("<Q", data, 8)[0]
    return (hexversion >> 24) & 0xFF, (hexversion >> 16) & 0xFF, hexversion


def layout_from_debug_offsets(data: bytes) -> Layout:
    """The Layout a 3.13 interpreter describes in its ``_Py_DebugOffsets``."""
    major, minor, hexversion = debug_offsets_version(data)
    if (major, minor) not in DEBUG_OFFSETS_VERSIONS:
        raise UnsupportedVersion(
            f"CPython {major}.{minor} (0x{hexversion:08x}): flamed reads _Py_DebugOffsets "
            "of 3.13 only; its Python frames are not read"
        )
    if len(data) < DEBUG_OFFSETS_SIZE_313:
        raise LayoutError(f"_Py_DebugOffsets: {len(data)} bytes, expected {DEBUG_OFFSETS_SIZE_313}")
    if struct.unpack_from("<Q", data, 16)[0]:
        raise UnsupportedVersion(
            f"CPython {major}.{minor} free-threaded build: its frames are not read "
            "(only the default GIL build is supported)"
        )
    values = {name: struct.unpack_from("<Q", data, pos)[0] for name, pos in _DEBUG_FIELDS_313.items()}
    for name, value in values.items():
        if value > 0xFFFF:
            raise LayoutError(f"_Py_DebugOffsets: {name} = {value} is not a plausible offset")
    layout = Layout(
        version=(major, minor),
        cframe_frame=None,
        instr_size=8,
        frame_is_entry=None,
        line_format="locations",
        lasti_unit=2,
        # utf8_length and utf8 follow the PyASCIIObject header (3.12+).
        unicode_compact_size=values["unicode_ascii_size"] + 16,
        **values,
    )
    layout.check()
    return layout
