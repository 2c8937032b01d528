"""flamed.sampling.cgroups on this host's real cgroup v2 hierarchy.

Each test builds a private subtree ``<v2 root>/flamed-test-<random>/`` shaped
like a systemd service, a docker scope, a kubelet pod with a containerd
scope and the cgroupfs-driver forms, moves real ``sleep`` processes into its
leaves through ``cgroup.procs``, and checks what /proc and the resolver say
about them; one test checks with a BPF program that the ids
``bpf_get_current_cgroup_id()`` returns are the ones the resolver knows.
The fixture moves every process back to this process's cgroup, kills it and
removes the subtree leaves first, whatever the test did.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flamed.sampling.cgroups import (
    SYSFS_CGROUP,
    CgroupFilter,
    CgroupResolver,
    Hierarchy,
    find_v2_hierarchy,
    identity_from_path,
)
from support import have_bcc, have_root, need

pytestmark = pytest.mark.bpf

C1 = secrets.token_hex(32)
C2 = secrets.token_hex(32)
C3 = secrets.token_hex(32)
UID = "6a2b8f3e-1c4d-4e5f-8a9b-" + secrets.token_hex(6)
UNIT = f"flamed-demo-{secrets.token_hex(4)}.service"

#: Leaves under the test's subtree -> what identity_from_path must find there.
LEAVES: dict[str, dict[str, str | None]] = {
    f"system.slice/{UNIT}": dict(unit=UNIT, slice="system.slice", container_id=None, runtime=None),
    f"system.slice/docker-{C1}.scope": dict(unit=f"docker-{C1}.scope", container_id=C1, runtime="docker"),
    (f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
     f"cri-containerd-{C2}.scope"): dict(container_id=C2, runtime="containerd", pod_uid=UID),
    f"docker/{C3}": dict(unit=None, container_id=C3, runtime="docker"),
    f"kubepods/burstable/pod{UID}/{C1}": dict(container_id=C1, runtime=None, pod_uid=UID),
}


class Tree:
    """A private subtree of the v2 hierarchy and the processes put in it."""

    def __init__(self, hierarchy: Hierarchy, home: str) -> None:
        self.hierarchy = hierarchy
        self.name = f"flamed-test-{secrets.token_hex(4)}"
        self.base = hierarchy.dir_of("/" + self.name)
        self.home = hierarchy.dir_of(home)  # where processes go back before they die
        self.procs: list[subprocess.Popen[bytes]] = []
        self.base.mkdir()

    def path(self, leaf: str) -> str:
        return f"/{self.name}/{leaf}"

    def make(self, leaf: str) -> Path:
        d = self.base / leaf
        d.mkdir(parents=True, exist_ok=True)
        return d

    def spawn(self, leaf: str, argv: list[str] | None = None) -> subprocess.Popen[bytes]:
        """A ``sleep`` (or ``argv``) moved into ``leaf``, which is created if needed."""
        d = self.make(leaf)
        # Its own process group, so evict can end whatever a shell workload forked.
        p = subprocess.Popen(argv or ["sleep", "60"], stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        (d / "cgroup.procs").write_text(str(p.pid))
        return p

    def evict(self, p: subprocess.Popen[bytes]) -> None:
        """Move ``p``'s whole process group out and end it (its cgroup can then be removed)."""
        for pid in [p.pid, *_children(p.pid)]:
            try:
                (self.home / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # already gone
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def remove(self, leaf: str) -> None:
        """rmdir ``leaf`` once it is empty (a killed task leaves its cgroup a moment after wait)."""
        _rmdir(self.base / leaf)

    def close(self) -> None:
        for p in self.procs:
            self.evict(p)
        if not self.base.exists():
            return
        for dirpath, _dirs, _files in sorted(os.walk(self.base, topdown=False), key=lambda w: -len(w[0])):
            _rmdir(Path(dirpath))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _rmdir(d: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.fixture
def tree() -> Iterator[Tree]:
    need(have_root(), "root (creating cgroups and moving processes between them)")
    h, why = find_v2_hierarchy()
    need(h is not None, f"a cgroup v2 hierarchy ({why})")
    assert h is not None
    own = CgroupResolver(h).path_of_pid(os.getpid())
    need(own is not None, "this process's cgroup in the v2 hierarchy")
    assert own is not None
    need(os.access(h.path, os.W_OK), f"a writable {h.path}")
    t = Tree(h, own[0])
    try:
        yield t
    finally:
        t.close()


def test_identity_of_real_processes(tree: Tree) -> None:
    r = CgroupResolver(tree.hierarchy)
    procs = {leaf: tree.spawn(leaf) for leaf in LEAVES}
    for leaf, expected in LEAVES.items():
        pid, path = procs[leaf].pid, tree.path(leaf)
        cid = os.stat(tree.base / leaf).st_ino
        assert f"0::{path}\n" in Path(f"/proc/{pid}/cgroup").read_text()
        ident = r.identity_of_pid(pid)
        assert ident is not None and ident.path == path and ident.cgroup_id == cid
        assert ident == identity_from_path(path, cid)
        for k, v in expected.items():
            assert getattr(ident, k) == v, (leaf, k)
        # A resolver that never saw /proc finds the id by walking the tree.
        cold = CgroupResolver(tree.hierarchy)
        assert cold.resolve(cid) == ident and cold.stats.rescans == 1
        assert r.resolve(cid) == ident
    unit = r.identity_of_pid(procs[f"system.slice/{UNIT}"].pid)
    assert unit is not None and unit.service_name == UNIT.removesuffix(".service")
    assert unit.labels() == {"cgroup": tree.path(f"system.slice/{UNIT}"), "service_name": unit.service_name}
    pod = r.identity_of_pid(procs[f"kubepods/burstable/pod{UID}/{C1}"].pid)
    assert pod is not None and pod.labels()["pod"] == UID and pod.root_frame("container") == C1[:12]


def test_a_new_cgroup_is_found_by_a_rescan(tree: Tree) -> None:
    r = CgroupResolver(tree.hierarchy, min_rescan_interval=0.0)
    r.rescan(force=True)
    p = tree.spawn(f"system.slice/docker-{C3}.scope")
    cid = os.stat(tree.base / f"system.slice/docker-{C3}.scope").st_ino
    ident = r.resolve(cid)
    assert ident is not None and ident.container_id == C3 and ident.runtime == "docker"
    assert r.stats.rescans == 2
    tree.evict(p)
    tree.remove(f"system.slice/docker-{C3}.scope")
    r.rescan(force=True)
    hits = r.stats.hits
    assert r.resolve(cid) is None and r.stats.hits == hits


def test_filter_refresh_reports_a_recreated_cgroup(tree: Tree) -> None:
    r = CgroupResolver(tree.hierarchy)
    leaf = f"system.slice/{UNIT}"
    first = tree.spawn(leaf)
    worker = tree.spawn(f"{leaf}/worker")
    # The unit, a path relative to the v2 root, and /sys/fs/cgroup/... (on a
    # hybrid host that is translated to /sys/fs/cgroup/unified/...).
    f = CgroupFilter([UNIT, tree.path("system.slice") + f"/docker-{C1}.scope",
                      f"{SYSFS_CGROUP}{tree.path(leaf)}"], r, require_present=False)
    old = os.stat(tree.base / leaf).st_ino
    old_worker = os.stat(tree.base / leaf / "worker").st_ino
    assert f.ids() == {old, old_worker}
    assert [s.text for s in f.missing()] == [tree.path("system.slice") + f"/docker-{C1}.scope"]
    assert not f.refresh()
    # A unit restart: the old cgroup is removed, a new one made at the same path.
    tree.evict(worker)
    tree.evict(first)
    tree.remove(f"{leaf}/worker")
    tree.remove(leaf)
    tree.spawn(leaf)
    new = os.stat(tree.base / leaf).st_ino
    assert new != old  # cgroup ids are never reused
    got = f.refresh()
    path = tree.path(leaf)
    assert [(c.spec.text, c.path, c.kind, c.old_id, c.new_id) for c in got.changes] == [
        (UNIT, path, "re-created", old, new),
        (f"{SYSFS_CGROUP}{path}", path, "re-created", old, new),
    ]
    assert f"re-created, now id {new}" in str(got.changes[0])
    assert got.added == {new} and got.removed == {old, old_worker} and f.ids() == {new}
    ident = r.identity_of_pid(tree.procs[-1].pid)
    assert ident is not None and ident.cgroup_id == new


def test_bpf_cgroup_ids_are_the_resolver_ids(tree: Tree) -> None:
    """What bpf_get_current_cgroup_id() returns in each leaf is the id the resolver names."""
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    import bcc

    leaves = [f"system.slice/{UNIT}", f"system.slice/docker-{C1}.scope", f"docker/{C3}"]
    ids = {leaf: os.stat(tree.make(leaf)).st_ino for leaf in leaves}
    # A CPU-clock perf event, as the sampler uses; counts only the ids filled
    # in below, so other tasks' samples cost one lookup.
    b = bcc.BPF(text=b"""
#include <uapi/linux/bpf_perf_event.h>
BPF_HASH(seen, u64, u64, 64);
int on_sample(struct bpf_perf_event_data *ctx) {
    u64 cg = bpf_get_current_cgroup_id();
    u64 *n = seen.lookup(&cg);
    if (n)
        __sync_fetch_and_add(n, 1);
    return 0;
}
""")
    counts: dict[int, int] = {}
    try:
        seen = b[b"seen"]
        for cid in ids.values():
            seen[seen.Key(cid)] = seen.Leaf(0)
        b.attach_perf_event(ev_type=bcc.PerfType.SOFTWARE, ev_config=bcc.PerfSWConfig.CPU_CLOCK,
                            fn_name=b"on_sample", sample_freq=199)
        busy = [tree.spawn(leaf, ["nice", "-n", "19", "sh", "-c", "while :; do :; done"]) for leaf in leaves]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            counts = {k.value: v.value for k, v in seen.items()}
            if all(counts.get(cid, 0) > 0 for cid in ids.values()):
                break
            time.sleep(0.1)
        for p in busy:  # two cores are shared: stop burning as soon as we know
            tree.evict(p)
    finally:
        b.cleanup()
    r = CgroupResolver(tree.hierarchy)
    for leaf, cid in ids.items():
        assert counts.get(cid, 0) > 0, f"no syscall seen from {leaf} under id {cid}"
        ident = r.resolve(cid)
        assert ident is not None and ident.path == tree.path(leaf)
