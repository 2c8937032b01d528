"""Service and container identity on every sample, through a real BPF daemon.

Busy workloads run in real cgroups of the v2 hierarchy shaped like a systemd
service, a docker scope and a kubelet pod's containerd scope (under a private
``flamed-test-*`` subtree).  Each workload puts itself into its cgroup before
it starts working.  The daemon must then name each workload's samples by its
unit, container and pod: in folded root frames, in pprof labels as
``go tool pprof -tags`` reads them (pull endpoint and ``snapshot --format
pprof``), in snapshot filters and in the rotated files' sidecars.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemonproc import DaemonProc, profile_files
from flamed.outputs import profile_pb2
from support import need
from tests.integration.test_cgroup_identity import Tree, tree  # noqa: F401 - the fixture

pytestmark = pytest.mark.bpf

C_DOCKER = secrets.token_hex(32)
C_POD = secrets.token_hex(32)
UID = "7b3c9f4e-2d5e-4f60-9bac-" + secrets.token_hex(6)
UNIT = f"flamed-demo-{secrets.token_hex(4)}.service"
POD_LEAF = (f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
            f"cri-containerd-{C_POD}.scope")

#: leaf -> (unit frame, container frame, labels every sample of its workload must carry)
WORKLOADS: dict[str, tuple[str, str, dict[str, str]]] = {
    f"system.slice/{UNIT}": (UNIT, "[host]", {"service_name": UNIT.removesuffix(".service")}),
    f"system.slice/docker-{C_DOCKER}.scope": (
        f"docker-{C_DOCKER}.scope", C_DOCKER[:12], {"service_name": C_DOCKER[:12], "container_id": C_DOCKER}),
    POD_LEAF: (f"cri-containerd-{C_POD}.scope", C_POD[:12],
               {"service_name": C_POD[:12], "container_id": C_POD, "pod": UID}),
}
#: The share of a workload's samples that must carry its identity.
LEAST = 0.99


def _spawn_busy(tree: Tree, leaf: str) -> subprocess.Popen[bytes]:
    """A Python spinner that enters ``leaf`` itself before it starts to spin."""
    procs = tree.make(leaf) / "cgroup.procs"
    # The interpreter itself, not a shim on PATH that would fork helpers in there too.
    script = f"echo $$ > '{procs}' && exec '{sys.executable}' -c 'while True: pass'"
    return tree.spawn(leaf, ["sh", "-c", script])


def _pprof(tmp: Path, *args: str) -> str:
    go = shutil.which("go")
    need(go is not None, "go (Debian golang-go) for `go tool pprof`")
    assert go is not None
    env = dict(os.environ, PPROF_TMPDIR=str(tmp / "pprof"), HOME=str(tmp), GOCACHE=str(tmp / "gocache"),
               GOTOOLCHAIN="local", PPROF_BINARY_PATH="/nonexistent")
    r = subprocess.run([go, "tool", "pprof", *args], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def _tag_counts(tags_output: str) -> dict[str, dict[str, float]]:
    """``go tool pprof -tags``: key -> value -> samples."""
    out: dict[str, dict[str, float]] = {}
    key = None
    for line in tags_output.splitlines():
        m = re.match(r"^\s*(\S+): Total ([\d.]+)", line)
        if m:
            key = m.group(1)
            out[key] = {}
            continue
        m = re.match(r"^\s*([\d.]+) \(\s*[\d.]+%\): (.*)$", line)
        if m and key is not None:
            out[key][m.group(2).strip()] = float(m.group(1))
    return out


def _check_pprof_labels(tmp: Path, profile: str, pids: dict[str, int], tree: Tree) -> None:
    """Each workload's samples, as go tool pprof reads them, carry its labels."""
    for leaf, pid in pids.items():
        tags = _tag_counts(_pprof(tmp, "-tags", "-sample_index=samples", f"-tagfocus=pid=^{pid}$", profile))
        total = sum(tags.get("pid", {}).values())
        assert total >= 50 and set(tags["pid"]) == {str(pid)}, (leaf, tags)
        for name, value in [*WORKLOADS[leaf][2].items(), ("cgroup", tree.path(leaf))]:
            got = tags.get(name, {})
            assert got.get(value, 0) >= LEAST * total, (leaf, name, value, total, got)


def _folded_by_pid(payload: bytes) -> dict[int, dict[tuple[str, str], int]]:
    """pid -> (root frame 1, root frame 2) -> samples, from a unit,container,pid rooted folded profile."""
    out: dict[int, dict[tuple[str, str], int]] = {}
    for line in payload.decode().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        m = re.search(r"-(\d+)$", frames[2]) if len(frames) > 2 else None
        if m:
            per = out.setdefault(int(m.group(1)), {})
            per[(frames[0], frames[1])] = per.get((frames[0], frames[1]), 0) + int(n)
    return out


def _pprof_samples(data: bytes) -> list[tuple[dict[str, str], int]]:
    """(labels, samples) of each sample of a gzipped pprof profile."""
    msg = profile_pb2.Profile()
    msg.ParseFromString(gzip.decompress(data))
    st = msg.string_table
    return [({st[lb.key]: st[lb.str] for lb in s.label}, s.value[0]) for s in msg.sample]


def _pids_in(payload: bytes) -> dict[int, int]:
    """pid -> samples, from a pid-rooted folded profile."""
    out: dict[int, int] = {}
    for line in payload.decode().splitlines():
        stack, _, n = line.rpartition(" ")
        m = re.search(r"-(\d+)$", stack.split(";")[0])
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + int(n)
    return out


def test_units_containers_and_pods_name_every_sample(tmp_path: Path, require_bpf: None, daemon_factory: Any,
                                                    tree: Tree) -> None:
    d: DaemonProc = daemon_factory(output={"root_frame": "unit,container,pid", "rotate_interval": 2.0})
    d.wait_for(lambda: d.status()["windows"] >= 1, 60, "a first window")
    # The cgroups are created after the daemon started: it must find them itself.
    procs = {leaf: _spawn_busy(tree, leaf) for leaf in WORKLOADS}
    pids = {leaf: p.pid for leaf, p in procs.items()}
    for leaf, pid in pids.items():
        assert f"0::{tree.path(leaf)}\n" in Path(f"/proc/{pid}/cgroup").read_text()

    # The pull endpoint, while they run.
    addr = d.status()["metrics"]
    _pprof(tmp_path, "-raw", f"http://{addr}/debug/pprof/profile?seconds=4")
    pulled = sorted((tmp_path / "pprof").glob("*.pb.gz"))
    assert pulled
    _check_pprof_labels(tmp_path, str(pulled[-1]), pids, tree)

    # Each has at least 100 samples before it is stopped (a loaded host gives a
    # busy process less than its share of a CPU: waited for, not assumed).
    def enough() -> bool:
        head, payload = d.request({"request": "snapshot", "seconds": 600, "format": "folded", "root": "pid"})
        got = _pids_in(payload) if head.get("ok") else {}
        return all(got.get(pid, 0) >= 100 for pid in pids.values())

    d.wait_for(enough, 60, "100 samples of each workload", every=1.0)
    # Then stopped: every later request sees the same samples of them.
    for p in procs.values():
        os.kill(p.pid, signal.SIGSTOP)
    seen = d.status()["windows"]
    d.wait_for(lambda: d.status()["windows"] >= seen + 2, 30, "two windows after the stop")

    head, folded = d.request({"request": "snapshot", "seconds": 600, "format": "folded"})
    assert head["ok"], head
    by_pid = _folded_by_pid(folded)
    totals: dict[int, int] = {}
    for leaf, pid in pids.items():
        unit, container, _labels = WORKLOADS[leaf]
        roots = by_pid.get(pid, {})
        totals[pid] = sum(roots.values())
        assert totals[pid] >= 100, (leaf, roots)
        assert roots.get((unit, container), 0) >= LEAST * totals[pid], (leaf, roots)
    assert all(";" not in f for s in by_pid.values() for pair in s for f in pair)

    # snapshot --format pprof, labelled as the pull endpoint is.
    head, pb = d.request({"request": "snapshot", "seconds": 600, "format": "pprof"})
    assert head["ok"], head
    snap = tmp_path / "snapshot.pb.gz"
    snap.write_bytes(pb)
    _check_pprof_labels(tmp_path, str(snap), pids, tree)

    # Filters: each picks its workload's samples, and only them.
    unit_leaf, docker_leaf = f"system.slice/{UNIT}", f"system.slice/docker-{C_DOCKER}.scope"
    cases: list[tuple[dict[str, Any], set[str]]] = [
        ({"unit": UNIT}, {unit_leaf}),
        ({"unit": UNIT.removesuffix(".service")}, {unit_leaf}),
        ({"container": C_DOCKER[:12]}, {docker_leaf}),
        ({"container": [C_DOCKER, C_POD[:8]]}, {docker_leaf, POD_LEAF}),
        ({"pod": UID}, {POD_LEAF}),
        ({"cgroup": f"/{tree.name}/system.slice"}, {unit_leaf, docker_leaf}),
        ({"cgroup": f"/sys/fs/cgroup/{tree.name}/kubepods.slice"}, {POD_LEAF}),
        ({"cgroup": f"/{tree.name}", "container": C_POD[:12]}, {POD_LEAF}),
    ]
    for flt, leaves in cases:
        head, out = d.request({"request": "snapshot", "seconds": 600, "format": "folded", "root": "pid", **flt})
        assert head["ok"], (flt, head)
        got = _pids_in(out)
        assert set(got) == {pids[leaf] for leaf in leaves}, (flt, got)
        for leaf in leaves:
            pid = pids[leaf]
            assert got[pid] >= LEAST * totals[pid], (flt, leaf, got[pid], totals[pid])

    # The files' sidecars say who each process was.
    d.request({"request": "flush"})
    seen_labels: dict[int, list[dict[str, str]]] = {}
    for f in profile_files(d.state_dir):
        sidecar = json.loads(f.with_name(f.name.split(".folded")[0] + ".json").read_text())
        for pid_text, labels in sidecar["identities"].items():
            seen_labels.setdefault(int(pid_text), []).append(labels)
    for leaf, pid in pids.items():
        assert seen_labels.get(pid), leaf
        for labels in seen_labels[pid]:
            assert labels == {"cgroup": tree.path(leaf), **WORKLOADS[leaf][2]}, (leaf, labels)


def test_a_process_moved_to_another_cgroup_keeps_each_samples_identity(tmp_path: Path, require_bpf: None,
                                                                        daemon_factory: Any, tree: Tree) -> None:
    """A busy process in a docker scope, then moved into a service's cgroup
    while the daemon samples it (a pid that changes cgroup: an orchestrator's
    move, ``systemd-run --scope`` adopting it).  A snapshot over both times
    names each sample by the cgroup of its window, in its root frames and
    labels, as its filters choose them.  Before, the newest window's identity
    named all of them: ``snapshot --container ID --root container,unit,pid``
    showed the container's samples as ``[host];UNIT``."""
    d: DaemonProc = daemon_factory()
    d.wait_for(lambda: d.status()["windows"] >= 1, 60, "a first window")
    box, svc = f"system.slice/docker-{C_DOCKER}.scope", f"system.slice/{UNIT}"
    p = _spawn_busy(tree, box)

    def samples(**flt: Any) -> int:
        head, out = d.request({"request": "snapshot", "seconds": 600, "format": "folded", "root": "pid", **flt})
        assert head["ok"], head
        return _pids_in(out).get(p.pid, 0)

    d.wait_for(lambda: samples(container=C_DOCKER[:12]) >= 20, 60, "samples of the process in the container")
    (tree.make(svc) / "cgroup.procs").write_text(str(p.pid))
    d.wait_for(lambda: samples(unit=UNIT) >= 20, 60, "samples of the process in the service")
    os.kill(p.pid, signal.SIGSTOP)
    seen = d.status()["windows"]
    d.wait_for(lambda: d.status()["windows"] >= seen + 2, 30, "two windows after the stop")
    in_box, in_svc = samples(container=C_DOCKER[:12]), samples(unit=UNIT)
    assert in_box >= 20 and in_svc >= 20, (in_box, in_svc)

    box_root = (f"docker-{C_DOCKER}.scope", C_DOCKER[:12])
    head, out = d.request({"request": "snapshot", "seconds": 600, "format": "folded", "root": "unit,container,pid"})
    assert head["ok"], head
    assert _folded_by_pid(out)[p.pid] == {box_root: in_box, (UNIT, "[host]"): in_svc}
    head, out = d.request({"request": "snapshot", "seconds": 600, "format": "folded", "root": "unit,container,pid",
                           "container": C_DOCKER[:12]})
    assert head["ok"], head
    assert _folded_by_pid(out) == {p.pid: {box_root: in_box}}

    head, pb = d.request({"request": "snapshot", "seconds": 600, "format": "pprof", "pid": [p.pid]})
    assert head["ok"], head
    by_cgroup: dict[str, int] = {}
    for labels, n in _pprof_samples(pb):
        assert labels.get("container_id") == (C_DOCKER if labels["cgroup"] == tree.path(box) else None), labels
        by_cgroup[labels["cgroup"]] = by_cgroup.get(labels["cgroup"], 0) + n
    assert by_cgroup == {tree.path(box): in_box, tree.path(svc): in_svc}
