"""Off-CPU periods in the store (names, units, sidecars, retention) and in ``flamed serve``'s index."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flamed.daemon.config import OutputConfig, RetentionConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.ring import RingWindow, WindowRing
from flamed.daemon.store import FILE_RE, ProfileStore, file_kind
from flamed.folded import read_folded
from flamed.serve.index import Filters, Index

S = 1_000_000_000
T0 = 1_700_000_000 * S  # 2023-11-14T22:13:20Z
CPU = {(7, 7, "app", ("main", "spin")): 30}
# 1.2 s blocked in read, 0.4 ms preempted, 300 ns in tiny (0 us a window; 1 us once the file sums two)
OFF = {(7, 7, "app", ("main", "read", "[off-cpu: blocked]")): 1_200_000_400,
       (7, 8, "app", ("main", "[off-cpu: preempted]")): 400_000,
       (7, 9, "app", ("main", "tiny", "[off-cpu: blocked]")): 300}


def store(tmp_path: Path, **ret: int) -> ProfileStore:
    st = ProfileStore(OutputConfig(state_dir=str(tmp_path / "p"), host="h1", rotate_interval=60.0, root_frame="comm",
                                   fsync=False),
                      RetentionConfig(**ret), DaemonMetrics(process=False), clock_ns=lambda: T0 + 600 * S)
    st.ensure_dir()
    return st


def fill(st: ProfileStore, minutes: int) -> None:
    for i in range(minutes):
        for w in range(2):  # two 30 s windows a period
            start = T0 + i * 60 * S + w * 30 * S
            st.add(start, start + 30 * S, dict(CPU), 30, {}, 99.0)
            st.add_offcpu(start, start + 30 * S, dict(OFF))
        st.rotate()


def test_offcpu_files_beside_cpu_files_in_microseconds(tmp_path: Path) -> None:
    st = store(tmp_path)
    fill(st, 1)
    d = tmp_path / "p"
    assert sorted(p.name for p in d.iterdir()) == [
        "h1-20231114T221320Z.folded", "h1-20231114T221320Z.json", "latest-offcpu.folded", "latest-offcpu.json",
        "latest.folded", "latest.json", "offcpu-h1-20231114T221320Z.folded", "offcpu-h1-20231114T221320Z.json"]
    # the CPU file is what it always was
    assert (d / "h1-20231114T221320Z.folded").read_bytes() == b"app;main;spin 60\n"
    assert "kind" not in json.loads((d / "h1-20231114T221320Z.json").read_text())
    assert st.last_written == str(d / "h1-20231114T221320Z.folded")
    prof = read_folded((d / "offcpu-h1-20231114T221320Z.folded").open("rb"), strict=True)
    assert prof.stacks == {("app", "main", "read", "[off-cpu: blocked]"): 2_400_001,
                           ("app", "main", "[off-cpu: preempted]"): 800,
                           ("app", "main", "tiny", "[off-cpu: blocked]"): 1}
    meta = json.loads((d / "offcpu-h1-20231114T221320Z.json").read_text())
    assert (meta["kind"], meta["unit"], meta["weight"], meta["weight_ns"]) == \
        ("offcpu", "microseconds", 2_400_802, 2 * 1_200_400_700)
    assert meta["window_samples"] == [[T0, T0 + 30 * S, 1_200_401], [T0 + 30 * S, T0 + 60 * S, 1_200_401]]
    m = FILE_RE.match("offcpu-h1-20231114T221320Z.folded")
    assert m is not None and file_kind(m) == "offcpu" and m.group("host") == "h1"


def test_retention_counts_each_kind_on_its_own(tmp_path: Path) -> None:
    """max_files is per kind: with off_cpu on, N keeps the newest N periods of both (the
    two kinds used to share the count, so max_files = 1 deleted each off-CPU file as
    soon as the CPU file of its period was written)."""
    st = store(tmp_path, max_files=2)
    fill(st, 5)
    names = sorted(p.name for p in (tmp_path / "p").glob("*.folded") if not p.is_symlink())
    assert names == ["h1-20231114T221620Z.folded", "h1-20231114T221720Z.folded",
                     "offcpu-h1-20231114T221620Z.folded", "offcpu-h1-20231114T221720Z.folded"]
    one = store(tmp_path / "one", max_files=1)
    fill(one, 3)
    names = sorted(p.name for p in (tmp_path / "one" / "p").glob("*.folded") if not p.is_symlink())
    assert names == ["h1-20231114T221520Z.folded", "offcpu-h1-20231114T221520Z.folded"]


def test_max_bytes_counts_both_kinds_and_keeps_the_newest_of_each(tmp_path: Path) -> None:
    """max_bytes bounds the directory whatever the kinds; the newest file of each kind stays."""
    st = store(tmp_path, max_bytes=1)
    fill(st, 3)
    names = sorted(p.name for p in (tmp_path / "p").glob("*.folded") if not p.is_symlink())
    assert names == ["h1-20231114T221520Z.folded", "offcpu-h1-20231114T221520Z.folded"]


def test_latest_offcpu_links_go_with_the_file_they_name(tmp_path: Path) -> None:
    """off_cpu turned off: the last off-CPU file stays under max_files (one of its kind)
    until max_age deletes it; then its latest links go too, instead of pointing at
    nothing (and status no longer names it)."""
    st = store(tmp_path, max_files=2)
    fill(st, 1)
    d = tmp_path / "p"
    assert (d / "latest-offcpu.folded").resolve().exists()
    for i in range(1, 4):  # CPU periods only from here on
        st.add(T0 + i * 60 * S, T0 + (i + 1) * 60 * S, dict(CPU), 30, {}, 99.0)
        st.rotate()
    assert [p.name for p in d.glob("offcpu-*.folded")] == ["offcpu-h1-20231114T221320Z.folded"]
    # older than max_age (the store's clock is T0 + 600 s)
    for p in d.glob("offcpu-*"):
        os.utime(p, (T0 / S - 3600, T0 / S - 3600))
    st.configure(st.output, RetentionConfig(max_files=2, max_age=600))
    st.apply_retention()
    assert not list(d.glob("offcpu-*"))
    assert not (d / "latest-offcpu.folded").is_symlink() and not (d / "latest-offcpu.json").is_symlink()
    assert st.last_written_offcpu is None
    # the CPU links still name the newest CPU file
    assert (d / "latest.folded").resolve() == d / "h1-20231114T221620Z.folded"
    assert (d / "latest.json").resolve() == d / "h1-20231114T221620Z.json"


def test_ring_keeps_kinds_apart() -> None:
    ring = WindowRing(600, 1000, clock_ns=lambda: T0)
    ring.add(RingWindow(T0 - S, T0, dict(CPU), 30), RingWindow(T0 - S, T0, dict(OFF), 0, kind="offcpu"))
    assert [w.counts for w in ring.since(0)] == [CPU]
    assert [w.counts for w in ring.since(0, kind="offcpu")] == [OFF]
    # over the stack budget, the newest window of each kind stays
    small = WindowRing(600, 1, clock_ns=lambda: T0)
    for i in range(3):
        small.add(RingWindow(T0 - S + i, T0 + i, dict(CPU), 30), RingWindow(T0 - S + i, T0 + i, dict(OFF), 0,
                                                                          kind="offcpu"))
    assert [(w.kind, w.end_ns) for w in small.since(0)] + [(w.kind, w.end_ns) for w in small.since(0, kind="offcpu")] \
        == [("cpu", T0 + 2), ("offcpu", T0 + 2)]


def test_serve_shows_offcpu_files_apart_with_their_unit(tmp_path: Path) -> None:
    st = store(tmp_path)
    fill(st, 2)
    idx = Index.from_state_dir(str(tmp_path / "p"))
    s = idx.summary()
    assert s["files"] == 2 and s["weight"] == 4 * 30
    assert s["profiles"] == {"cpu": {"files": 2, "weight": 120, "unit": "samples"},
                             "offcpu": {"files": 2, "weight": 2 * 2_400_802, "unit": "microseconds"}}
    cpu = idx.profile(T0, T0 + 120 * S)
    assert cpu.stacks == {("app", "main", "spin"): 120} and "kind" not in cpu.labels
    off = idx.profile(T0, T0 + 120 * S, Filters(profile="offcpu"))
    assert off.stacks[("app", "main", "read", "[off-cpu: blocked]")] == 2 * 2_400_001
    assert (off.labels["kind"], off.labels["unit"]) == ("off_cpu", "microseconds")
    # the heatmap of off-CPU time: each 30 s window's microseconds spread over its seconds
    tl = idx.timeline(T0, T0 + 120 * S, Filters(profile="offcpu"), view="heatmap")
    total = sum(sum(col) for col in tl["cells"])  # type: ignore[union-attr]
    assert abs(total - 4 * 1_200_401) < 1, total
    tl_cpu = idx.timeline(T0, T0 + 120 * S, Filters(), view="heatmap")
    assert abs(sum(sum(col) for col in tl_cpu["cells"]) - 120) < 1e-6  # type: ignore[union-attr]
    f = Filters.parse({"profile": "offcpu", "include": "read"})
    assert idx.profile(T0, T0 + 120 * S, f).total() == 2 * 2_400_001


def _gauge(text: str, name: str, labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}{{{labels}}} in\n{text}")


def test_daemon_with_off_cpu_and_max_files_1_keeps_a_file_of_each_kind(tmp_path: Path) -> None:
    """A daemon with off_cpu on and max_files = 1 keeps its newest file of each kind (the
    off-CPU file of each period was deleted at once: the two kinds shared the count)."""
    from flamed.daemon.testing import fast_config, running_daemon

    cfg = fast_config(tmp_path, sampling={"off_cpu": True}, retention={"max_files": 1},
                      output={"rotate_interval": 60.0})
    with running_daemon(cfg) as d:
        for _ in range(3):
            assert d.loop.request_flush(30.0) is not None
            names = sorted(p.name for p in (tmp_path / "profiles").glob("*.folded") if not p.is_symlink())
            assert sorted(n.startswith("offcpu-") for n in names) == [False, True], names


def test_daemon_with_off_cpu_tells_ring_windows_by_kind(tmp_path: Path) -> None:
    """The ring's windows are told by kind in the status, its text and the metrics (with
    off_cpu on a drain adds one of each: the single count read double)."""
    from prometheus_client import generate_latest

    from flamed.commands.status import _ring_row
    from flamed.daemon.testing import fast_config, running_daemon

    with running_daemon(fast_config(tmp_path, sampling={"off_cpu": True})) as d:
        deadline = time.monotonic() + 30
        while len(d.ring.since(0)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    # stopped: the ring and the metrics hold still
    cpu, off = len(d.ring.since(0)), len(d.ring.since(0, kind="offcpu"))
    assert cpu >= 3 and off == cpu
    ring = d.status()["ring"]
    assert (ring["windows"], ring["offcpu_windows"]) == (cpu, off)
    assert _ring_row(ring).startswith(f"{cpu} CPU windows and {off} off-CPU windows (")
    text = generate_latest(d.registry).decode()
    assert _gauge(text, "flamed_ring_windows", 'kind="cpu"') == cpu
    assert _gauge(text, "flamed_ring_windows", 'kind="offcpu"') == off
