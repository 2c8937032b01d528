"""Which service, container or pod a sample came from: cgroup v2 identities.

The BPF program can stamp each sample with ``bpf_get_current_cgroup_id()``:
the 64-bit id of the task's cgroup in the v2 hierarchy.  On 64-bit kernels
since 5.5 that id is the inode number of the cgroup's directory (kernfs hands
the same number to ``stat`` and to ``readdir``), so a walk of the hierarchy
with ``os.scandir`` maps ids to paths without one ``stat`` per directory.

A path names its owner by convention: systemd puts services in
``system.slice/NAME.service``, container runtimes put each container in a
scope (``docker-<id>.scope``, ``cri-containerd-<id>.scope``...) or, with the
cgroupfs driver, a directory named by the bare id (``/docker/<id>``,
``/kubepods/burstable/pod<uid>/<id>``), and the kubelet puts each pod in
``kubepods[-QOS]-pod<uid with _>.slice`` or ``pod<uid>``.

Hosts come in two layouts: pure v2 (cgroup2 mounted at ``/sys/fs/cgroup``)
and hybrid (v1 controllers under ``/sys/fs/cgroup/<controller>``, v2 at
``/sys/fs/cgroup/unified``).  A filter written as ``/sys/fs/cgroup/X`` means
the same cgroup on both, so it is translated to the v2 path of either.

Public pieces: :func:`find_v2_hierarchy`, :class:`CgroupIdentity` (and
:func:`identity_from_path`), :class:`CgroupResolver`,
:func:`parse_cgroup_spec` and :class:`CgroupFilter`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from flamed.errors import ConfigError
from flamed.model import sanitize_frame

log = logging.getLogger("flamed.sampling.cgroups")

#: Where users (and systemd's documentation) say cgroups live, whatever the layout.
SYSFS_CGROUP = "/sys/fs/cgroup"
#: The v2 mount point of a hybrid host.
HYBRID_UNIFIED = "/sys/fs/cgroup/unified"

#: Directory names of v1 hierarchies under /sys/fs/cgroup on hybrid and
#: legacy hosts; a filter naming one of them asks for a v1 cgroup.
V1_HIERARCHIES = frozenset({
    "blkio", "cpu", "cpuacct", "cpu,cpuacct", "cpuacct,cpu", "cpuset", "devices", "elogind",
    "freezer", "hugetlb", "memory", "misc", "net_cls", "net_cls,net_prio", "net_prio",
    "net_prio,net_cls", "perf_event", "pids", "rdma", "systemd",
})

#: How many leading hex digits of a container id name it in frames and
#: service_name (what ``docker ps`` shows).
SHORT_ID = 12

_HEX64 = "[0-9a-f]{64}"
# A runtime's prefixed form: a systemd scope, or the cgroupfs driver's
# directory of crio and podman (which keep the prefix without ".scope").
_PREFIXED = re.compile(rf"^(docker|cri-containerd|crio|libpod)-({_HEX64})(?:\.scope)?$")
_BARE = re.compile(rf"^{_HEX64}$")
_RUNTIMES = {"docker": "docker", "cri-containerd": "containerd", "crio": "crio", "libpod": "podman"}
# cgroupfs-driver parents whose bare-id children belong to a known runtime;
# under /kubepods the runtime is whichever CRI the kubelet talks to, unknown here.
_BARE_PARENTS = {"docker": "docker", "libpod_parent": "podman"}
# Pod UIDs are UUIDs (8-4-4-4-12) except static pods', which are a 32-hex hash.
_UID = "[0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12}"
_POD_SLICE = re.compile(rf"^kubepods(?:-[a-z]+)?-pod({_UID})\.slice$")
_POD_DIR = re.compile(rf"^pod({_UID})$")
_UNIT_SUFFIXES = (".service", ".scope")
_SPEC_SUFFIXES = (".service", ".scope", ".slice")
# What the kernel appends to the v2 line of /proc/PID/cgroup once the
# process's cgroup has been removed (a zombie's, or a task about to move).
_DELETED = " (deleted)"


class CgroupError(ConfigError):
    """A cgroup filter that cannot be used as written, or no cgroup v2 to filter on."""


# -- the hierarchy ---------------------------------------------------------------


@dataclass(frozen=True)
class Hierarchy:
    """Where the cgroup v2 tree is.

    ``path`` is the directory to read (under the ``sys_root`` given to
    :func:`find_v2_hierarchy`, so tests can point it at a fake tree);
    ``mount_point`` is the mount point as /proc/self/mountinfo names it;
    ``mount_root`` is the cgroup the mount shows as its top, relative to
    this process's cgroup namespace ("/" unless a container bind-mounted a
    subtree); ``hybrid`` is true when v1 hierarchies are mounted as well.
    """

    path: Path
    mount_point: str = SYSFS_CGROUP
    mount_root: str = "/"
    hybrid: bool = False

    def dir_of(self, cgroup_path: str) -> Path:
        """The directory of the cgroup at ``cgroup_path`` (relative to the v2 root)."""
        rel = cgroup_path.strip("/")
        return self.path / rel if rel else self.path

    def visible(self, ns_path: str) -> str | None:
        """A path from /proc/PID/cgroup as a path under this mount, or None if outside it."""
        if "/../" in ns_path + "/":  # outside this process's cgroup namespace
            return None
        if self.mount_root == "/":
            return ns_path
        if ns_path == self.mount_root:
            return "/"
        if ns_path.startswith(self.mount_root + "/"):
            return ns_path[len(self.mount_root):]
        return None

    def describe(self) -> str:
        layout = "hybrid, v1 controllers beside it" if self.hybrid else "unified"
        return f"cgroup2 at {self.mount_point} ({layout})"


def _unescape_mountinfo(field_text: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def _host_dir(mount_point: str, sys_root: Path) -> Path:
    if mount_point == "/sys" or mount_point.startswith("/sys/"):
        return sys_root / mount_point[len("/sys/"):]
    return Path(mount_point)


def find_v2_hierarchy(
    proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")
) -> tuple[Hierarchy | None, str]:
    """The cgroup v2 hierarchy of this host, from ``proc_root``/self/mountinfo.

    Returns ``(hierarchy, description)``, or ``(None, reason)`` when there is
    no usable cgroup2 mount.  Preference: /sys/fs/cgroup (pure v2), then
    /sys/fs/cgroup/unified (hybrid), then any other cgroup2 mount, mounts of
    the whole tree before mounts of a subtree.
    """
    mountinfo = proc_root / "self" / "mountinfo"
    try:
        text = mountinfo.read_text(errors="surrogateescape")
    except OSError as e:
        return None, f"cannot read {mountinfo}: {e.strerror}"
    # A later mount on the same point hides the earlier one: keep the last.
    visible: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        visible[_unescape_mountinfo(fields[4])] = (tail[0], _unescape_mountinfo(fields[3]))
    v2 = {point: root for point, (fstype, root) in visible.items() if fstype == "cgroup2"}
    hybrid = any(fstype == "cgroup" for fstype, _ in visible.values())
    if not v2:
        if hybrid:
            return None, ("only cgroup v1 is mounted (legacy layout); boot with "
                          "systemd.unified_cgroup_hierarchy=1 or mount cgroup2 at /sys/fs/cgroup/unified")
        return None, f"no cgroup2 file system in {mountinfo}"
    preferred = {SYSFS_CGROUP: 0, HYBRID_UNIFIED: 1}
    point = min(v2, key=lambda p: (v2[p] != "/", preferred.get(p, 2), p))
    h = Hierarchy(path=_host_dir(point, sys_root), mount_point=point, mount_root=v2[point], hybrid=hybrid)
    if not h.path.is_dir():
        return None, f"cgroup2 is mounted at {point} but {h.path} is not a readable directory"
    return h, h.describe()


# -- identities --------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupIdentity:
    """Who owns a cgroup, as far as its path tells.

    ``path`` is relative to the v2 root with a leading '/'; ``cgroup_id`` is
    the v2 id when known (None for a cgroup that no longer exists);
    ``container_name`` is filled by a resolver's ``container_names`` hook.
    """

    path: str
    unit: str | None = None
    slice: str | None = None
    container_id: str | None = None
    pod_uid: str | None = None
    runtime: str | None = None
    cgroup_id: int | None = None
    container_name: str | None = None

    @property
    def service_name(self) -> str | None:
        """A container's name (else its short id), or the unit without its suffix."""
        if self.container_id is not None:
            return self.container_name or self.container_id[:SHORT_ID]
        if self.unit is not None:
            return self.unit.rsplit(".", 1)[0]
        return None

    def labels(self) -> dict[str, str]:
        """The known ones of ``cgroup``, ``service_name``, ``container_id`` and ``pod``.

        The names are the fleet's: Grafana Alloy's ``service_name``,
        OpenTelemetry's ``container.id`` and the pod UID (``k8s.pod.uid``).
        """
        out = {"cgroup": self.path}
        candidates = (("service_name", self.service_name), ("container_id", self.container_id),
                      ("pod", self.pod_uid))
        out.update((k, v) for k, v in candidates if v)
        return out

    def root_frame(self, kind: Literal["unit", "container", "cgroup"]) -> str:
        """A frame to put at the root of this cgroup's stacks in folded output.

        ``unit``: the systemd unit, or ``[no unit]``; ``container``: the
        container's name or short id, or ``[host]``; ``cgroup``: the path.
        """
        if kind == "unit":
            name = self.unit or "[no unit]"
        elif kind == "container":
            name = self.container_name or (self.container_id[:SHORT_ID] if self.container_id else "[host]")
        elif kind == "cgroup":
            name = self.path
        else:
            raise ValueError(f"root frame kind {kind!r}: expected unit, container or cgroup")
        return sanitize_frame(name)


def _container(parts: list[str]) -> tuple[str | None, str | None]:
    """(container id, runtime) from the innermost component that names a container."""
    for i in range(len(parts) - 1, -1, -1):
        m = _PREFIXED.match(parts[i])
        if m:
            return m.group(2), _RUNTIMES[m.group(1)]
        if _BARE.match(parts[i]):
            return parts[i], _BARE_PARENTS.get(parts[i - 1]) if i else None
    return None, None


def _pod(parts: list[str]) -> str | None:
    for part in reversed(parts):
        m = _POD_SLICE.match(part) or _POD_DIR.match(part)
        if m:
            return m.group(1).replace("_", "-")
    return None


def identity_from_path(path: str, cgroup_id: int | None = None) -> CgroupIdentity:
    """Parse a cgroup path (relative to the v2 root) into its owner's names."""
    parts = [p for p in path.split("/") if p]
    unit_at = next((i for i in range(len(parts) - 1, -1, -1) if parts[i].endswith(_UNIT_SUFFIXES)), None)
    slice_end = len(parts) if unit_at is None else unit_at
    slice_name = next((p for p in reversed(parts[:slice_end]) if p.endswith(".slice")), None)
    container_id, runtime = _container(parts)
    return CgroupIdentity(
        path="/" + "/".join(parts),
        unit=parts[unit_at] if unit_at is not None else None,
        slice=slice_name,
        container_id=container_id,
        pod_uid=_pod(parts),
        runtime=runtime,
        cgroup_id=cgroup_id,
    )


# -- the resolver ------------------------------------------------------------------


@dataclass
class ResolverStats:
    hits: int = 0  # ids answered from the cache
    indexed: int = 0  # misses answered from the path index of the last scan
    rescans: int = 0
    rescan_seconds: float = 0.0
    rate_limited: int = 0  # misses left unresolved because a scan ran too recently
    unresolved: int = 0  # ids not in the hierarchy even after a fresh scan


def _read_v2_line(cgroup_file: Path) -> str | None:
    try:
        text = cgroup_file.read_text(errors="surrogateescape")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


class CgroupResolver:
    """cgroup v2 id -> :class:`CgroupIdentity`, for ids read from BPF samples.

    Identities are cached by id; cgroup ids are never reused, so a cached
    identity stays right for as long as the cgroup exists.  A miss consults
    the path index of the last walk of the tree (built on the first miss);
    an id not in it is a cgroup created since, so the tree is walked again,
    at most once per ``min_rescan_interval`` seconds (ids of cgroups that
    vanished before any walk would otherwise cost a walk each).  Each walk
    drops the cached identities of cgroups that are gone.

    Safe to share between threads: the walk and the cache updates hold a lock.
    """

    def __init__(
        self,
        hierarchy: Hierarchy,
        *,
        proc_root: Path = Path("/proc"),
        min_rescan_interval: float = 1.0,
        container_names: Callable[[CgroupIdentity], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hierarchy = hierarchy
        self.proc_root = proc_root
        self.min_rescan_interval = min_rescan_interval
        self.stats = ResolverStats()
        self._container_names = container_names
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[int, CgroupIdentity] = {}
        self._by_path: dict[str, int] = {}
        self._by_id: dict[int, str] = {}
        self._scanned_at: float | None = None

    @classmethod
    def for_host(
        cls,
        proc_root: Path = Path("/proc"),
        sys_root: Path = Path("/sys"),
        *,
        min_rescan_interval: float = 1.0,
        container_names: Callable[[CgroupIdentity], str | None] | None = None,
    ) -> CgroupResolver:
        """A resolver on this host's v2 hierarchy; :class:`CgroupError` (saying why) if none."""
        h, why = find_v2_hierarchy(proc_root, sys_root)
        if h is None:
            raise CgroupError(f"no cgroup v2 hierarchy: {why}")
        return cls(h, proc_root=proc_root, min_rescan_interval=min_rescan_interval,
                   container_names=container_names)

    # The index ---------------------------------------------------------------

    def _walk(self) -> Iterator[tuple[str, int]]:
        root = self.hierarchy.path
        yield "/", os.stat(root).st_ino
        stack = [("", str(root))]
        while stack:
            rel, real = stack.pop()
            try:
                entries = list(os.scandir(real))
            except OSError:  # removed while we walked: its ids go with it
                continue
            for e in entries:
                try:
                    if not e.is_dir(follow_symlinks=False):
                        continue
                    child = f"{rel}/{e.name}"
                    yield child, e.inode()
                except OSError:
                    continue
                stack.append((child, e.path))

    def rescan(self, *, force: bool = False) -> bool:
        """Walk the tree again unless one ran within ``min_rescan_interval`` (``force`` ignores it).

        Returns whether it walked.
        """
        with self._lock:
            return self._rescan_locked(force)

    def _rescan_locked(self, force: bool) -> bool:
        now = self._clock()
        if not force and self._scanned_at is not None and now - self._scanned_at < self.min_rescan_interval:
            return False
        t0 = time.perf_counter()
        by_path = dict(self._walk())
        self._by_path = by_path
        self._by_id = {i: p for p, i in by_path.items()}
        for gone in [i for i in self._cache if i not in self._by_id]:
            del self._cache[gone]
        self._scanned_at = now
        self.stats.rescans += 1
        self.stats.rescan_seconds += time.perf_counter() - t0
        return True

    def index(self) -> Mapping[str, int]:
        """path -> id of every cgroup at the last walk (walking first if none ran yet)."""
        with self._lock:
            if self._scanned_at is None:
                self._rescan_locked(True)
            return self._by_path

    # Lookups -------------------------------------------------------------------

    def _identity(self, path: str, cgroup_id: int | None) -> CgroupIdentity:
        ident = identity_from_path(path, cgroup_id)
        if ident.container_id is not None and self._container_names is not None:
            name = self._container_names(ident)
            if name:
                ident = replace(ident, container_name=name)
        return ident

    def resolve(self, cgroup_id: int) -> CgroupIdentity | None:
        """The identity of the cgroup with this v2 id, or None if it is not (or no longer) there."""
        ident = self._cache.get(cgroup_id)
        if ident is not None:
            self.stats.hits += 1
            return ident
        with self._lock:
            fresh = self._scanned_at is None and self._rescan_locked(True)
            path = self._by_id.get(cgroup_id)
            if path is None and not fresh:
                if not self._rescan_locked(False):
                    self.stats.rate_limited += 1
                    return None
                fresh = True
                path = self._by_id.get(cgroup_id)
            if path is None:
                self.stats.unresolved += 1
                return None
            if not fresh:
                self.stats.indexed += 1
            ident = self._identity(path, cgroup_id)
            self._cache[cgroup_id] = ident
            return ident

    def id_of_path(self, path: str) -> int | None:
        """The current id of the cgroup at ``path`` (relative to the v2 root), by ``stat``."""
        try:
            return os.stat(self.hierarchy.dir_of(path)).st_ino
        except OSError:
            return None

    def path_of_pid(self, pid: int) -> tuple[str, bool] | None:
        """(v2 path, still exists) from /proc/PID/cgroup; None if the process is gone or outside the mount."""
        line = _read_v2_line(self.proc_root / str(pid) / "cgroup")
        if line is None:
            return None
        deleted = line.endswith(_DELETED)
        path = self.hierarchy.visible(line[: -len(_DELETED)] if deleted else line)
        return None if path is None else (path, not deleted)

    def identity_of_pid(self, pid: int) -> CgroupIdentity | None:
        """The identity of a process's cgroup, read from /proc, with the id from ``stat``.

        The id is None when the cgroup was removed (the kernel marks the
        line " (deleted)"; a cgroup re-created at the same path is another
        one).  The identity is cached under its id, so the BPF side's id for
        the same cgroup then hits.  None if the process is gone, has no v2
        line or its cgroup is outside the mounted tree.
        """
        found = self.path_of_pid(pid)
        if found is None:
            return None
        path, exists = found
        cgroup_id = self.id_of_path(path) if exists else None
        if cgroup_id is None:
            return self._identity(path, None)
        ident = self._cache.get(cgroup_id)
        if ident is None or ident.path != path:
            ident = self._identity(path, cgroup_id)
            with self._lock:
                self._cache[cgroup_id] = ident
        return ident


# -- filters -----------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupSpec:
    """One parsed cgroup filter.

    ``kind`` is ``path`` (``value``: a path relative to the v2 root, leading
    '/'), ``unit`` (``value``: a unit name, matched wherever it appears; a
    template like ``getty@.service`` matches its instances) or ``id``
    (``value``: a v2 cgroup id, matched as is).  ``text`` is what was written.
    """

    text: str
    kind: Literal["path", "unit", "id"]
    value: str | int

    def __str__(self) -> str:
        return self.text


def _strip_prefix(text: str, prefix: str) -> str | None:
    if text == prefix:
        return "/"
    if text.startswith(prefix + "/"):
        return text[len(prefix):]
    return None


def _refuse(key: str, text: str, why: str) -> CgroupError:
    return CgroupError(f"{key}: {text!r}: {why}")


_FORMS = ("write a unit (nginx.service), a path under the cgroup v2 root "
          "(/system.slice/nginx.service) or /sys/fs/cgroup/system.slice/nginx.service")


def parse_cgroup_spec(text: str | int, hierarchy: Hierarchy | None = None, *, key: str = "cgroups") -> CgroupSpec:
    """Parse one cgroup filter; :class:`CgroupError` says what to write instead.

    Accepted, identically on pure-v2 and hybrid hosts: a unit name
    (``nginx.service``, ``*.scope``, ``*.slice``), a path relative to the v2
    root (``/system.slice/nginx.service`` or ``system.slice/nginx.service``),
    ``/sys/fs/cgroup/...`` or ``/sys/fs/cgroup/unified/...`` (both the same
    v2 path), the v2 mount point of ``hierarchy`` followed by a path, and a
    cgroup id (digits).  Paths into a v1 hierarchy
    (``/sys/fs/cgroup/cpu/...``) are refused.  Whether the cgroup exists is
    not checked here (see :class:`CgroupFilter`).
    """
    if isinstance(text, int):
        return CgroupSpec(str(text), "id", text)
    raw = text.strip()
    if not raw:
        raise _refuse(key, text, f"empty; {_FORMS}")
    if any(c in raw for c in "\0\n"):
        raise _refuse(key, text, f"a cgroup name has no NUL or newline; {_FORMS}")
    if raw.isdigit():
        return CgroupSpec(text, "id", int(raw))
    if "/" not in raw:
        if raw.endswith(_SPEC_SUFFIXES) and raw not in _SPEC_SUFFIXES:
            return CgroupSpec(text, "unit", raw)
        raise _refuse(key, text, f"neither a unit nor a path: write {raw}.service for the unit, "
                                 f"or /{raw} for the cgroup of that name at the cgroup v2 root")
    rel: str | None = None
    if hierarchy is not None and hierarchy.mount_point not in (SYSFS_CGROUP, HYBRID_UNIFIED):
        rel = _strip_prefix(raw, hierarchy.mount_point.rstrip("/"))
    if rel is None:
        rel = _strip_prefix(raw, HYBRID_UNIFIED)
    if rel is None:
        rel = _strip_prefix(raw, SYSFS_CGROUP)
        if rel is not None:
            first, _, rest = rel.strip("/").partition("/")
            if first in V1_HIERARCHIES:
                hint = f"/sys/fs/cgroup/{rest} (or {rest.rsplit('/', 1)[-1]})" if rest else "/sys/fs/cgroup/PATH"
                raise _refuse(key, text, f"that is in the cgroup v1 {first} hierarchy; flamed filters on "
                                         f"cgroup v2, where the same cgroup is {hint}")
    if rel is None:
        if raw.startswith(("/sys/", "/proc/")) or raw == "/sys":
            raise _refuse(key, text, f"not under /sys/fs/cgroup; {_FORMS}")
        rel = raw if raw.startswith("/") else "/" + raw
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _refuse(key, text, "write the path without '.' or '..' components, e.g. /system.slice/nginx.service")
    return CgroupSpec(text, "path", "/" + "/".join(parts))


@dataclass(frozen=True)
class FilterChange:
    """A cgroup a filter names that appeared, went away or was re-created with a new id."""

    spec: CgroupSpec
    path: str
    old_id: int | None
    new_id: int | None

    @property
    def kind(self) -> Literal["created", "removed", "re-created"]:
        if self.old_id is None:
            return "created"
        return "removed" if self.new_id is None else "re-created"

    def __str__(self) -> str:
        if self.kind == "created":
            return f"cgroup {self.path} ({self.spec}) created, id {self.new_id}"
        if self.kind == "removed":
            return f"cgroup {self.path} ({self.spec}) removed, was id {self.old_id}"
        return f"cgroup {self.path} ({self.spec}) re-created, now id {self.new_id} (was {self.old_id})"


@dataclass(frozen=True)
class FilterRefresh:
    """What :meth:`CgroupFilter.refresh` found: ids to add to and delete from the BPF map."""

    added: frozenset[int] = frozenset()
    removed: frozenset[int] = frozenset()
    changes: tuple[FilterChange, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changes)


class CgroupFilter:
    """The set of cgroup ids a list of filter specs names, kept current.

    The BPF program compares the sampled task's own cgroup id, so with
    ``subtree`` (the default) a path, unit or id stands for its cgroup and
    every cgroup below it (a service's delegated children, a slice's units;
    an id that names no cgroup of the tree now stands for itself alone).
    :meth:`refresh` walks the tree again
    and reports the ids to add and delete, and which named cgroups appeared,
    went away or were re-created (a restarted unit gets a new cgroup, with a
    new id, at the same path).

    ``require_present`` refuses, at construction, a path or unit that names
    no current cgroup (a typo would otherwise filter out everything).
    """

    def __init__(
        self,
        specs: Iterable[str | int | CgroupSpec],
        resolver: CgroupResolver,
        *,
        key: str = "cgroups",
        subtree: bool = True,
        require_present: bool = False,
    ) -> None:
        self.resolver = resolver
        self.subtree = subtree
        self.specs = tuple(s if isinstance(s, CgroupSpec) else parse_cgroup_spec(s, resolver.hierarchy, key=key)
                           for s in specs)
        self._matched = self._match(resolver.index())
        self._ids = self._collect(resolver.index())
        if require_present:
            missing = self.missing()
            if missing:
                where = resolver.hierarchy.mount_point
                names = ", ".join(repr(s.text) for s in missing)
                raise CgroupError(f"{key}: no cgroup {names} under {where} now; start the unit or container "
                                  f"first, or check the name (systemctl status, or ls {where})")

    def ids(self) -> frozenset[int]:
        """The cgroup ids to write into the BPF filter map."""
        return self._ids

    def matched(self) -> Mapping[CgroupSpec, Mapping[str, int]]:
        """Per spec, the cgroups (path -> id) it names, without their subtrees."""
        return self._matched

    def missing(self) -> tuple[CgroupSpec, ...]:
        """Path and unit specs that name no current cgroup."""
        return tuple(s for s in self.specs if s.kind != "id" and not self._matched[s])

    def _match(self, index: Mapping[str, int]) -> dict[CgroupSpec, dict[str, int]]:
        out: dict[CgroupSpec, dict[str, int]] = {}
        for spec in self.specs:
            if spec.kind == "id":
                assert isinstance(spec.value, int)
                out[spec] = {p: i for p, i in index.items() if i == spec.value}
            elif spec.kind == "path":
                assert isinstance(spec.value, str)
                out[spec] = {spec.value: index[spec.value]} if spec.value in index else {}
            else:
                assert isinstance(spec.value, str)
                unit_matches = unit_matcher(spec.value)
                out[spec] = {p: i for p, i in index.items() if unit_matches(p.rsplit("/", 1)[-1])}
        return out

    def _collect(self, index: Mapping[str, int]) -> frozenset[int]:
        ids = {s.value for s in self.specs if s.kind == "id" and isinstance(s.value, int)}
        roots = {p for found in self._matched.values() for p in found}
        for root in roots:
            ids.add(index[root])
        if self.subtree and roots:
            if "/" in roots:
                ids.update(index.values())
                return frozenset(ids)
            prefixes = tuple(r + "/" for r in roots)
            ids.update(i for p, i in index.items() if p.startswith(prefixes))
        return frozenset(ids)

    def refresh(self) -> FilterRefresh:
        """Walk the tree now and bring the id set up to date; returns what changed."""
        self.resolver.rescan(force=True)
        index = self.resolver.index()
        before, before_ids = self._matched, self._ids
        self._matched = self._match(index)
        self._ids = self._collect(index)
        changes = []
        for spec in self.specs:
            if spec.kind == "id":
                continue
            old, new = before.get(spec, {}), self._matched[spec]
            for path in sorted(old.keys() | new.keys()):
                if old.get(path) != new.get(path):
                    changes.append(FilterChange(spec, path, old.get(path), new.get(path)))
        return FilterRefresh(added=self._ids - before_ids, removed=before_ids - self._ids, changes=tuple(changes))


def unit_matcher(unit: str) -> Callable[[str], bool]:
    """Does a cgroup's name match ``unit``: itself, or an instance of a template (``getty@.service``)?"""
    name, _, suffix = unit.rpartition(".")
    if name.endswith("@"):  # a template names all its instances
        return lambda part: part.startswith(name) and part.endswith("." + suffix)
    return lambda part: part == unit


__all__ = [
    "CgroupError", "CgroupFilter", "CgroupIdentity", "CgroupResolver", "CgroupSpec", "FilterChange",
    "FilterRefresh", "Hierarchy", "ResolverStats", "find_v2_hierarchy", "identity_from_path",
    "parse_cgroup_spec", "unit_matcher",
]
