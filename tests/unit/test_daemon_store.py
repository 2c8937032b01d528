from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from flamed.daemon.config import OutputConfig, RetentionConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.store import ProfileStore
from flamed.folded import read_folded
from flamed.fileio import open_input

S = 1_000_000_000
T0 = 1_700_000_000 * S  # 2023-11-14T22:13:20Z


class Clock:
    def __init__(self, t: int = T0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make(tmp_path: Path, clock: Clock | None = None, **kw: object) -> tuple[ProfileStore, DaemonMetrics]:
    ret = {k[4:]: kw.pop(k) for k in list(kw) if k.startswith("ret_")}
    out = OutputConfig(state_dir=str(tmp_path / "p"), host="h1", rotate_interval=60.0, **kw)  # type: ignore[arg-type]
    m = DaemonMetrics(process=False)
    st = ProfileStore(out, RetentionConfig(**ret), m, clock_ns=clock or Clock())  # type: ignore[arg-type]
    st.ensure_dir()
    return st, m


def counts(n: int, tgid: int = 7) -> dict:
    return {(tgid, tgid, "busy", ("main", "spin")): n, (tgid, tgid + 1, "busy", ("main", "read", "sys_read_[k]")): 1}


def metric(m: DaemonMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_rotation_boundary_names_sidecar_and_latest(tmp_path: Path) -> None:
    st, m = make(tmp_path)
    st.add(T0, T0 + 10 * S, counts(5), 6, {"stack_enomem": 1}, 19.0)
    assert not st.due(T0 + 10 * S)
    st.add(T0 + 10 * S, T0 + 40 * S, counts(3), 4, {}, 19.0)
    # boundary is the next multiple of 60 s after the period start (22:14:00)
    assert not st.due(T0 + 39 * S)
    assert st.due(T0 + 40 * S)
    path = st.rotate()
    assert path is not None and os.path.basename(path) == "h1-20231114T221320Z.folded"
    text = Path(path).read_bytes()
    assert text == b"busy-7;main;read;sys_read_[k] 2\nbusy-7;main;spin 8\n"
    meta = json.loads((tmp_path / "p" / "h1-20231114T221320Z.json").read_text())
    assert meta["start_ns"] == T0 and meta["end_ns"] == T0 + 40 * S
    assert meta["samples"] == 10 and meta["weight"] == 10 and meta["lost"] == {"stack_enomem": 1}
    assert meta["sample_rate"] == 19.0 and meta["host"] == "h1" and meta["windows"] == 2
    assert meta["sha256"] == hashlib.sha256(text).hexdigest() and meta["bytes"] == len(text)
    assert meta["flamed_version"]
    assert os.readlink(tmp_path / "p" / "latest.folded") == "h1-20231114T221320Z.folded"
    assert (tmp_path / "p" / "latest.folded").read_bytes() == text
    assert metric(m, "flamed_files_written_total") == 1
    assert metric(m, "flamed_disk_files") == 1
    # nothing left over: no temp files, and a rotation with no window writes nothing
    assert sorted(os.listdir(tmp_path / "p")) == ["h1-20231114T221320Z.folded", "h1-20231114T221320Z.json",
                                                 "latest.folded", "latest.json"]
    assert st.rotate() is None


def test_same_second_gets_a_suffix_and_gzip(tmp_path: Path) -> None:
    st, _ = make(tmp_path, compress=True)
    st.add(T0, T0 + S // 2, counts(1), 2, {}, 99.0)
    a = st.rotate()
    st.add(T0 + S // 2, T0 + S // 2 + 1, counts(2), 3, {}, 99.0)
    b = st.rotate()
    assert a and b and a.endswith("Z.folded.gz") and b.endswith("Z-2.folded.gz")
    with open_input(b) as f:
        p = read_folded(f)
    assert p.total() == 3
    assert gzip.decompress(Path(b).read_bytes()).startswith(b"busy-7;")
    assert os.readlink(tmp_path / "p" / "latest.folded.gz") == os.path.basename(b)


def test_retention_by_count_bytes_age(tmp_path: Path) -> None:
    clock = Clock()
    st, m = make(tmp_path, clock, ret_max_files=3)
    for i in range(5):
        st.add(T0 + i * 60 * S, T0 + (i + 1) * 60 * S, counts(i + 1), i + 2, {}, 19.0)
        st.rotate()
    files = st.list_files()
    assert [f[0] for f in files] == ["h1-20231114T221520Z", "h1-20231114T221620Z", "h1-20231114T221720Z"]
    assert metric(m, "flamed_retention_deletions_total", reason="max_files") == 2
    assert not (tmp_path / "p" / "h1-20231114T221320Z.json").exists()  # sidecar went with it

    one = files[-1][2]
    st.configure(st.output, RetentionConfig(max_files=0, max_bytes=one + 1, max_age=0))
    st.apply_retention()
    assert len(st.list_files()) == 1
    assert metric(m, "flamed_retention_deletions_total", reason="max_bytes") == 2
    assert metric(m, "flamed_disk_bytes") == st.list_files()[0][2]

    # age: the newest file is kept even when everything is too old
    st.configure(st.output, RetentionConfig(max_files=0, max_bytes=0, max_age=10))
    st.add(T0 + 600 * S, T0 + 660 * S, counts(1), 2, {}, 19.0)
    st.rotate()
    old = st.list_files()[0][1]
    os.utime(tmp_path / "p" / old, (0, 0))
    clock.t = int(os.stat(tmp_path / "p" / st.list_files()[-1][1]).st_mtime * S)
    st.apply_retention()
    assert [f[1] for f in st.list_files()] == ["h1-20231114T222320Z.folded"]
    assert metric(m, "flamed_retention_deletions_total", reason="max_age") == 1


def test_retention_deletes_the_files_written_first_after_the_clock_went_back(tmp_path: Path) -> None:
    """A step back of the wall clock (NTP, date -s) gives the new files older names than the
    files before it: retention must still delete those written first, not each new file as
    soon as it is written (the directory at its max_files, as it is after a week)."""
    clock = Clock()
    st, m = make(tmp_path, clock, ret_max_files=3)
    for i in range(3):
        st.add(T0 + i * 60 * S, T0 + (i + 1) * 60 * S, counts(1), 2, {}, 19.0)
        clock.t = T0 + (i + 1) * 60 * S
        st.rotate()
    before = [f[1] for f in st.list_files()]
    # The clock goes back an hour; two more periods are written.
    back = T0 - 3600 * S
    new = []
    for i in range(2):
        st.add(back + i * 60 * S, back + (i + 1) * 60 * S, counts(2), 3, {}, 19.0)
        clock.t = back + (i + 1) * 60 * S
        path = st.rotate()
        assert path is not None and Path(path).exists(), f"{path} was deleted as soon as it was written"
        new.append(os.path.basename(path))
    kept = [f[1] for f in st.list_files()]
    assert kept == before[2:] + new  # the two written first are gone, the new ones are the newest
    assert os.readlink(tmp_path / "p" / "latest.folded") == new[-1]
    assert (tmp_path / "p" / "latest.folded").exists()
    assert metric(m, "flamed_retention_deletions_total", reason="max_files") == 2
    # A restart reads the names alone: the directory is still within max_files and nothing goes.
    st2, _ = make(tmp_path, clock, ret_max_files=3)
    assert st2.apply_retention().files == 3


def test_disk_error_keeps_backlog_and_writes_later(tmp_path: Path) -> None:
    st, m = make(tmp_path, backlog_max_bytes=300)
    blocker = tmp_path / "p"
    os.rename(blocker, tmp_path / "moved")
    blocker.write_text("a file where the directory should be")  # ENOTDIR / EEXIST: a real OSError
    for i in range(3):
        st.add(T0 + i * 60 * S, T0 + (i + 1) * 60 * S, counts(i + 1), i + 2, {}, 19.0)
        assert st.rotate() is None
    assert st.last_error and "cannot write" in st.last_error
    assert sum(v for k, v in _samples(m, "flamed_write_errors_total").items()) == 3
    # budget of 300 bytes: only the newest closed files are kept in memory
    assert len(st.backlog) < 3 and metric(m, "flamed_backlog_dropped_files_total") >= 1
    assert metric(m, "flamed_backlog_bytes") == st.backlog_bytes <= 300 or len(st.backlog) == 1
    kept = [f.stem for f in st.backlog]
    blocker.unlink()
    path = st.write_pending()
    assert path is not None and st.last_error is None and not st.backlog
    names = sorted(f[0] for f in st.list_files())
    assert names == kept
    assert metric(m, "flamed_backlog_files") == 0


def _samples(m: DaemonMetrics, name: str) -> dict:
    out = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_recover_after_crash(tmp_path: Path) -> None:
    st, _ = make(tmp_path)
    d = tmp_path / "p"
    (d / ".h1-20231114T221320Z.folded.abc.tmp").write_text("half")
    (d / "h1-20231114T221420Z.json").write_text("{}")  # orphan sidecar: its folded file never landed
    (d / "h1-20231114T221520Z.folded").write_text("a;b 3\n")  # folded without sidecar (written by hand)
    done = st.recover()
    assert len(done) == 3
    names = sorted(os.listdir(d))
    assert names == ["h1-20231114T221520Z.folded", "h1-20231114T221520Z.json"]
    meta = json.loads((d / "h1-20231114T221520Z.json").read_text())
    assert meta["recovered"] is True and meta["sha256"] == hashlib.sha256(b"a;b 3\n").hexdigest()


@pytest.mark.parametrize("root,first", [("comm", "busy"), ("tid", "busy-7/7"), ("none", "main")])
def test_root_frame(tmp_path: Path, root: str, first: str) -> None:
    st, _ = make(tmp_path, root_frame=root)
    st.add(T0, T0 + S, counts(1), 2, {}, 19.0)
    path = st.rotate()
    assert path is not None
    assert Path(path).read_text().splitlines()[0].split(";")[0] == first


def _long_stack_windows(windows: int, per_window: int) -> list[dict]:
    """Windows of distinct deep stacks with long frame names: a file whose
    text is much larger than the numbered windows it comes from."""
    out = []
    for w in range(windows):
        c = {}
        for i in range(per_window):
            frames = tuple(f"module_{j % 7}.function_with_a_long_name_{(i * 31 + j) % 97}" for j in range(40))
            c[(100 + i % 5, 100 + i % 5, "svc", frames + (f"leaf_{w}_{i}",))] = 1 + i % 3
        out.append(c)
    return out


@pytest.mark.parametrize("compress", [False, True])
def test_a_period_is_written_to_its_file_without_its_whole_text_in_memory(tmp_path: Path, compress: bool) -> None:
    import tracemalloc

    from flamed.daemon.ring import RingWindow, WindowRing

    st, m = make(tmp_path, compress=compress)
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    windows = _long_stack_windows(3, 3000)
    for i, c in enumerate(windows):
        st.add(T0 + i * S, T0 + (i + 1) * S, ring.pack(RingWindow(0, 1, c, 0)).counts, sum(c.values()), {}, 99.0)
    tracemalloc.start()
    try:
        path = st.rotate()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path is not None and not st.backlog
    data = Path(path).read_bytes()
    text = gzip.decompress(data) if compress else data
    assert text.count(b"\n") == 9000 and len(text) > 12 << 20
    meta = json.loads((tmp_path / "p" / (Path(path).name.split(".")[0] + ".json")).read_text())
    assert meta["bytes"] == len(data) and meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert meta["stacks"] == 9000 and meta["samples"] == sum(sum(c.values()) for c in windows)
    assert metric(m, "flamed_written_bytes_total") == len(data) + len(
        (tmp_path / "p" / (Path(path).name.split(".")[0] + ".json")).read_bytes())
    # Held at once while writing: the period's merged counts and sort keys
    # (frame numbers, 4 bytes a frame; ~5.7 MB here) and a chunk of lines,
    # not the text: a copy of it in memory would alone be len(text) (13.8 MB;
    # the text built whole in memory, as before 2026-12-06, peaked at 14.6
    # MB compressed and 26.5 MB plain).
    assert peak < len(text) // 2, (peak, len(text))


def test_a_file_that_fails_midway_leaves_nothing_and_its_period_waits_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno as errno_mod

    from flamed.daemon import store as store_mod
    from flamed.daemon.ring import RingWindow, WindowRing

    st, m = make(tmp_path)
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    windows = _long_stack_windows(2, 1500)
    for i, c in enumerate(windows):
        st.add(T0 + i * S, T0 + (i + 1) * S, ring.pack(RingWindow(0, 1, c, 0)).counts, sum(c.values()), {}, 99.0)
    real_write = store_mod._Hashing.write

    def failing(self: store_mod._Hashing, b: bytes) -> int:
        if not isinstance(self.out, io.BytesIO) and self.n > 1 << 20:  # a disk failing after 1 MiB of the file
            raise OSError(errno_mod.EIO, "Input/output error")
        return real_write(self, b)

    monkeypatch.setattr(store_mod._Hashing, "write", failing)
    assert st.rotate() is None
    assert os.listdir(tmp_path / "p") == []  # no part of the file, no sidecar, no temp file
    assert len(st.backlog) == 1 and "Input/output error" in (st.last_error or "")
    assert metric(m, "flamed_write_errors_total", errno="EIO") == 1
    monkeypatch.setattr(store_mod._Hashing, "write", real_write)
    path = st.write_pending()
    assert path is not None and not st.backlog and st.last_error is None
    prof = read_folded(open_input(path))
    want: dict[str, int] = {}
    for c in windows:
        for (tgid, _tid, comm, frames), n in c.items():
            line = ";".join((f"{comm}-{tgid}",) + frames)
            want[line] = want.get(line, 0) + n
    assert {";".join(k): v for k, v in prof.stacks.items()} == want
    assert st.samples_written == st.samples_added == sum(sum(c.values()) for c in windows)
