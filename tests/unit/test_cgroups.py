"""flamed.sampling.cgroups on fake trees: tmp directories shaped like cgroup v2
hierarchies (ids are the directories' st_ino, as on cgroupfs), a fake
/proc/self/mountinfo for the pure-v2, hybrid and legacy layouts, and fake
/proc/PID/cgroup files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flamed.errors import ConfigError
from flamed.sampling.cgroups import (
    CgroupError,
    CgroupFilter,
    CgroupIdentity,
    CgroupResolver,
    CgroupSpec,
    FilterChange,
    Hierarchy,
    find_v2_hierarchy,
    identity_from_path,
    parse_cgroup_spec,
)

C1 = "a" * 64
C2 = "0123456789abcdef" * 4
C3 = "fedcba9876543210" * 4
UID = "6a2b8f3e-1c4d-4e5f-8a9b-0c1d2e3f4a5b"
UID_ = UID.replace("-", "_")
STATIC_UID = "2b6c0d2e2a2bb45ad41b2c2b5b1c9d37"

TMPFS = "23 1 0:21 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
V1_CPU = "24 23 0:22 / /sys/fs/cgroup/cpu rw,relatime shared:7 - cgroup cgroup rw,cpu\n"
V1_SYSTEMD = "25 23 0:23 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"
UNIFIED = "26 23 0:24 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
PURE = "23 1 0:21 / /sys/fs/cgroup rw,nosuid,nodev shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
PROC = "22 1 0:20 / /proc rw,relatime - proc proc rw\n"

# Every cgroup shape the resolver has to name, relative to the v2 root.
SHAPES = [
    "/system.slice/demo.service",
    "/system.slice/demo.service/worker",
    f"/system.slice/docker-{C1}.scope",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{C2}.scope",
    f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{C3}.scope",
    f"/kubepods.slice/kubepods-pod{STATIC_UID}.slice",
    f"/machine.slice/libpod-{C2}.scope",
    f"/machine.slice/libpod-{C2}.scope/container",
    f"/docker/{C1}",
    f"/kubepods/burstable/pod{UID}/{C3}",
    f"/libpod_parent/libpod-{C3}",
    "/user.slice/user-1000.slice/user@1000.service/app.slice/app-firefox-42.scope",
    "/init.scope",
    "/flat/leaf",
]


def make_host(tmp_path: Path, *, layout: str = "hybrid", paths: list[str] | None = None) -> tuple[Path, Path]:
    """A fake /proc and /sys for ``layout`` (pure, hybrid, legacy, none); returns (proc, sys)."""
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    mounts = {
        "pure": PROC + PURE,
        "hybrid": PROC + TMPFS + V1_CPU + V1_SYSTEMD + UNIFIED,
        "legacy": PROC + TMPFS + V1_CPU + V1_SYSTEMD,
        "none": PROC,
    }[layout]
    (proc / "self" / "mountinfo").write_text(mounts)
    root = sys / "fs" / "cgroup"
    if layout == "hybrid":
        (root / "cpu").mkdir(parents=True)
        (root / "systemd").mkdir(parents=True)
        root = root / "unified"
    root.mkdir(parents=True, exist_ok=True)
    for p in paths or []:
        (root / p.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return proc, sys


def v2_root(sys: Path, layout: str) -> Path:
    return sys / "fs" / "cgroup" / ("unified" if layout == "hybrid" else "")


def ino(path: Path) -> int:
    return os.stat(path).st_ino


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def resolver(tmp_path: Path, layout: str = "hybrid", paths: list[str] | None = None,
             **kw: object) -> tuple[CgroupResolver, Path]:
    proc, sys = make_host(tmp_path, layout=layout, paths=paths)
    h, why = find_v2_hierarchy(proc, sys)
    assert h is not None, why
    return CgroupResolver(h, proc_root=proc, **kw), v2_root(sys, layout)  # type: ignore[arg-type]


# -- the hierarchy ---------------------------------------------------------------


def test_pure_v2(tmp_path: Path) -> None:
    proc, sys = make_host(tmp_path, layout="pure")
    h, why = find_v2_hierarchy(proc, sys)
    assert h == Hierarchy(path=sys / "fs" / "cgroup", mount_point="/sys/fs/cgroup", mount_root="/", hybrid=False)
    assert why == "cgroup2 at /sys/fs/cgroup (unified)"


def test_hybrid(tmp_path: Path) -> None:
    proc, sys = make_host(tmp_path, layout="hybrid")
    h, why = find_v2_hierarchy(proc, sys)
    assert h is not None and h.hybrid and h.mount_point == "/sys/fs/cgroup/unified"
    assert h.path == sys / "fs" / "cgroup" / "unified"
    assert "hybrid" in why


@pytest.mark.parametrize("layout,reason", [("legacy", "only cgroup v1"), ("none", "no cgroup2")])
def test_no_v2(tmp_path: Path, layout: str, reason: str) -> None:
    proc, sys = make_host(tmp_path, layout=layout)
    h, why = find_v2_hierarchy(proc, sys)
    assert h is None and reason in why
    with pytest.raises(CgroupError, match=reason):
        CgroupResolver.for_host(proc, sys)


def test_unreadable_mountinfo_and_missing_directory(tmp_path: Path) -> None:
    h, why = find_v2_hierarchy(tmp_path / "nope", tmp_path)
    assert h is None and "cannot read" in why
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(PURE)
    h, why = find_v2_hierarchy(proc, tmp_path / "sys")
    assert h is None and "not a readable directory" in why


def test_preferences_overmounts_and_escapes(tmp_path: Path) -> None:
    proc, sys = make_host(tmp_path, layout="hybrid")
    # A subtree bind mount (a container's view) loses to the whole tree; a
    # tmpfs mounted over a cgroup2 mount hides it; octal escapes are decoded.
    odd = tmp_path / "my cg"
    odd.mkdir()
    extra = (f"40 1 0:24 /docker/{C1} /sys/fs/cgroup/sub rw - cgroup2 cgroup2 rw\n"
             "41 1 0:24 / /sys/fs/cgroup/hidden rw - cgroup2 cgroup2 rw\n"
             "42 1 0:50 / /sys/fs/cgroup/hidden rw - tmpfs tmpfs rw\n")
    (proc / "self" / "mountinfo").write_text(PROC + TMPFS + V1_CPU + extra + UNIFIED)
    h, _ = find_v2_hierarchy(proc, sys)
    assert h is not None and h.mount_point == "/sys/fs/cgroup/unified"
    mounted = str(odd).replace(" ", "\\040")
    (proc / "self" / "mountinfo").write_text(PROC + extra + f"43 1 0:24 / {mounted} rw - cgroup2 cgroup2 rw\n")
    h, _ = find_v2_hierarchy(proc, sys)
    assert h is not None and h.path == odd and h.mount_point == str(odd) and not h.hybrid
    (proc / "self" / "mountinfo").write_text(PROC + extra)
    (sys / "fs" / "cgroup" / "sub").mkdir()
    h, _ = find_v2_hierarchy(proc, sys)
    assert h is not None and h.mount_root == f"/docker/{C1}"
    assert h.visible(f"/docker/{C1}/x") == "/x" and h.visible(f"/docker/{C1}") == "/"
    assert h.visible("/system.slice/a.service") is None


# -- identities ----------------------------------------------------------------------


@pytest.mark.parametrize("path,unit,slice_,container,runtime,pod,service", [
    ("/", None, None, None, None, None, None),
    ("/system.slice/demo.service", "demo.service", "system.slice", None, None, None, "demo"),
    ("/system.slice/demo.service/worker", "demo.service", "system.slice", None, None, None, "demo"),
    ("/system.slice/getty@tty1.service", "getty@tty1.service", "system.slice", None, None, None, "getty@tty1"),
    (f"/system.slice/docker-{C1}.scope", f"docker-{C1}.scope", "system.slice", C1, "docker", None, C1[:12]),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{C2}.scope",
     f"cri-containerd-{C2}.scope", f"kubepods-burstable-pod{UID_}.slice", C2, "containerd", UID, C2[:12]),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{C3}.scope",
     f"crio-{C3}.scope", f"kubepods-besteffort-pod{UID_}.slice", C3, "crio", UID, C3[:12]),
    (f"/kubepods.slice/kubepods-pod{UID_}.slice", None, f"kubepods-pod{UID_}.slice", None, None, UID, None),
    (f"/kubepods.slice/kubepods-pod{STATIC_UID}.slice", None, f"kubepods-pod{STATIC_UID}.slice", None, None,
     STATIC_UID, None),
    (f"/machine.slice/libpod-{C2}.scope", f"libpod-{C2}.scope", "machine.slice", C2, "podman", None, C2[:12]),
    (f"/machine.slice/libpod-conmon-{C2}.scope", f"libpod-conmon-{C2}.scope", "machine.slice", None, None, None,
     f"libpod-conmon-{C2}"),
    (f"/system.slice/docker-{C1}.scope/init.scope", "init.scope", "system.slice", C1, "docker", None, C1[:12]),
    (f"/docker/{C1}", None, None, C1, "docker", None, C1[:12]),
    (f"/docker/{C1}/docker/{C2}", None, None, C2, "docker", None, C2[:12]),
    (f"/kubepods/burstable/pod{UID}/{C3}", None, None, C3, None, UID, C3[:12]),
    (f"/kubepods/pod{UID}/{C3}", None, None, C3, None, UID, C3[:12]),
    (f"/kubepods/besteffort/pod{UID}/crio-{C2}", None, None, C2, "crio", UID, C2[:12]),
    (f"/libpod_parent/libpod-{C3}", None, None, C3, "podman", None, C3[:12]),
    (f"/{C1}", None, None, C1, None, None, C1[:12]),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/app-firefox-42.scope", "app-firefox-42.scope",
     "app.slice", None, None, None, "app-firefox-42"),
    ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope", "user-1000.slice", None, None, None,
     "session-3"),
    ("/init.scope", "init.scope", None, None, None, None, "init"),
    ("/flat/leaf", None, None, None, None, None, None),
    (f"/system.slice/docker-{C1[:63]}.scope", f"docker-{C1[:63]}.scope", "system.slice", None, None, None,
     f"docker-{C1[:63]}"),
])
def test_identity_shapes(path: str, unit: str | None, slice_: str | None, container: str | None,
                         runtime: str | None, pod: str | None, service: str | None) -> None:
    ident = identity_from_path(path, 7)
    assert (ident.path, ident.unit, ident.slice, ident.container_id, ident.runtime, ident.pod_uid) == (
        path, unit, slice_, container, runtime, pod)
    assert ident.service_name == service and ident.cgroup_id == 7
    labels = ident.labels()
    assert labels["cgroup"] == path
    assert labels.get("service_name") == service
    assert labels.get("container_id") == container
    assert labels.get("pod") == pod
    assert set(labels) <= {"cgroup", "service_name", "container_id", "pod"}


def test_path_is_normalised() -> None:
    assert identity_from_path("system.slice//demo.service/").path == "/system.slice/demo.service"
    assert identity_from_path("").path == "/"


def test_root_frames() -> None:
    svc = identity_from_path("/system.slice/demo.service")
    box = identity_from_path(f"/system.slice/docker-{C1}.scope")
    bare = identity_from_path("/flat/leaf")
    assert [svc.root_frame(k) for k in ("unit", "container", "cgroup")] == [
        "demo.service", "[host]", "/system.slice/demo.service"]
    assert [box.root_frame(k) for k in ("unit", "container")] == [f"docker-{C1}.scope", C1[:12]]
    assert bare.root_frame("unit") == "[no unit]" and identity_from_path("/").root_frame("cgroup") == "/"
    odd = identity_from_path("/system.slice/a;b\nc.service")
    for kind in ("unit", "cgroup"):
        frame = odd.root_frame(kind)
        assert ";" not in frame and "\n" not in frame
    named = CgroupIdentity(path=box.path, container_id=C1, container_name="web;1")
    assert named.root_frame("container") == "web:1" and named.service_name == "web;1"
    with pytest.raises(ValueError):
        svc.root_frame("pod")  # type: ignore[arg-type]


# -- the resolver ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["pure", "hybrid"])
def test_resolve_every_shape(tmp_path: Path, layout: str) -> None:
    r, root = resolver(tmp_path, layout, SHAPES)
    assert r.resolve(ino(root)) == identity_from_path("/", ino(root))
    for p in SHAPES:
        cid = ino(root / p.lstrip("/"))
        assert r.resolve(cid) == identity_from_path(p, cid)
        assert r.id_of_path(p) == cid
    assert r.stats.rescans == 1  # one walk, built lazily on the first miss, answered them all
    assert r.id_of_path("/no/such") is None
    hits = r.stats.hits
    r.resolve(ino(root / "flat" / "leaf"))
    assert r.stats.hits == hits + 1


def test_new_cgroups_rescan_rate_limited(tmp_path: Path) -> None:
    clock = Clock()
    r, root = resolver(tmp_path, "hybrid", ["/system.slice"], min_rescan_interval=5.0, clock=clock)
    assert r.resolve(ino(root / "system.slice")) is not None
    new = root / "system.slice" / "late.service"
    new.mkdir()
    assert r.resolve(ino(new)) is None  # the walk at the first miss was a moment ago
    assert r.stats.rate_limited == 1 and r.stats.rescans == 1
    clock.now += 5.0
    ident = r.resolve(ino(new))
    assert ident is not None and ident.unit == "late.service" and r.stats.rescans == 2
    # An id that is nowhere costs one walk per interval, not one per lookup.
    clock.now += 5.0
    assert r.resolve(10**15) is None and r.resolve(10**15) is None
    assert r.stats.rescans == 3 and r.stats.unresolved == 1 and r.stats.rate_limited == 2


def test_vanished_cgroups_leave_the_cache(tmp_path: Path) -> None:
    clock = Clock()
    r, root = resolver(tmp_path, "pure", ["/system.slice/gone.service", "/system.slice/kept.service"],
                       min_rescan_interval=1.0, clock=clock)
    gone, kept = ino(root / "system.slice" / "gone.service"), ino(root / "system.slice" / "kept.service")
    assert r.resolve(gone) is not None and r.resolve(kept) is not None
    (root / "system.slice" / "gone.service").rmdir()
    assert r.resolve(gone) is not None  # cached until the next walk
    assert r.rescan() is False  # rate limited
    clock.now += 1.0
    assert r.rescan() is True
    assert "/system.slice/gone.service" not in r.index()
    hits = r.stats.hits
    r.resolve(kept)
    assert r.stats.hits == hits + 1
    clock.now += 1.0
    assert r.resolve(gone) is None and r.stats.unresolved == 1


def test_container_names_hook(tmp_path: Path) -> None:
    r, root = resolver(tmp_path, "hybrid", SHAPES, container_names=lambda i: {C1: "web"}.get(i.container_id or ""))
    box = r.resolve(ino(root / "system.slice" / f"docker-{C1}.scope"))
    assert box is not None and box.container_name == "web" and box.service_name == "web"
    assert box.root_frame("container") == "web"
    other = r.resolve(ino(root / "docker" / C1))
    assert other is not None and other.service_name == "web"
    svc = r.resolve(ino(root / "system.slice" / "demo.service"))
    assert svc is not None and svc.container_name is None


def write_pid(proc: Path, pid: int, text: str) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(text)


@pytest.mark.parametrize("layout", ["pure", "hybrid"])
def test_identity_of_pid(tmp_path: Path, layout: str) -> None:
    r, root = resolver(tmp_path, layout, SHAPES)
    proc = r.proc_root
    svc = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{C2}.scope"
    v1 = "9:name=systemd:/system.slice/other.service\n4:memory:/x\n1:cpu:/\n" if layout == "hybrid" else ""
    write_pid(proc, 100, f"{v1}0::{svc}\n")
    ident = r.identity_of_pid(100)
    cid = ino(root / svc.lstrip("/"))
    assert ident == identity_from_path(svc, cid)
    assert ident is not None and ident.pod_uid == UID and ident.runtime == "containerd"
    rescans = r.stats.rescans
    assert r.resolve(cid) == ident and r.stats.rescans == rescans  # /proc taught the cache
    write_pid(proc, 101, "0::/system.slice/demo.service (deleted)\n")
    dead = r.identity_of_pid(101)
    assert dead is not None and dead.cgroup_id is None and dead.unit == "demo.service"
    write_pid(proc, 102, "0::/system.slice/absent.service\n")
    absent = r.identity_of_pid(102)
    assert absent is not None and absent.cgroup_id is None
    write_pid(proc, 103, "0::/../../elsewhere.service\n")
    assert r.identity_of_pid(103) is None
    write_pid(proc, 104, "1:cpu:/\n")
    assert r.identity_of_pid(104) is None
    assert r.identity_of_pid(99999) is None


def test_identity_of_pid_in_a_subtree_mount(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "app.service").mkdir(parents=True)
    h = Hierarchy(path=root, mount_point="/sys/fs/cgroup", mount_root=f"/docker/{C1}")
    proc = tmp_path / "proc"
    write_pid(proc, 5, f"0::/docker/{C1}/app.service\n")
    write_pid(proc, 6, "0::/system.slice/x.service\n")
    r = CgroupResolver(h, proc_root=proc)
    ident = r.identity_of_pid(5)
    assert ident is not None and ident.path == "/app.service" and ident.cgroup_id == ino(root / "app.service")
    assert r.identity_of_pid(6) is None


# -- filter specs --------------------------------------------------------------------


def hierarchies(tmp_path: Path) -> list[Hierarchy]:
    out = []
    for layout in ("pure", "hybrid"):
        proc, sys = make_host(tmp_path / layout, layout=layout)
        h, _ = find_v2_hierarchy(proc, sys)
        assert h is not None
        out.append(h)
    return out


@pytest.mark.parametrize("text,kind,value", [
    ("/sys/fs/cgroup/system.slice/x.service", "path", "/system.slice/x.service"),
    ("/sys/fs/cgroup/unified/system.slice/x.service", "path", "/system.slice/x.service"),
    ("/sys/fs/cgroup/unified/system.slice/x.service/", "path", "/system.slice/x.service"),
    ("/system.slice/x.service", "path", "/system.slice/x.service"),
    ("system.slice/x.service", "path", "/system.slice/x.service"),
    ("  /system.slice//x.service ", "path", "/system.slice/x.service"),
    ("/sys/fs/cgroup", "path", "/"),
    ("/sys/fs/cgroup/unified", "path", "/"),
    ("/", "path", "/"),
    ("/flamed-test/leaf", "path", "/flamed-test/leaf"),
    ("nginx.service", "unit", "nginx.service"),
    ("getty@.service", "unit", "getty@.service"),
    (f"docker-{C1}.scope", "unit", f"docker-{C1}.scope"),
    ("kubepods.slice", "unit", "kubepods.slice"),
    ("1234", "id", 1234),
])
def test_specs_accepted_on_both_layouts(tmp_path: Path, text: str, kind: str, value: str | int) -> None:
    for h in [None, *hierarchies(tmp_path)]:
        spec = parse_cgroup_spec(text, h)
        assert (spec.kind, spec.value, spec.text) == (kind, value, text)
    assert parse_cgroup_spec(42) == CgroupSpec("42", "id", 42)


@pytest.mark.parametrize("text,advice", [
    ("", "nginx.service"),
    ("   ", "nginx.service"),
    ("nginx", "nginx.service for the unit, or /nginx"),
    (".service", "/.service"),
    ("/sys/fs/cgroup/memory/system.slice/x.service", "/sys/fs/cgroup/system.slice/x.service (or x.service)"),
    ("/sys/fs/cgroup/systemd/system.slice/x.service", "cgroup v1 systemd hierarchy"),
    ("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/PATH"),
    ("/sys/kernel/x", "not under /sys/fs/cgroup"),
    ("/proc/1/cgroup", "not under /sys/fs/cgroup"),
    ("/system.slice/../x.service", "without '.' or '..'"),
    ("/sys/fs/cgroup/unified/./a", "without '.' or '..'"),
    ("a\nb.service", "no NUL or newline"),
])
def test_specs_refused_on_both_layouts(tmp_path: Path, text: str, advice: str) -> None:
    messages = set()
    for h in [None, *hierarchies(tmp_path)]:
        with pytest.raises(ConfigError) as e:
            parse_cgroup_spec(text, h, key="sampler.cgroups")
        assert advice in str(e.value) and str(e.value).startswith("sampler.cgroups: ")
        assert isinstance(e.value, CgroupError)
        messages.add(str(e.value))
    assert len(messages) == 1


def test_spec_under_an_unusual_mount_point(tmp_path: Path) -> None:
    h = Hierarchy(path=tmp_path, mount_point="/run/cg2")
    assert parse_cgroup_spec("/run/cg2/system.slice/x.service", h).value == "/system.slice/x.service"
    assert parse_cgroup_spec("/sys/fs/cgroup/system.slice/x.service", h).value == "/system.slice/x.service"
    assert parse_cgroup_spec("/run/cg2/a", None).value == "/run/cg2/a"


# -- filters -------------------------------------------------------------------------

TREE = [
    "/system.slice/demo.service/worker",
    "/system.slice/other.service",
    "/system.slice/getty@tty1.service",
    "/system.slice/getty@tty2.service",
    "/user.slice/user-1000.slice/user@1000.service/demo.service",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{C2}.scope",
]


def ids_of(root: Path, *paths: str) -> frozenset[int]:
    return frozenset(ino(root / p.lstrip("/")) for p in paths)


@pytest.mark.parametrize("layout", ["pure", "hybrid"])
def test_filter_ids(tmp_path: Path, layout: str) -> None:
    r, root = resolver(tmp_path, layout, TREE)
    sysfs = "/sys/fs/cgroup" + ("/unified" if layout == "hybrid" else "")
    by_path = CgroupFilter([f"{sysfs}/system.slice/demo.service"], r)
    assert by_path.ids() == ids_of(root, "/system.slice/demo.service", "/system.slice/demo.service/worker")
    exact = CgroupFilter(["/sys/fs/cgroup/system.slice/demo.service"], r, subtree=False)
    assert exact.ids() == ids_of(root, "/system.slice/demo.service")
    unit = CgroupFilter(["demo.service"], r)
    assert unit.ids() == ids_of(root, "/system.slice/demo.service", "/system.slice/demo.service/worker",
                                "/user.slice/user-1000.slice/user@1000.service/demo.service")
    assert set(unit.matched()[unit.specs[0]]) == {"/system.slice/demo.service",
                                                  "/user.slice/user-1000.slice/user@1000.service/demo.service"}
    template = CgroupFilter(["getty@.service", 4242], r)
    assert template.ids() == ids_of(root, "/system.slice/getty@tty1.service", "/system.slice/getty@tty2.service") | {
        4242}
    pod = CgroupFilter(["kubepods.slice"], r)
    assert pod.ids() == frozenset(i for p, i in r.index().items() if p.startswith("/kubepods.slice"))
    assert len(pod.ids()) == 4
    everything = CgroupFilter(["/", 7], r)
    assert everything.ids() == frozenset(r.index().values()) | {7}
    # An id stands for its cgroup and those below it, as a path does (docs/configuration.md);
    # it stood for itself alone, so a slice's id sampled none of its units.
    by_id = CgroupFilter([str(ino(root / "system.slice"))], r)
    assert by_id.ids() == frozenset(i for p, i in r.index().items() if p.startswith("/system.slice"))
    assert len(by_id.ids()) > 1
    assert by_id.matched()[by_id.specs[0]] == {"/system.slice": ino(root / "system.slice")}
    exact_id = CgroupFilter([str(ino(root / "system.slice"))], r, subtree=False)
    assert exact_id.ids() == ids_of(root, "/system.slice")


def test_filter_missing(tmp_path: Path) -> None:
    r, _ = resolver(tmp_path, "hybrid", TREE)
    f = CgroupFilter(["nope.service", "/system.slice/absent.service", "other.service", 12], r)
    assert [s.text for s in f.missing()] == ["nope.service", "/system.slice/absent.service"]
    with pytest.raises(CgroupError, match="'nope.service', '/system.slice/absent.service' under "
                                          "/sys/fs/cgroup/unified") as e:
        CgroupFilter(["nope.service", "/system.slice/absent.service", "other.service"], r, require_present=True)
    assert "systemctl status" in str(e.value)
    with pytest.raises(CgroupError, match="^daemon.cgroups: 'nginx'"):
        CgroupFilter(["nginx"], r, key="daemon.cgroups")


class Graveyard:
    """Removes cgroups from a fake tree by moving them here: their inodes stay
    taken, so, as with cgroup ids, a new directory never gets an old one's
    number (ext4 hands a freed inode to the next mkdir)."""

    def __init__(self, where: Path) -> None:
        self.where = where
        where.mkdir()

    def remove(self, path: Path) -> None:
        path.rename(self.where / str(len(list(self.where.iterdir()))))

    def recreate(self, path: Path) -> None:
        """rmdir + mkdir at the same path, as a unit restart does."""
        self.remove(path)
        path.mkdir()


@pytest.mark.parametrize("layout", ["pure", "hybrid"])
def test_filter_refresh(tmp_path: Path, layout: str) -> None:
    r, root = resolver(tmp_path, layout, TREE)
    graves = Graveyard(tmp_path / "graves")
    f = CgroupFilter(["demo.service", "/system.slice/late.service"], r)
    assert not f.refresh()  # nothing changed
    demo = root / "system.slice" / "demo.service"
    old = ino(demo)
    graves.remove(demo / "worker")
    graves.recreate(demo)
    (root / "system.slice" / "late.service").mkdir()
    (root / "user.slice" / "user-1000.slice" / "user@1000.service" / "demo.service" / "child").mkdir()
    got = f.refresh()
    new = ino(demo)
    late = ino(root / "system.slice" / "late.service")
    child = ino(root / "user.slice/user-1000.slice/user@1000.service/demo.service/child")
    assert got.changes == (
        FilterChange(f.specs[0], "/system.slice/demo.service", old, new),
        FilterChange(f.specs[1], "/system.slice/late.service", None, late),
    )
    assert [c.kind for c in got.changes] == ["re-created", "created"]
    assert str(got.changes[0]) == f"cgroup /system.slice/demo.service (demo.service) re-created, now id {new} (was {old})"
    assert got.added == {new, late, child}
    assert old in got.removed and len(got.removed) == 2  # demo.service and its worker
    assert new in f.ids() and old not in f.ids()
    graves.remove(root / "system.slice" / "late.service")
    gone = f.refresh()
    assert [str(c) for c in gone.changes] == [
        f"cgroup /system.slice/late.service (/system.slice/late.service) removed, was id {late}"]
    assert gone.removed == {late} and not gone.added
    hits = r.stats.hits
    assert r.resolve(late) is None and r.stats.hits == hits  # the walk dropped it from the cache
