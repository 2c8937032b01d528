"""The daemon's configuration: one frozen dataclass per TOML table.

Every field's default is written next to it and is what runs when the key is
absent.  :func:`load_config` reads ``/etc/flamed/flamed.toml`` (or the file
given), checks every key -- unknown keys, wrong types and out-of-range values
raise :class:`~flamed.errors.ConfigError` naming the key -- and applies
command-line overrides last.  ``packaging/flamed.toml`` documents each key.

Tables of processors (``[processors.NAME]``) are validated against the
options dataclass each processor declares (see
:mod:`flamed.daemon.processors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

from flamed.daemon.paths import file_kind
from flamed.errors import ConfigError
from flamed.fileio import UTF8_BOM
from flamed.sampling.contract import canonical_root

DEFAULT_CONFIG_PATH = "/etc/flamed/flamed.toml"
#: Largest config file read; more is refused, not read to the end.
MAX_CONFIG_BYTES = 1 << 20

ROOT_FRAMES = ("comm", "pid", "tid", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_TARGETS = ("auto", "journal", "stderr")
SAMPLERS = ("bpf", "fake")


#: Bytes of a Unix socket path (sun_path holds 108, the last one a NUL).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class SamplingConfig:
    """``[sampling]``: what the BPF program samples."""

    #: Samples per second on every CPU (1..999). 19 Hz avoids lockstep with timers.
    frequency: int = 19
    #: ``bpf`` (the real sampler) or ``fake`` (synthetic stacks, for tests and demos).
    sampler: str = "bpf"
    #: Seconds between drains of the BPF maps; one window per drain.
    drain_interval: float = 10.0
    #: Perf event: ``auto`` (CPU cycles, else the software cpu-clock), ``cycles`` or ``cpu-clock``.
    event: str = "auto"
    #: Count samples of the idle task (pid 0) too.
    include_idle: bool = False
    #: Only these process ids (tgid) are sampled; empty = all.
    pids: tuple[int, ...] = ()
    #: Only tasks whose comm is one of these (exact, up to 15 bytes); empty = all.
    comms: tuple[str, ...] = ()
    #: Only tasks in these cgroups and below them: v2 paths (/sys/fs/cgroup/system.slice/x.service,
    #: its /sys/fs/cgroup/unified/... form, or /system.slice/x.service), unit names or ids; empty = all.
    #: A re-created cgroup (a restarted unit) is followed.
    cgroups: tuple[str, ...] = ()
    #: Only tasks of these systemd units (nginx.service, getty@.service) wherever they are
    #: in the tree, following restarts; with cgroups, a task in either is sampled.
    units: tuple[str, ...] = ()
    #: Capacity of the stack-trace map (unique stacks between two drains).
    stack_map_size: int = 16384
    #: Frames kept per stack (1..127).
    stack_depth: int = 127
    #: Capacity of each generation of the counts map (unique keys between two drains).
    counts_map_size: int = 65536
    #: Nice value (-20..19) every thread of the daemon takes once it is ready.  Start-up
    #: (compiling and verifying the BPF program, ~2 s of CPU) runs at the nice the daemon
    #: was started with, so that a host full of busy processes does not starve it; a
    #: value below that start nice needs CAP_SYS_NICE (without it, a warning).
    nice: int = 5
    #: Read a process's memory map as soon as it is first sampled, so processes
    #: that exit before the next drain still get their user frames named.
    prime_new_processes: bool = True
    #: At most this many of those reads per second (~90 us of CPU each).
    prime_rate: int = 200
    #: Read a process's memory map again when it maps code after the first read
    #: (a library loaded late: dlopen, an extension module), so that those frames
    #: are named even if it exits before the drain (needs prime_new_processes).
    #: Costs every process on the host a hash lookup in BPF per release of its
    #: memory-map lock: 0-3 % of a fork+exec here (bench/new_code_cost.py).
    reread_new_code: bool = True
    #: Read the Python frames of CPython 3.8-3.13 processes in the BPF program
    #: at every sample (needs prime_new_processes).  Processes it cannot read
    #: (other versions, a layout that fails validation) go to py-spy when
    #: [processors.python] allows it.
    python_frames: bool = True
    #: Python frames kept per stack (a power of 2, 8..512).
    python_depth: int = 128
    #: Distinct Python stacks per drain interval (preallocated, ~1.5 KiB each at depth 128, twice).
    python_stack_map_size: int = 2048
    #: Unwind user stacks from each binary's .eh_frame in the BPF program, so
    #: programs built without frame pointers keep their callers (needs
    #: prime_new_processes).  A stack cut short ends in a [truncated: REASON] frame.
    unwind: bool = True
    #: Frames kept per unwound stack (8..127).
    unwind_depth: int = 64
    #: Rows of all unwind tables together (8 bytes each, preallocated): libc
    #: takes ~28 k, CPython ~65 k, libLLVM ~980 k.  Binaries beyond it keep
    #: frame-pointer stacks (logged once, counted in flamed_unwind_binaries_skipped_total).
    unwind_rows: int = 2_097_152
    #: Distinct unwound stacks per drain interval (preallocated, ~0.5 KiB each at depth 64, twice).
    unwind_stack_map_size: int = 8192
    #: Executable mappings with a table per process (a power of 2, 8..256; 32 bytes
    #: each for each of 4096 processes, preallocated).  A process with more (a
    #: scientific stack's many extension modules) keeps the largest; the others'
    #: frames use frame pointers (logged once, with this setting).
    unwind_maps: int = 64
    #: Where built tables are kept by build id, shared by every flamed on the host
    #: (a table is rebuilt when missing).
    unwind_cache_dir: str = "/var/cache/flamed/unwind"
    #: Where compiled BPF programs are kept, shared by every flamed on the host
    #: (a start whose program is there needs no compiler).  Empty: compiled at
    #: each start.  The compile runs in a short-lived child process either way.
    bpf_cache_dir: str = "/var/cache/flamed/bpf"
    #: Also record off-CPU time: how long each task waited off the CPU, and in
    #: which stack (docs/offcpu.md; its cost grows with context switches).  Each
    #: window then gives a second profile, in separate files (offcpu-HOST-...).
    off_cpu: bool = False
    #: Shortest wait counted, in microseconds (shorter ones are only counted in
    #: flamed_offcpu_waits_total{result="below_threshold"}).
    off_cpu_min_us: int = 1000
    #: Follow one switch off the CPU in N, at random, and count its wait N times
    #: (1: every one); cuts the cost on hosts with many context switches.
    off_cpu_every: int = 1


@dataclass(frozen=True)
class OutputConfig:
    """``[output]``: the rotating folded files."""

    #: Directory of the profile files, created if missing.
    state_dir: str = "/var/lib/flamed/profiles"
    #: Seconds covered by one file; files start at multiples of this (UTC).
    rotate_interval: float = 60.0
    #: Write ``.folded.gz`` instead of ``.folded``.
    compress: bool = False
    #: Root frames: ``comm``, ``pid`` (comm-PID), ``tid`` (comm-PID/TID) or ``none``, or a
    #: comma-separated list, root first, adding ``unit``, ``container``, ``cgroup`` (e.g. ``container,pid``).
    root_frame: str = "pid"
    #: Host name in file names and sidecars; empty = the machine's host name.
    host: str = ""
    #: fsync files and the directory before they count as written.
    fsync: bool = True
    #: Bytes of unwritten files kept in memory while the disk refuses writes (ENOSPC...).
    backlog_max_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class RetentionConfig:
    """``[retention]``: the oldest files go first when any limit is exceeded (0 = no limit)."""

    #: Keep at most this many profile files (7 days of 60 s files).
    max_files: int = 10080
    #: Keep at most this many bytes of profile files and sidecars.
    max_bytes: int = 1024 * 1024 * 1024
    #: Delete files whose window ended more than this many seconds ago (7 days).
    max_age: float = 7 * 24 * 3600.0


@dataclass(frozen=True)
class SnapshotConfig:
    """``[snapshot]``: the in-memory ring of recent windows that snapshots read."""

    #: Seconds of history kept in memory.
    ring_seconds: float = 600.0
    #: At most this many (task, stack) entries over all windows in the ring.
    ring_max_stacks: int = 500_000
    #: Longest ``next`` snapshot a client may ask for, in seconds.
    max_next_seconds: float = 600.0


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint."""

    #: HOST:PORT of the /metrics HTTP server; empty string disables it.
    address: str = "127.0.0.1:9752"
    #: Also serve ``/debug/pprof/profile?seconds=N`` there (pull by Parca, Grafana Alloy, ``go tool pprof``).
    pprof: bool = True
    #: Longest ``seconds`` a profile request may ask for (at most ``snapshot.ring_seconds``).
    pprof_max_seconds: float = 300.0
    #: Profile requests waiting at once; more are answered 429 at once.
    pprof_max_requests: int = 16


@dataclass(frozen=True)
class PyroscopeConfig:
    """``[pyroscope]``: push every window to a Pyroscope server's ``/ingest``."""

    #: Base URL of the server, e.g. ``http://pyroscope:4040``; empty = no push.
    server_address: str = ""
    #: Application name (``name=`` before the tags).
    application_name: str = "flamed"
    #: Tags added to the name, ``{key = "value"}``; ``host`` is added unless set here.
    tags: Mapping[str, str] = field(default_factory=dict)
    #: User for HTTP basic auth; empty = none.
    basic_auth_user: str = ""
    #: File holding the basic auth password (its first line), read at start and reload.
    basic_auth_password_file: str = ""
    #: Tenant, sent as ``X-Scope-OrgID``; empty = none.
    tenant_id: str = ""
    #: Body format: ``pprof`` (with pid/comm/thread/host labels) or ``folded``.
    format: str = "pprof"
    #: Seconds per request.
    timeout: float = 10.0
    #: Windows waiting to be sent; when full the oldest is dropped (and counted).
    max_queue: int = 64
    #: Longest wait between retries of a failed request (the wait doubles from 1 s).
    retry_max_backoff: float = 30.0


@dataclass(frozen=True)
class ControlConfig:
    """``[control]``: the Unix control socket (snapshots, status, flush)."""

    #: Path of the socket (ignored under systemd socket activation).
    socket: str = "/run/flamed/flamed.sock"
    #: Permission bits of the socket file.
    socket_mode: int = 0o660
    #: Group owning the socket file, if that group exists.
    socket_group: str = "flamed"
    #: Users (names or uids) allowed besides root.
    allowed_users: tuple[str, ...] = ()
    #: Groups (names or gids) whose members (primary or supplementary) are allowed.
    allowed_groups: tuple[str, ...] = ("flamed",)
    #: Requests served at once (counted once the request line has arrived); more get a "busy" error.
    max_clients: int = 16
    #: Connections open at once, waiting for their request line or being served; more get "busy".
    #: A connection that sends nothing costs a descriptor until ``request_timeout``, not a thread.
    max_connections: int = 256
    #: Connections one non-root uid may have open at once; more get "busy" (0 = no limit).
    max_connections_per_uid: int = 8
    #: Of ``max_clients`` and ``max_connections``, this many are only for root (at most
    #: ``max_clients - 1``), so other users together can never lock root out.
    reserved_for_root: int = 2
    #: Seconds from connect to a complete request line; clients write it at once.
    request_timeout: float = 1.0
    #: Seconds per send of the response.
    client_timeout: float = 5.0


@dataclass(frozen=True)
class LogConfig:
    """``[log]``."""

    #: ``debug``, ``info``, ``warning`` or ``error``.
    level: str = "info"
    #: ``auto`` (journald under systemd, else stderr), ``journal`` or ``stderr``.
    target: str = "auto"


@dataclass(frozen=True)
class DaemonConfig:
    """The whole configuration; ``source`` is the file it came from (or ``None``)."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    log: LogConfig = field(default_factory=LogConfig)
    pyroscope: PyroscopeConfig = field(default_factory=PyroscopeConfig)
    #: ``[processors.NAME]`` tables, validated by each processor's options class.
    processors: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None

    def with_overrides(self, overrides: Mapping[str, Any]) -> DaemonConfig:
        """Apply ``{"section.key": value}`` overrides (CLI flags), validated like the file."""
        raw: dict[str, dict[str, Any]] = {}
        for dotted, value in overrides.items():
            if value is None:
                continue
            section, _, key = dotted.partition(".")
            raw.setdefault(section, {})[key] = value
        cfg = self
        for section, values in raw.items():
            current = getattr(cfg, section)
            merged = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)}
            merged.update(values)
            cfg = dataclasses.replace(cfg, **{section: build_options(type(current), merged, section)})
        cfg.check()
        return cfg

    def check(self) -> None:
        """Checks across keys (each key's own range is checked when it is read)."""
        if self.output.rotate_interval < self.sampling.drain_interval:
            raise ConfigError(
                f"output.rotate_interval ({self.output.rotate_interval:g} s) must be at least "
                f"sampling.drain_interval ({self.sampling.drain_interval:g} s)"
            )
        if self.metrics.pprof and self.metrics.pprof_max_seconds > self.snapshot.ring_seconds:
            raise ConfigError(
                f"metrics.pprof_max_seconds ({self.metrics.pprof_max_seconds:g} s) must be at most "
                f"snapshot.ring_seconds ({self.snapshot.ring_seconds:g} s): profiles are cut from that ring"
            )
        if self.snapshot.ring_seconds < self.sampling.drain_interval:
            raise ConfigError(
                f"snapshot.ring_seconds ({self.snapshot.ring_seconds:g} s) must be at least "
                f"sampling.drain_interval ({self.sampling.drain_interval:g} s)"
            )
        for key, names in (("control.allowed_users", self.control.allowed_users),
                           ("control.allowed_groups", self.control.allowed_groups),
                           ("control.socket_group", (self.control.socket_group,) if self.control.socket_group else ())):
            for i, n in enumerate(names):
                if not _ID_OR_NAME.fullmatch(n) or (n.isascii() and n.isdigit() and int(n) > MAX_ID):
                    raise ConfigError(f"{key}: {n!r} is neither a name nor an id from 0 to {MAX_ID}")


#: A user or group name (not starting with '-', without ':', '/', blanks or control
#: characters; at most 256 characters), or a numeric id; (uid_t)-1 is no id.
_ID_OR_NAME = re.compile(r"[^\s:/\x00-\x1f\x7f-][^\s:/\x00-\x1f\x7f]{0,255}")
MAX_ID = 4294967294


_SECTIONS: dict[str, type[Any]] = {
    "sampling": SamplingConfig,
    "output": OutputConfig,
    "retention": RetentionConfig,
    "snapshot": SnapshotConfig,
    "metrics": MetricsConfig,
    "control": ControlConfig,
    "log": LogConfig,
    "pyroscope": PyroscopeConfig,
}

# Ranges and choices per dotted key; everything else only has its type checked.
_RANGES: dict[str, tuple[float, float]] = {
    "sampling.frequency": (1, 999),
    "sampling.drain_interval": (0.05, 3600),
    "sampling.stack_map_size": (64, 1 << 24),
    "sampling.stack_depth": (1, 127),
    "sampling.counts_map_size": (64, 1 << 24),
    "sampling.prime_rate": (1, 1_000_000),
    "sampling.python_depth": (8, 512),
    "sampling.nice": (-20, 19),
    "sampling.python_stack_map_size": (16, 1 << 20),
    "sampling.unwind_depth": (8, 127),
    "sampling.unwind_rows": (1024, 1 << 26),
    "sampling.unwind_stack_map_size": (16, 1 << 20),
    "sampling.unwind_maps": (8, 256),
    "sampling.off_cpu_min_us": (0, 3_600_000_000),
    "sampling.off_cpu_every": (1, 1 << 22),
    "output.rotate_interval": (0.05, 86400),
    "output.backlog_max_bytes": (0, 1 << 40),
    "retention.max_files": (0, 1 << 31),
    "retention.max_bytes": (0, 1 << 50),
    "retention.max_age": (0, 100 * 365 * 86400),
    "snapshot.ring_seconds": (0.05, 7 * 86400),
    "snapshot.ring_max_stacks": (1000, 1 << 32),
    "snapshot.max_next_seconds": (0.05, 86400),
    "control.socket_mode": (0, 0o777),
    "control.max_clients": (1, 1024),
    "control.max_connections": (1, 4096),
    "control.max_connections_per_uid": (0, 4096),
    "control.reserved_for_root": (0, 1024),
    "control.request_timeout": (0.01, 3600),
    "control.client_timeout": (0.01, 3600),
    "metrics.pprof_max_seconds": (1, 86400),
    "metrics.pprof_max_requests": (1, 1024),
    "pyroscope.timeout": (0.1, 3600),
    "pyroscope.max_queue": (1, 1 << 20),
    "pyroscope.retry_max_backoff": (1, 86400),
}
#: Ranges of each element of a list key: a process id is at most PID_MAX_LIMIT (2^22) on Linux.
_ELEMENT_RANGES: dict[str, tuple[int, int]] = {
    "sampling.pids": (0, 1 << 22),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "sampling.sampler": SAMPLERS,
    "sampling.event": ("auto", "cycles", "cpu-clock"),
    "log.level": LOG_LEVELS,
    "log.target": LOG_TARGETS,
    "pyroscope.format": ("pprof", "folded"),
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.I)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_BYTE_KEYS = {"output.backlog_max_bytes", "retention.max_bytes"}
_SECOND_KEYS = {
    "sampling.drain_interval",
    "output.rotate_interval",
    "retention.max_age",
    "snapshot.ring_seconds",
    "snapshot.max_next_seconds",
    "control.client_timeout",
    "control.request_timeout",
    "metrics.pprof_max_seconds",
    "pyroscope.timeout",
    "pyroscope.retry_max_backoff",
}
#: Pyroscope's label names; values must not break the ``name{k=v,...}`` syntax.
_TAG_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_TAG_BAD_VALUE = re.compile(r"[{},=\s]")


def _convert(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the type ``hint`` of ``key``; returns the converted value."""
    origin = get_origin(hint)
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {_describe(value)}")
        tags: dict[str, str] = {}
        for k, v in value.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = str(v)
            if not isinstance(v, str):
                raise ConfigError(f"{key}.{k}: expected a string, got {_describe(v)}")
            if not _TAG_KEY.match(k):
                raise ConfigError(f"{key}.{k}: a tag name is letters, digits, _ and . (not first)")
            if not v or _TAG_BAD_VALUE.search(v):
                raise ConfigError(f"{key}.{k}: {v!r}: a tag value must be non-empty, without spaces, "
                                  "braces, commas or '='")
            tags[k] = v
        return tags
    if origin is tuple:
        (elem, _ellipsis) = get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {_describe(value)}")
        out = []
        for i, v in enumerate(value):
            if elem is str and isinstance(v, int) and not isinstance(v, bool):
                v = str(v)  # uids/gids may be written as numbers
            out.append(_convert(f"{key}[{i}]", v, elem))
        return tuple(out)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, str) and key in _BYTE_KEYS:
            m = _SIZE.match(value)
            if m is None:
                raise ConfigError(f"{key}: expected a size such as 1048576, \"512M\" or \"1G\", got {value!r}")
            value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()[:1]])
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, str) and key in _SECOND_KEYS:
            m = _DURATION.match(value)
            if m is None:
                raise ConfigError(f"{key}: expected seconds such as 10, 2.5 or \"5m\", got {value!r}")
            value = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "").lower()]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
        if "\x00" in value:
            raise ConfigError(f"{key}: NUL byte in string")
        return value
    raise ConfigError(f"{key}: unsupported option type {hint!r}")  # a bug in an options class


def _describe(value: Any) -> str:
    name = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}.get(
        type(value), type(value).__name__
    )
    text = repr(value)
    return f"{name} {text[:40]}"


def _shown(dotted: str, x: float) -> str:
    """A value or bound of a range as the file would hold it: whole numbers in
    full (``3600000000``, not ``3.6e+09``), file modes in octal."""
    if dotted == "control.socket_mode" and isinstance(x, int):
        return oct(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e18):
        return str(int(x))
    return f"{x:g}"


def build_options(cls: type[Any], raw: Mapping[str, Any], prefix: str) -> Any:
    """An instance of the frozen dataclass ``cls`` from a TOML table, every key checked.

    Used for the daemon's own tables and for each processor's options class.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix}: expected a table, got {_describe(raw)}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}"
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key (known keys of [{prefix}]: {', '.join(sorted(names))})")
        v = _convert(dotted, value, hints[key])
        if dotted in _RANGES:
            lo, hi = _RANGES[dotted]
            if not lo <= v <= hi:
                raise ConfigError(f"{dotted}: {_shown(dotted, v)} is out of range "
                                  f"[{_shown(dotted, lo)}, {_shown(dotted, hi)}]")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ConfigError(f"{dotted}: must not be negative, got {v!r}")
        if dotted in _ELEMENT_RANGES:
            lo, hi = _ELEMENT_RANGES[dotted]
            for i, x in enumerate(v):
                if not lo <= x <= hi:
                    raise ConfigError(f"{dotted}[{i}]: {x} is out of range [{lo}, {hi}]")
        if dotted in _CHOICES and v not in _CHOICES[dotted]:
            raise ConfigError(f"{dotted}: {v!r} is not one of {', '.join(_CHOICES[dotted])}")
        values[key] = v
    if prefix == "metrics" and "address" in values and values["address"]:
        parse_address(values["address"], key="metrics.address")
    if prefix == "pyroscope" and values.get("server_address"):
        url = values["server_address"]
        if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", url):
            raise ConfigError(f"pyroscope.server_address: expected a URL such as http://pyroscope:4040, got {url!r}")
    if prefix == "control" and "socket" in values and not values["socket"]:
        raise ConfigError("control.socket: must not be empty")
    if prefix == "control" and len(os.fsencode(values.get("socket", ""))) > MAX_SOCKET_PATH:
        raise ConfigError(f"control.socket: {len(os.fsencode(values['socket']))} bytes is too long for a Unix "
                          f"socket path (at most {MAX_SOCKET_PATH}); choose a shorter path")
    if prefix == "output" and "state_dir" in values and not values["state_dir"]:
        raise ConfigError("output.state_dir: must not be empty")
    if prefix == "output" and "root_frame" in values:
        values["root_frame"] = root_frame_spec(values["root_frame"], key="output.root_frame")
    return cls(**values)


def root_frame_spec(text: str, *, key: str) -> str:
    """A valid root spec in its canonical spelling (``"container, pid"`` -> ``"container,pid"``)."""
    try:
        return canonical_root(text)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def parse_address(text: str, *, key: str = "metrics.address") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to ``(host, port)``."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise ConfigError(f"{key}: expected HOST:PORT such as 127.0.0.1:9752, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    p = int(port)
    if not 0 <= p <= 65535:
        raise ConfigError(f"{key}: port {p} is out of range [0, 65535]")
    return host, p


def config_from_dict(raw: Mapping[str, Any], *, source: str | None = None) -> DaemonConfig:
    """Validate a parsed TOML document."""
    sections: dict[str, Any] = {}
    for name, table in raw.items():
        if name == "processors":
            if not isinstance(table, Mapping):
                raise ConfigError(f"processors: expected a table of [processors.NAME] tables, got {_describe(table)}")
            procs: dict[str, Any] = {}
            for pname, ptable in table.items():
                if not isinstance(ptable, Mapping):
                    raise ConfigError(f"processors.{pname}: expected a table, got {_describe(ptable)}")
                procs[pname] = dict(ptable)
            sections["processors"] = procs
            continue
        cls = _SECTIONS.get(name)
        if cls is None:
            known = ", ".join(sorted([*_SECTIONS, "processors"]))
            raise ConfigError(f"{name}: unknown table (known tables: {known})")
        sections[name] = build_options(cls, table, name)
    cfg = DaemonConfig(**sections, source=source)
    cfg.check()
    return cfg


def _decode_toml(file: str, data: bytes) -> str:
    """The file's text; TOML is UTF-8, and tomllib's own decode error would be a bare traceback."""
    if data.startswith(UTF8_BOM):
        # What some editors put first; tomllib's "Invalid statement (at line 1, column 1)" does not say it.
        raise ConfigError(f"{file}: starts with a UTF-8 byte order mark (bytes ef bb bf), which TOML does not "
                          "allow: re-save the file as UTF-8 without BOM")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{file}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                          f"(line {line}, column {col}); TOML files must be UTF-8: re-save the file "
                          "as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _not_regular(file: str, mode: int) -> ConfigError:
    return ConfigError(f"{file}: {file_kind(mode)}, not a regular file; the config must be a regular file "
                       "(it is read again at every reload, SIGHUP)")


def _read_regular_file(file: str) -> bytes:
    """The first ``MAX_CONFIG_BYTES + 1`` bytes of ``file``, which must be a regular file.

    Never blocks: a FIFO with no writer, a pipe (``--config <(...)``, read empty the
    second time), a socket or a device is refused, not waited on or read.  The stat
    before the open keeps devices from being opened at all (opening some has side
    effects); the check that counts is the fstat of the descriptor opened with
    O_NONBLOCK, since the path may be replaced between the two.
    """
    st = os.stat(file)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(file, st.st_mode)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket put there since the stat: open() cannot open one
            mode = 0
            with contextlib.suppress(OSError):
                mode = os.stat(file).st_mode
            if mode and not stat.S_ISREG(mode):
                raise _not_regular(file, mode) from None
        raise
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(file, mode)
        return f.read(MAX_CONFIG_BYTES + 1)  # bounded: a file still being written must not take all memory


def load_config(path: str | None = None, *, overrides: Mapping[str, Any] | None = None,
                missing_ok: bool | None = None) -> DaemonConfig:
    """Read and validate the config file, then apply ``overrides``.

    ``path=None`` means the default ``/etc/flamed/flamed.toml``, which may be
    absent (defaults apply); an explicitly named file must exist.
    """
    explicit = path is not None
    file = path if path is not None else DEFAULT_CONFIG_PATH
    if missing_ok is None:
        missing_ok = not explicit
    try:
        data = _read_regular_file(file)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{file}: more than {MAX_CONFIG_BYTES >> 20} MiB: not a flamed config "
                              "(packaging/flamed.toml, every key with its comment, is 8 KiB)")
        raw = tomllib.loads(_decode_toml(file, data))
    except FileNotFoundError:
        if os.path.islink(file):
            # Someone meant a file to be there: not "no file, all defaults", even for the default path.
            raise ConfigError(f"{file}: a symbolic link to {os.readlink(file)!r}, which does not exist") from None
        if not missing_ok:
            raise ConfigError(f"{file}: no such config file") from None
        cfg = DaemonConfig()
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from None
    except OSError as e:
        # Any read error (EACCES, ELOOP, EIO...) is a config error: exit 2 at start
        # (a restart would not help), running config kept on reload.
        raise ConfigError(f"{file}: cannot read: {e.strerror or e}") from None
    else:
        try:
            cfg = config_from_dict(raw, source=os.path.abspath(file))
        except ConfigError as e:
            raise ConfigError(f"{file}: {e}") from None
    if overrides:
        cfg = cfg.with_overrides(overrides)
    return cfg
