"""Cgroup identities through the daemon's outputs, without BPF: root specs and
their validation, folded roots, pprof labels, snapshot filters, Pyroscope
service series and sidecars.  (The real thing: tests/faults/test_cgroup_labels.py.)"""

from __future__ import annotations

import gzip
import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from flamed.daemon.config import DaemonConfig, OutputConfig, PyroscopeConfig, RetentionConfig, config_from_dict
from flamed.daemon.fleet import windows_folded, windows_pprof
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.protocol import ProtocolError, SnapshotFilter, parse_request
from flamed.daemon.pyroscope import Pusher, Target, service_parts
from flamed.daemon.ring import RingWindow
from flamed.daemon.store import ProfileStore
from flamed.errors import ConfigError, UsageError
from flamed.outputs import profile_pb2 as pb
from flamed.sampling.cgroups import CgroupIdentity, identity_from_path
from flamed.serve.index import Filters, Index
from flamed.sampling.contract import CountKey, canonical_root, counts_to_profile, parse_root

C1 = "ab" * 32
UID = "6a2b8f3e-1c4d-4e5f-8a9b-0123456789ab"
SVC = identity_from_path("/system.slice/nginx.service", 101)
BOX = identity_from_path(f"/system.slice/docker-{C1}.scope", 102)
POD = identity_from_path(f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{C1}.scope", 103)
IDENTS: dict[int, CgroupIdentity] = {10: SVC, 20: BOX, 30: POD}
COUNTS: dict[CountKey, int] = {
    (10, 10, "nginx", ("main", "serve")): 5,
    (20, 21, "app", ("main", "work")): 3,
    (30, 30, "pause", ("main",)): 2,
    (40, 40, "lost", ("main",)): 1,  # its cgroup did not resolve
}


@pytest.mark.parametrize(("spec", "kinds"), [
    ("pid", ("pid",)), ("none", ()), (" container , pid ", ("container", "pid")),
    ("unit,container,cgroup,tid", ("unit", "container", "cgroup", "tid")), ("cgroup", ("cgroup",)),
])
def test_root_specs(spec: str, kinds: tuple[str, ...]) -> None:
    assert parse_root(spec) == kinds
    assert canonical_root(spec) == (",".join(kinds) or "none")


@pytest.mark.parametrize(("value", "why"), [
    ("task", "unknown frame 'task'"), ("pid,tid", "give one"), ("", "empty frame"), ("unit,,pid", "empty frame"),
    ("unit,unit", "repeated"), ("none,pid", "stands alone"), ("unit;pid", "unknown frame"),
])
def test_config_refuses_bad_root_frames(value: str, why: str) -> None:
    with pytest.raises(ConfigError, match="output.root_frame") as e:
        config_from_dict({"output": {"root_frame": value}})
    assert why in str(e.value) and "comma-separated" in str(e.value)


def test_config_keeps_root_frames_in_canonical_spelling() -> None:
    assert config_from_dict({"output": {"root_frame": "unit, pid"}}).output.root_frame == "unit,pid"
    assert config_from_dict({"output": {"root_frame": "none"}}).output.root_frame == "none"
    assert DaemonConfig().output.root_frame == "pid"
    with pytest.raises(ConfigError, match="expected a string"):
        config_from_dict({"output": {"root_frame": ["unit", "pid"]}})


def test_folded_roots_name_unit_container_and_unknown() -> None:
    p = counts_to_profile(COUNTS, "unit,container,pid", identities=IDENTS)
    roots = {s[:3] for s in p.stacks}
    assert roots == {
        ("nginx.service", "[host]", "nginx-10"),
        (f"docker-{C1}.scope", C1[:12], "app-20"),
        (f"cri-containerd-{C1}.scope", C1[:12], "pause-30"),
        ("[unknown cgroup]", "[unknown cgroup]", "lost-40"),
    }
    # without identities the plain task roots are unchanged
    assert counts_to_profile(COUNTS, "pid").stacks == counts_to_profile(COUNTS, "pid", identities=IDENTS).stacks
    cg = counts_to_profile(COUNTS, "cgroup", identities=IDENTS)
    assert ("/system.slice/nginx.service", "main", "serve") in cg.stacks


def _sample_labels(data: bytes) -> list[dict[str, str]]:
    msg = pb.Profile()
    msg.ParseFromString(gzip.decompress(data))
    st = msg.string_table
    return [{st[lb.key]: st[lb.str] for lb in s.label} for s in msg.sample]


def test_pprof_samples_carry_service_container_and_pod_labels() -> None:
    w = RingWindow(0, 10**9, dict(COUNTS), 11, sample_rate=99.0, identities=IDENTS)
    by_pid = {labels["pid"]: labels for labels in _sample_labels(windows_pprof([w], root="pid", host="h"))}
    assert by_pid["10"]["service_name"] == "nginx" and by_pid["10"]["cgroup"] == SVC.path
    assert "container_id" not in by_pid["10"] and "pod" not in by_pid["10"]
    assert by_pid["20"]["container_id"] == C1 and by_pid["20"]["service_name"] == C1[:12]
    assert by_pid["30"]["pod"] == UID
    assert set(by_pid["40"]) == {"pid", "thread", "comm", "host"}


def test_a_process_that_moved_keeps_each_windows_identity() -> None:
    """A process put into a container's cgroup, then into a service's (a pid
    that changes cgroup between drains): merged windows name each sample by
    the cgroup of its own window, in root frames and labels alike.  Before,
    the newest window's identity named all of them (the container's samples
    showed as ``[host];nginx.service``)."""
    stack = ("main", "work")
    w1 = RingWindow(0, 10**9, {(10, 11, "app", stack): 4}, 4, sample_rate=99.0, identities={10: BOX})
    w2 = RingWindow(10**9, 2 * 10**9, {(10, 11, "app", stack): 7, (20, 20, "other", stack): 1}, 8,
                    sample_rate=99.0, identities={10: SVC, 20: POD})
    w3 = RingWindow(2 * 10**9, 3 * 10**9, {(10, 11, "app", stack): 2}, 2, sample_rate=99.0)  # unresolved: newest
    folded = windows_folded([w1, w2, w3], root="container,unit,pid").decode().splitlines()
    assert sorted(folded) == sorted([
        f"{C1[:12]};docker-{C1}.scope;app-10;main;work 4",
        "[host];nginx.service;app-10;main;work 9",
        f"{C1[:12]};cri-containerd-{C1}.scope;other-20;main;work 1",
    ])
    samples = _sample_values(windows_pprof([w1, w2, w3], root="pid", host="h"))
    assert sorted((lb.get("service_name"), lb.get("container_id"), lb["pid"], n) for lb, n in samples) == sorted([
        (C1[:12], C1, "10", 4), ("nginx", None, "10", 9), (C1[:12], C1, "20", 1)])


def _sample_values(data: bytes) -> list[tuple[dict[str, str], int]]:
    msg = pb.Profile()
    msg.ParseFromString(gzip.decompress(data))
    st = msg.string_table
    return [({st[lb.key]: st[lb.str] for lb in s.label}, s.value[0]) for s in msg.sample]


def _filtered(counts: dict[CountKey, int] = COUNTS, idents: dict[int, CgroupIdentity] = IDENTS,
              **fields: object) -> set[int]:
    req = parse_request(json.dumps({"request": "snapshot", **fields}).encode(), formats=["folded"], max_next=60)
    assert req.snapshot is not None
    into: dict[CountKey, int] = {}
    SnapshotFilter(req.snapshot).apply(counts, into, idents)
    return {k[0] for k in into}


def test_snapshot_filters_by_unit_container_pod_and_cgroup() -> None:
    assert _filtered() == {10, 20, 30, 40}
    assert _filtered(unit="nginx.service") == _filtered(unit="nginx") == {10}
    assert _filtered(unit=f"docker-{C1}.scope") == {20}
    assert _filtered(container=C1[:4]) == {20, 30}
    assert _filtered(container=C1[:3]) == set()  # too short to be an id prefix
    assert _filtered(pod=UID) == _filtered(pod=UID.replace("-", "_")) == {30}
    assert _filtered(cgroup="/system.slice") == _filtered(cgroup="/sys/fs/cgroup/unified/system.slice") == {10, 20}
    assert _filtered(cgroup="/system") == set()  # a path prefix is not a parent
    assert _filtered(cgroup="nginx.service") == {10}
    assert _filtered(cgroup="103") == {30}
    assert _filtered(cgroup=["/kubepods.slice", "nginx.service"], unit="nginx") == {10}
    assert _filtered(unit="nginx", container=C1) == set()  # every filter given must match


def test_snapshot_filters_take_unit_templates_as_sampling_does() -> None:
    """[sampling] units = ["getty@.service"] follows getty@tty9 and getty@tty10; the
    snapshot's unit and cgroup fields matched no instance ("no samples matched")."""
    idents = {50: identity_from_path("/system.slice/getty@tty9.service", 109),
              60: identity_from_path("/system.slice/getty@tty10.service", 110),
              70: identity_from_path("/system.slice/gettyx.service", 111)}
    counts: dict[CountKey, int] = {(pid, pid, "agetty", ("main",)): 1 for pid in idents}

    def got(**fields: object) -> set[int]:
        return _filtered(counts, idents, **fields)

    assert got(unit="getty@.service") == got(cgroup="getty@.service") == {50, 60}
    assert got(unit="getty@tty9.service") == got(unit="getty@tty9") == {50}
    assert got(unit="gettyx") == {70}


@pytest.mark.parametrize(("fields", "why"), [
    ({"unit": ""}, "non-empty"), ({"container": []}, "1..1024"), ({"pod": 3}, "non-empty"),
    ({"cgroup": "/sys/fs/cgroup/cpu/x"}, "cgroup v1"), ({"root": "pid,tid"}, "field 'root'"),
    ({"root": 1}, "field 'root'"),
])
def test_bad_identity_fields_are_refused(fields: dict[str, object], why: str) -> None:
    with pytest.raises(ProtocolError, match=why.replace("(", r"\(")):
        parse_request(json.dumps({"request": "snapshot", **fields}).encode(), formats=["folded"], max_next=60)


def test_pyroscope_sends_one_series_per_service() -> None:
    w = RingWindow(0, 10**9, dict(COUNTS), 11, {"map_full": 1}, 99.0, identities=IDENTS)
    parts = service_parts(w)
    assert [name for name, _ in parts] == [None, C1[:12], "nginx"]
    assert sum(sum(p.counts.values()) for _, p in parts) == sum(COUNTS.values())
    assert [p.samples for _, p in parts] == [11, 0, 0] and parts[1][1].lost == {}
    sent: list[str] = []

    def sender(_t: Target, req: urllib.request.Request) -> None:
        sent.append(urllib.parse.parse_qs(urllib.parse.urlsplit(req.full_url).query)["name"][0])

    cfg = PyroscopeConfig(server_address="http://127.0.0.1:1", application_name="app", format="folded")
    m = DaemonMetrics(process=False)
    pusher = Pusher(cfg, m, host="h", root="pid", sender=sender)
    try:
        pusher.submit(w)
        pusher.stop(10)
    finally:
        pusher.stop(0)
    assert sent == ["app{host=h}", f"app{{host=h,service_name={C1[:12]}}}", "app{host=h,service_name=nginx}"]
    assert pusher.sent == 1  # one window, however many requests


def test_sidecar_records_the_identities_of_the_files_processes(tmp_path: Path) -> None:
    out = OutputConfig(state_dir=str(tmp_path), host="h1", root_frame="container,pid")
    st = ProfileStore(out, RetentionConfig(), DaemonMetrics(process=False), clock_ns=lambda: 0)
    st.ensure_dir()
    st.add(0, 10**9, dict(COUNTS), 11, {}, 99.0, {**IDENTS, 99: SVC})
    path = st.rotate()
    assert path is not None
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    assert meta["identities"] == {"10": SVC.labels(), "20": BOX.labels(), "30": POD.labels()}
    assert meta["root_frame"] == "container,pid"
    lines = Path(path).read_text().splitlines()
    assert f"{C1[:12]};app-20;main;work 3" in lines and "[host];nginx-10;main;serve 5" in lines


def _state_dir(tmp_path: Path, root_frame: str) -> Path:
    out = OutputConfig(state_dir=str(tmp_path), host="h1", root_frame=root_frame)
    st = ProfileStore(out, RetentionConfig(), DaemonMetrics(process=False), clock_ns=lambda: 0)
    st.ensure_dir()
    st.add(0, 10**9, dict(COUNTS), 11, {}, 99.0, IDENTS)
    assert st.rotate() is not None
    return tmp_path


def test_serve_filters_and_groups_by_the_sidecars_identities(tmp_path: Path) -> None:
    index = Index.from_state_dir(str(_state_dir(tmp_path, "pid")))

    def roots(**q: str) -> dict[tuple[str, ...], float]:
        p = index.profile(0, 2 * 10**9, Filters.parse(q))
        out: dict[tuple[str, ...], float] = {}
        for s, w in p.stacks.items():
            key = s[:2] if "group" in q else s[:1]
            out[key] = out.get(key, 0) + w
        return out

    assert roots(unit="nginx") == {("nginx-10",): 5}
    assert roots(container=C1[:12]) == {("app-20",): 3, ("pause-30",): 2}
    assert roots(pod=UID) == {("pause-30",): 2}
    assert roots(cgroup="/system.slice") == {("nginx-10",): 5, ("app-20",): 3}
    assert roots(cgroup="/system.slice", comm="^app$") == {("app-20",): 3}
    assert roots(group="container") == {("[host]", "nginx-10"): 5, (C1[:12], "app-20"): 3,
                                        (C1[:12], "pause-30"): 2, ("[unknown cgroup]", "lost-40"): 1}
    assert roots(group="unit", unit="nginx") == {("nginx.service", "nginx-10"): 5}
    # the timeline's weights follow the filters
    tl = sum(w for _t, w in index.points(0, 2 * 10**9, Filters.parse({"container": C1[:12]})))
    assert tl == pytest.approx(5)
    with pytest.raises(UsageError, match="group"):
        Filters.parse({"group": "pid"})
    with pytest.raises(UsageError, match="cgroup v1"):
        Filters.parse({"cgroup": "/sys/fs/cgroup/memory/x"})


def test_serve_finds_the_pid_among_composite_roots(tmp_path: Path) -> None:
    index = Index.from_state_dir(str(_state_dir(tmp_path, "unit,pid")))
    p = index.profile(0, 2 * 10**9, Filters.parse({"pod": UID}))
    assert {s[:2] for s in p.stacks} == {(f"cri-containerd-{C1}.scope", "pause-30")}
    bare = Index.from_state_dir(str(_state_dir(tmp_path / "bare", "unit,comm")))
    assert not bare.profile(0, 2 * 10**9, Filters.parse({"pod": UID})).stacks  # no pid: nothing to match
