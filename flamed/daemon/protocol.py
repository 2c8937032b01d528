"""The control-socket protocol: request validation and the snapshot filter.

A client sends ONE line: a JSON object of at most 64 KiB, ending in ``\\n``.
The daemon answers with one JSON header line; for a snapshot the header says
``"length": N`` and N bytes of payload (the profile in the asked format)
follow.  Then the daemon closes the connection.  Errors are a header
``{"ok": false, "error": "...", "code": "..."}``.  See docs/protocol.md.

This module is pure (no sockets) so that the client, the server and the
fuzz tests share it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from flamed.daemon.ring import DecodeCache, window_items
from flamed.model import KERNEL_SUFFIX, Stack
from flamed.sampling.cgroups import CgroupError, CgroupIdentity, CgroupSpec, parse_cgroup_spec, unit_matcher
from flamed.sampling.contract import CountKey, canonical_root
from flamed.sampling.offcpu import OFFCPU_BLOCKED_FRAME, OFFCPU_GIL_FRAME, OFFCPU_PREEMPTED_FRAME

#: The leaf of an off-CPU stack says why the thread waited: neither a kernel
#: nor a user frame, it is kept by ``--frames kernel`` and ``--frames user`` alike.
_OFFCPU_MARKERS = frozenset((OFFCPU_BLOCKED_FRAME, OFFCPU_PREEMPTED_FRAME, OFFCPU_GIL_FRAME))

MAX_REQUEST_BYTES = 64 * 1024
REQUESTS = ("snapshot", "status", "flush")
FRAMES = ("all", "kernel", "user")
ROOTS = ("comm", "pid", "tid", "none")  # alone; with unit, container, cgroup: see parse_root
#: Filters on the cgroup identity of a task: each a name or a list of names.
IDENTITY_FIELDS = ("unit", "container", "pod", "cgroup")
MAX_NAME_LENGTH = 4096
#: Longest regex a client may send; frames are matched one unique frame at a time.
MAX_REGEX_LENGTH = 256
MAX_IDS = 1024
#: What a snapshot may be of: CPU samples, or off-CPU time (a daemon with [sampling] off_cpu).
KINDS = ("cpu", "offcpu")


class ProtocolError(Exception):
    """A request the daemon refuses; ``code`` is machine-readable; ``request``: its kind
    (``snapshot``...), when the request got as far as naming a known one."""

    def __init__(self, message: str, code: str = "bad_request", request: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request = request


@dataclass(frozen=True)
class SnapshotRequest:
    seconds: float | None = None  # the last N seconds (from the ring)
    next: float | None = None  # the next N seconds (waits)
    since_ns: int | None = None  # the windows that end after this time (ns since the epoch)
    drain: bool = True  # with since_ns: drain first (else only what is in the ring)
    pids: frozenset[int] | None = None
    tids: frozenset[int] | None = None
    comm: str | None = None
    frame: str | None = None
    exclude_frame: str | None = None
    frames: str = "all"
    root: str = "pid"
    format: str = "folded"
    title: str | None = None
    units: tuple[str, ...] | None = None  # unit names, or names without the suffix
    containers: tuple[str, ...] | None = None  # names, or ids or id prefixes (4+ hex digits)
    pods: tuple[str, ...] | None = None  # pod UIDs
    cgroups: tuple[CgroupSpec, ...] | None = None  # a cgroup and its subtree, a unit anywhere, an id
    kind: str = "cpu"  # cpu: samples; offcpu: time off the CPU (microseconds in folded/svg, ns in pprof)


@dataclass(frozen=True)
class Request:
    request: str
    snapshot: SnapshotRequest | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_FIELDS = {
    "snapshot": {"request", "seconds", "next", "since_ns", "drain", "pid", "tgid", "tid", "comm", "frame", "exclude_frame",
                 "frames", "root", "format", "title", "kind", *IDENTITY_FIELDS},
    "status": {"request"},
    "flush": {"request"},
}


def request_kind(line: bytes) -> str:
    """The known request a line names (``snapshot``, ``status``, ``flush``), else
    ``unknown``: how a request refused before it is served (busy) is counted."""
    try:
        obj = _decode(line)
    except ProtocolError:
        return "unknown"
    kind = obj.get("request") if isinstance(obj, dict) else None
    return kind if isinstance(kind, str) and kind in REQUESTS else "unknown"


def _decode(line: bytes) -> Any:
    """The JSON value of a request line; raises :class:`ProtocolError` saying why not."""
    if len(line) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request longer than {MAX_REQUEST_BYTES} bytes", "too_large")
    try:
        # Decoded here, not by json.loads: given bytes it guesses UTF-16/32 from NUL
        # bytes, and binary garbage then reads as "'utf-16-be' codec can't decode".
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"request is not UTF-8 text (byte 0x{line[e.start]:02x} at offset {e.start}); "
                            f"{EXPECTED_REQUEST}") from None
    try:
        obj = json.loads(text.removeprefix("\ufeff"), parse_int=_parse_int, parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"request is not valid JSON ({e.msg} at offset {e.pos}); {EXPECTED_REQUEST}") from None
    except RecursionError:
        raise ProtocolError(f"request is nested too deeply; {EXPECTED_REQUEST}") from None
    return obj


def parse_request(line: bytes, *, formats: list[str], max_next: float, ring_seconds: float | None = None,
                  default_seconds: float = 60.0, default_root: str = "pid") -> Request:
    """Validate one request line; raises :class:`ProtocolError` with a message for the client.

    ``ring_seconds``: how much the daemon's ring holds; a ``next`` span longer
    than that is refused (its oldest windows would be gone when it ends).
    """
    obj = _decode(line)
    if not isinstance(obj, dict):
        raise ProtocolError("request must be a JSON object such as {\"request\": \"status\"}")
    kind = obj.get("request")
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise ProtocolError(f"field 'request' must be one of {', '.join(REQUESTS)}")
    unknown = sorted(set(obj) - _FIELDS[kind])
    if unknown:
        raise ProtocolError(f"unknown field(s) for {kind!r}: {', '.join(unknown)[:200]}", request=kind)
    if kind != "snapshot":
        return Request(kind)
    try:
        return _snapshot_request(obj, formats=formats, max_next=max_next, ring_seconds=ring_seconds,
                                 default_seconds=default_seconds, default_root=default_root)
    except ProtocolError as e:
        e.request = kind
        raise


def _snapshot_request(obj: dict[str, Any], *, formats: list[str], max_next: float, ring_seconds: float | None,
                      default_seconds: float, default_root: str) -> Request:
    seconds = _number(obj, "seconds")
    nxt = _number(obj, "next")
    since_ns = obj.get("since_ns")
    if since_ns is not None and (isinstance(since_ns, bool) or not isinstance(since_ns, int)
                                 or not 0 <= since_ns < 1 << 63):
        raise ProtocolError("field 'since_ns' must be an integer from 0 to 2**63 - 1: nanoseconds since the epoch")
    drain = obj.get("drain", True)
    if not isinstance(drain, bool):
        raise ProtocolError("field 'drain' must be true or false")
    if sum(x is not None for x in (seconds, nxt, since_ns)) > 1:
        raise ProtocolError("give one of 'seconds' (the last N seconds), 'next' (the next N seconds) or "
                            "'since_ns' (the windows that end after that time)")
    if "drain" in obj and since_ns is None:
        raise ProtocolError("field 'drain' goes with 'since_ns' only")
    if seconds is None and nxt is None and since_ns is None:
        seconds = default_seconds
    if nxt is not None and nxt > max_next:
        raise ProtocolError(f"'next' is {nxt:g} s; the daemon allows at most {max_next:g} s (snapshot.max_next_seconds)")
    if nxt is not None and ring_seconds is not None and nxt > ring_seconds:
        # Read back from the ring when the span ends: its beginning would be evicted by then.
        raise ProtocolError(f"'next' is {nxt:g} s, longer than the {ring_seconds:g} s of windows the daemon keeps "
                            f"in memory (snapshot.ring_seconds), where a 'next' profile is read from when its "
                            f"span ends; ask for at most {ring_seconds:g} s, or raise snapshot.ring_seconds")
    pids = _ids(obj, "pid")
    tgids = _ids(obj, "tgid")
    if pids is not None and tgids is not None:
        pids = pids | tgids
    elif tgids is not None:
        pids = tgids
    fmt = obj.get("format", "folded")
    if not isinstance(fmt, str) or fmt not in formats:
        raise ProtocolError(f"field 'format' must be one of {', '.join(formats)}")
    frames = obj.get("frames", "all")
    if frames not in FRAMES:
        raise ProtocolError(f"field 'frames' must be one of {', '.join(FRAMES)}")
    root = obj.get("root", default_root)
    if not isinstance(root, str):
        raise ProtocolError("field 'root' must be a string such as \"pid\" or \"container,pid\"")
    try:
        root = canonical_root(root)
    except ValueError as e:
        raise ProtocolError(f"field 'root': {e}") from None
    cgroups = _names(obj, "cgroup")
    try:
        cgroup_specs = None if cgroups is None else tuple(parse_cgroup_spec(c, key="cgroup") for c in cgroups)
    except CgroupError as e:
        raise ProtocolError(str(e)) from None
    kind = obj.get("kind", "cpu")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(f"field 'kind' must be one of {', '.join(KINDS)}")
    title = obj.get("title")
    if title is not None and (not isinstance(title, str) or len(title) > 200):
        raise ProtocolError("field 'title' must be a string of at most 200 characters")
    return Request(
        "snapshot",
        SnapshotRequest(
            seconds=seconds,
            next=nxt,
            since_ns=since_ns,
            drain=drain,
            pids=pids,
            tids=_ids(obj, "tid"),
            comm=_regex(obj, "comm"),
            frame=_regex(obj, "frame"),
            exclude_frame=_regex(obj, "exclude_frame"),
            frames=frames,
            root=root,
            format=fmt,
            title=title,
            units=_names(obj, "unit"),
            containers=_names(obj, "container"),
            pods=_names(obj, "pod"),
            cgroups=cgroup_specs,
            kind=kind,
        ),
    )


#: What every bad_request message ends with: what the daemon expected instead.
EXPECTED_REQUEST = 'expected one line holding a JSON object such as {"request": "status"} (see docs/protocol.md)'
#: Longer integer literals are refused before int() reads them: no field takes one
#: (ids are below 2**32), and Python's own limit (4300 digits) has an unhelpful message.
MAX_INT_DIGITS = 20


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ProtocolError(f"request holds an integer of {digits} digits; pid, tgid and tid take integers in "
                            f"[0, 2^32) and seconds/next a number of seconds (see docs/protocol.md)")
    return int(text)


def _parse_constant(name: str) -> float:
    raise ProtocolError(f"request holds {name}, which is not a JSON number; {EXPECTED_REQUEST}")


#: The longest ``seconds`` or ``next`` a request may give: a week.
_MAX_SECONDS = 7 * 86400


def _number(obj: dict[str, Any], key: str) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= _MAX_SECONDS:
        raise ProtocolError(f"field {key!r} must be a number of seconds above 0 and at most {_MAX_SECONDS} "
                            "(a week)")
    return float(v)


def _items(obj: dict[str, Any], key: str, one: str, many: str) -> list[Any] | None:
    """A field that holds one item or a list of 1..MAX_IDS, as a list (None if absent)."""
    v = obj.get(key)
    if v is None:
        return None
    items = v if isinstance(v, list) else [v]
    if not items or len(items) > MAX_IDS:
        raise ProtocolError(f"field {key!r} must be {one} or a list of 1..{MAX_IDS} {many}")
    return items


def _ids(obj: dict[str, Any], key: str) -> frozenset[int] | None:
    items = _items(obj, key, "an id", "ids")
    if items is None:
        return None
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 1 << 32:
            raise ProtocolError(f"field {key!r} must hold integers in [0, 2^32)")
    return frozenset(items)


def _names(obj: dict[str, Any], key: str) -> tuple[str, ...] | None:
    items = _items(obj, key, "a name", "names")
    if items is None:
        return None
    for i in items:
        if not isinstance(i, str) or not i.strip() or len(i) > MAX_NAME_LENGTH or "\0" in i or "\n" in i:
            raise ProtocolError(f"field {key!r} must hold non-empty names of at most {MAX_NAME_LENGTH} "
                                "characters, without NUL or newline")
    return tuple(i.strip() for i in items)


def _regex(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ProtocolError(f"field {key!r} must be a regular expression (string)")
    try:
        check_regex(v)
    except ValueError as e:
        raise ProtocolError(f"field {key!r}: {e}") from None
    return v


# -- bounded-cost regular expressions -----------------------------------------

class _Matcher(Protocol):
    def search(self, text: str) -> Any: ...


def _re2_compile(pattern: str) -> _Matcher | None:
    """``pattern`` compiled by RE2 (google-re2): matching is linear in the text, whatever the pattern.

    The structural checks below stop exponential patterns, but not polynomial
    ones: ``.*.*.*.*.*.*.*.*=`` has no nested repeat and still takes minutes on
    one 3,000-character C++ frame with Python's backtracking ``re`` (measured
    by tests/faults/test_security_socket.py), holding the GIL the drain needs.
    ``None`` when google-re2 is not installed.
    """
    try:
        import re2
    except ImportError:
        return None
    opts = re2.Options()
    opts.log_errors = False  # a client's bad pattern is its error, not a line in our log
    try:
        return re2.compile(pattern, opts)  # type: ignore[no-any-return]
    except re2.error as e:
        msg = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"unsupported regular expression ({msg}); lookarounds and backreferences "
                         "are not allowed") from None


def compile_filter(pattern: str) -> _Matcher:
    """The matcher the snapshot filter uses: RE2 when installed, else Python's ``re``."""
    return _re2_compile(pattern) or re.compile(pattern)


def check_regex(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern`` if its matching cost is bounded; ValueError otherwise.

    Backtracking blows up when a repeated group can match the same text in
    more than one way: a repeat inside a repeat (``(a+)+``), an alternation
    inside a repeat (``(a|aa)*``), or a backreference.  Those are refused;
    with them gone, and the length capped, matching one frame is polynomial
    in a frame's length, and each unique frame is matched only once.
    """
    if len(pattern) > MAX_REGEX_LENGTH:
        raise ValueError(f"regular expression longer than {MAX_REGEX_LENGTH} characters")
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"invalid regular expression: {e}") from None
    import re._parser as sre_parse  # Python 3.11+ name of the regex parser
    import re._constants as c

    def walk(items: Any, in_repeat: bool) -> None:
        for op, av in items:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
                lo, hi, sub = av
                if in_repeat and hi > 1:
                    raise ValueError("nested repetition (such as (a+)+) is not allowed: its cost is unbounded")
                walk(sub, in_repeat or hi > 1)
            elif op is c.SUBPATTERN:
                walk(av[-1], in_repeat)
            elif op is c.BRANCH:
                if in_repeat:
                    raise ValueError("alternation inside a repetition (such as (a|b)+) is not allowed: "
                                     "its cost is unbounded")
                for alt in av[1]:
                    walk(alt, in_repeat)
            elif op in (c.GROUPREF, c.GROUPREF_EXISTS):
                raise ValueError("backreferences are not allowed")
            elif op in (c.ASSERT, c.ASSERT_NOT):
                walk(av[1], in_repeat)
            elif op is getattr(c, "ATOMIC_GROUP", None):
                walk(av, in_repeat)

    try:
        walk(sre_parse.parse(pattern), False)
    except RecursionError:
        raise ValueError("regular expression nested too deeply") from None
    _re2_compile(pattern)  # refuses what RE2 cannot run in linear time
    return compiled


class SnapshotFilter:
    """Applies a SnapshotRequest's filters to task-keyed counts.

    Regexes are evaluated once per unique comm or frame (cached), which bounds
    the cost by the number of unique frames, not of samples.
    """

    def __init__(self, req: SnapshotRequest) -> None:
        self.req = req
        self.comm_re = compile_filter(req.comm) if req.comm else None
        self.frame_re = compile_filter(req.frame) if req.frame else None
        self.exclude_re = compile_filter(req.exclude_frame) if req.exclude_frame else None
        self._comm_cache: dict[str, bool] = {}
        self._frame_cache: dict[str, bool] = {}
        self._exclude_cache: dict[str, bool] = {}
        self.identity = IdentityQuery(req.units, req.containers, req.pods, req.cgroups)
        self._identity_cache: dict[CgroupIdentity, bool] = {}

    def _match(self, cache: dict[str, bool], rx: _Matcher, text: str) -> bool:
        hit = cache.get(text)
        if hit is None:
            hit = cache[text] = rx.search(text) is not None
        return hit

    def keep_task(self, tgid: int, tid: int, comm: str) -> bool:
        r = self.req
        if r.pids is not None and tgid not in r.pids:
            return False
        if r.tids is not None and tid not in r.tids:
            return False
        if self.comm_re is not None and not self._match(self._comm_cache, self.comm_re, comm):
            return False
        return True

    def keep_identity(self, ident: CgroupIdentity | None) -> bool:
        """Does a task of this cgroup pass the unit/container/pod/cgroup filters?
        A task whose cgroup is unknown passes only when there are none."""
        if not self.identity.active():
            return True
        if ident is None:
            return False
        hit = self._identity_cache.get(ident)
        if hit is None:
            hit = self._identity_cache[ident] = self.identity.matches(ident)
        return hit

    def stack(self, stack: Stack) -> Stack | None:
        """The stack to keep (frames filtered by kind), or ``None`` to drop it."""
        if self.req.frames == "kernel":
            stack = tuple(f for f in stack if f.endswith(KERNEL_SUFFIX) or f in _OFFCPU_MARKERS)
        elif self.req.frames == "user":
            stack = tuple(f for f in stack if not f.endswith(KERNEL_SUFFIX))
        if not stack:
            return None
        if self.frame_re is not None and not any(self._match(self._frame_cache, self.frame_re, f) for f in stack):
            return None
        if self.exclude_re is not None and any(self._match(self._exclude_cache, self.exclude_re, f) for f in stack):
            return None
        return stack

    def apply(self, counts: Mapping[CountKey, int], into: dict[CountKey, int],
              identities: Mapping[int, CgroupIdentity] | None = None, cache: DecodeCache | None = None) -> None:
        """Add the counts that pass to ``into``; ``identities`` (tgid -> identity) for the cgroup filters;
        ``cache``: one per request that reads several packed windows (their keys decoded once)."""
        idents = identities or {}
        for (tgid, tid, comm, stack), n in window_items(counts, {} if cache is None else cache):
            if not self.keep_task(tgid, tid, comm) or not self.keep_identity(idents.get(tgid)):
                continue
            s = self.stack(stack)
            if s is None:
                continue
            key = (tgid, tid, comm, s)
            into[key] = into.get(key, 0) + n


_HEX_PREFIX = re.compile(r"^[0-9a-f]{4,64}$")


@dataclass(frozen=True)
class IdentityQuery:
    """Filters on who owns a task's cgroup: any name of a filter, every filter given (None: no condition).

    ``units``: the unit (``nginx.service``) or its name without the suffix;
    ``containers``: the container's name or an id prefix of 4+ hex digits;
    ``pods``: the pod UID (dashes or underscores); ``cgroups``: a path and
    its subtree, a unit name anywhere in the path, or a cgroup id.
    """

    units: tuple[str, ...] | None = None
    containers: tuple[str, ...] | None = None
    pods: tuple[str, ...] | None = None
    cgroups: tuple[CgroupSpec, ...] | None = None

    def active(self) -> bool:
        return any(f is not None for f in (self.units, self.containers, self.pods, self.cgroups))

    def matches(self, ident: CgroupIdentity) -> bool:
        if self.units is not None:
            # A unit by its name, its stem (nginx), or a template naming its instances (getty@.service).
            unit = ident.unit
            if not unit or not any(u == unit.rsplit(".", 1)[0] or unit_matcher(u)(unit) for u in self.units):
                return False
        if self.containers is not None:
            cid = ident.container_id
            if cid is None or not any(c == ident.container_name or (_HEX_PREFIX.match(c) and cid.startswith(c))
                                      for c in self.containers):
                return False
        if self.pods is not None:
            if ident.pod_uid is None or ident.pod_uid not in {p.replace("_", "-") for p in self.pods}:
                return False
        return self.cgroups is None or any(_cgroup_matches(spec, ident) for spec in self.cgroups)


def _cgroup_matches(spec: CgroupSpec, ident: CgroupIdentity) -> bool:
    if spec.kind == "id":
        return ident.cgroup_id == spec.value
    assert isinstance(spec.value, str)
    if spec.kind == "unit":
        # A template (getty@.service) names its instances, as in [sampling] cgroups.
        matches = unit_matcher(spec.value)
        return any(matches(part) for part in ident.path.split("/"))
    return spec.value == "/" or ident.path == spec.value or ident.path.startswith(spec.value + "/")


def encode_header(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def error_header(message: str, code: str = "bad_request") -> bytes:
    return encode_header({"ok": False, "error": message, "code": code})
