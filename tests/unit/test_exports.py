"""pprof, speedscope and chrome trace: contents, readers, round trips, CLI."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from support import DATA
from flamed.cli import main
from flamed.errors import InputError
from flamed.folded import read_folded
from flamed.model import Profile, Sample, is_task, parse_task_frame
from flamed.outputs import choose, get
from flamed.outputs import profile_pb2 as pb
from flamed.outputs.chrometrace import samples_trace
from flamed.outputs.pprof import read_pprof, to_proto, write_pprof
from flamed.outputs.speedscope import read_speedscope, samples_document, to_document


def real_profile() -> Profile:
    with gzip.open(DATA / "bcc" / "profile-folded.txt.gz", "rb") as f:
        return read_folded(f)


def pprof_bytes(p: Profile) -> bytes:
    buf = io.BytesIO()
    write_pprof(p, buf)
    return buf.getvalue()


def test_pprof_contents() -> None:
    p = Profile(sample_rate=99.0, start_ns=1_764_000_000_000_000_000, end_ns=1_764_000_010_000_000_000,
                labels={"host": "web-1"})
    p.add(("app-10/11", "main", "handle (app/web.py:42)", "sys_read_[k]"), 7)
    p.add(("app-10/11", "main", "handle (app/web.py:43)"), 3)
    p.add(("app-10/12", "[libc.so.6]"), 2)
    data = pprof_bytes(p)
    assert data[:2] == b"\x1f\x8b"
    msg = pb.Profile()
    msg.ParseFromString(gzip.decompress(data))
    s = list(msg.string_table)
    assert s[0] == ""
    assert [(s[t.type], s[t.unit]) for t in msg.sample_type] == [("samples", "count"), ("cpu", "nanoseconds")]
    assert msg.period == round(1e9 / 99) and s[msg.period_type.type] == "cpu"
    assert msg.time_nanos == p.start_ns and msg.duration_nanos == 10_000_000_000
    assert s[msg.default_sample_type] == "cpu"
    funcs = {f.id: f for f in msg.function}
    maps = {m.id: s[m.filename] for m in msg.mapping}
    by_frame = {}
    for loc in msg.location:
        (line,) = loc.line
        f = funcs[line.function_id]
        by_frame[(s[f.name], s[f.filename], line.line)] = maps.get(loc.mapping_id, "")
    assert by_frame[("handle", "app/web.py", 42)] == ""
    assert by_frame[("handle", "app/web.py", 43)] == ""
    assert by_frame[("sys_read", "", 0)] == "[kernel.kallsyms]"
    assert by_frame[("[libc.so.6]", "", 0)] == "libc.so.6"
    # One Function for both lines of handle().
    assert sum(1 for f in msg.function if s[f.name] == "handle") == 1
    vals = sorted((list(x.value), {s[lb.key]: lb.num for lb in x.label}) for x in msg.sample)
    assert vals[0] == ([2, 2 * msg.period], {"pid": 10, "tid": 12})
    assert sorted(v[0][0] for v in vals) == [2, 3, 7]
    assert "host=web-1" in [s[c] for c in msg.comment]
    # Deterministic bytes.
    assert pprof_bytes(p.copy()) == data


def test_pprof_without_rate_has_only_counts() -> None:
    p = real_profile()
    msg = to_proto(p)
    assert len(msg.sample_type) == 1 and msg.period == 0 and msg.time_nanos == 0
    q = read_pprof(pprof_bytes(p))
    assert q.stacks == p.stacks and q.sample_rate is None and q.start_ns is None


def test_pprof_rejects_garbage() -> None:
    with pytest.raises(InputError, match="not a pprof profile"):
        read_pprof(b"\x0a\x05\x08garbage-here", source="x.pb")
    with pytest.raises(InputError, match="corrupt gzip"):
        read_pprof(b"\x1f\x8b\x08\x00broken", source="x.pb.gz")


# What a frame of folded text can be: anything but ; and LF (the readers of
# pprof and speedscope make any other name one, docs/collapse.md "The ; rule").
_names = st.text(max_size=8).filter(lambda f: ";" not in f and "\n" not in f)
_frames = st.one_of(
    _names,
    st.builds(lambda n, f, ln: f"{n} ({f}.py:{ln})", _names, st.text(alphabet="abc/_", max_size=6),
              st.integers(1, 10**6)),
    st.builds(lambda n: f"{n}_[k]", _names),
    st.sampled_from(["[unknown]", "[libc.so.6]", "libc.so.6`malloc", "x (a.py)", "y (b.py:0)", "app-1/2"]),
)
_profiles = st.builds(
    lambda stacks, rate, start, dur, labels: _mk(stacks, rate, start, dur, labels),
    st.dictionaries(st.lists(_frames, min_size=1, max_size=6).map(tuple), st.integers(1, 10**12), max_size=12),
    st.one_of(st.none(), st.floats(0.5, 10_000, allow_nan=False)),
    st.one_of(st.none(), st.integers(1, 2**62)),
    st.integers(0, 10**12),
    st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=5), st.text(max_size=8), max_size=3),
)


def _mk(stacks: dict[tuple[str, ...], int], rate: float | None, start: int | None, dur: int,
        labels: dict[str, str]) -> Profile:
    p = Profile(stacks=dict(stacks), sample_rate=rate, labels=labels)
    if start is not None:
        p.start_ns, p.end_ns = start, start + dur
    return p


@settings(max_examples=150, deadline=None)
@given(_profiles)
def test_pprof_round_trip(p: Profile) -> None:
    # pprof's values are int64 (more is an error: test_pprof_values_past_int64_are_an_error).
    assume(sum(p.stacks.values()) * (max(1, round(1e9 / p.sample_rate)) if p.sample_rate else 1) <= 2**63 - 1)
    q = read_pprof(pprof_bytes(p))
    assert q.stacks == p.stacks
    assert q.sample_rate == p.sample_rate
    assert (q.start_ns, q.end_ns) == (p.start_ns, p.end_ns)
    assert q.labels == p.labels


def _go_pprof(tmp: Path, *args: str) -> str | None:
    """``go tool pprof ARGS`` output, or None without go."""
    go = shutil.which("go")
    if go is None:
        return None
    env = dict(os.environ, PPROF_TMPDIR=str(tmp / "pprof"), HOME=str(tmp), GOCACHE=str(tmp / "gocache"),
               GOTOOLCHAIN="local", PPROF_BINARY_PATH="/nonexistent")
    r = subprocess.run([go, "tool", "pprof", *args], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("command", [["export"], ["collapse"]])
def test_pprof_of_invalid_utf8_frames(tmp_path: Path, command: list[str]) -> None:
    """Invalid UTF-8 kept by the folded reader becomes valid UTF-8 strings (\\xNN), frames kept apart."""
    src = tmp_path / "ff.folded"
    src.write_bytes(b"a;\xff 1\na;\xfe 2\nb;\xc3\xa9\xff 4\nc;\xc3\xa9 8\n")
    out = tmp_path / "s.pb.gz"
    assert main([*command, "-o", str(out), str(src)]) == 0
    data = gzip.decompress(out.read_bytes())
    msg = pb.Profile()
    msg.ParseFromString(data)  # proto3 strings: the parser refuses invalid UTF-8
    for s in msg.string_table:
        s.encode("utf-8")
    names = {msg.string_table[f.name] for f in msg.function}
    assert names == {"a", "b", "c", "\\xff", "\\xfe", "\u00e9\\xff", "\u00e9"}
    back = read_pprof(out.read_bytes())
    assert back.stacks == {("a", "\\xff"): 1, ("a", "\\xfe"): 2, ("b", "\u00e9\\xff"): 4, ("c", "\u00e9"): 8}
    top = _go_pprof(tmp_path, "-top", "-sample_index=samples", str(out))
    if top is not None:
        rows = [ln.split() for ln in top.splitlines() if re.match(r"^\s*[0-9]+\s+[0-9.]+%", ln)]
        flat = {r[-1]: int(r[0]) for r in rows}
        assert flat["\\xff"] == 1 and flat["\\xfe"] == 2 and flat["\u00e9\\xff"] == 4 and flat["\u00e9"] == 8, top


def test_pprof_labels_each_id_a_root_frame_names(tmp_path: Path) -> None:
    """comm-?/TID (a thread of a capture without pids) gets its tid label, as
    comm-PID/TID gets both; comm-? names no id and gets none (and breaks nothing)."""
    p = Profile()
    for root, w in (("a-1/2", 1), ("b-3", 2), ("c-?/4", 4), ("d-?", 8), ("e", 16)):
        p.add((root, "main"), w)
    msg = to_proto(p)
    s = msg.string_table
    labels = {int(x.value[0]): {s[lb.key]: lb.num for lb in x.label} for x in msg.sample}
    assert labels == {1: {"pid": 1, "tid": 2}, 2: {"pid": 3}, 4: {"tid": 4}, 8: {}, 16: {}}
    # A real perf script capture (its default fields: no pid) collapsed with --tid and --pid.
    capture = DATA / "perf" / "c-default.txt.gz"
    for opt, key in (("--tid", "tid"), ("--pid", None)):
        out = tmp_path / f"c{opt}.pb.gz"
        assert main(["collapse", "--jobs", "1", opt, str(capture), "-o", str(out)]) == 0
        back = read_pprof(out.read_bytes())
        roots = {st[0] for st in back.stacks}
        msg = pb.Profile()
        msg.ParseFromString(gzip.decompress(out.read_bytes()))
        got = {(msg.string_table[lb.key], lb.num) for x in msg.sample for lb in x.label}
        if key is None:
            assert roots == {"hot-?", "job:2-?", "worker 0-?", "worker 1-?"} and got == set()
        else:
            assert roots == {"hot-?/11166", "job:2-?/11170", "worker 0-?/11168", "worker 1-?/11169"}
            assert got == {("tid", 11166), ("tid", 11168), ("tid", 11169), ("tid", 11170)}
        raw = _go_pprof(tmp_path, "-raw", str(out))
        if raw is not None:
            found = set(re.findall(r"^\s+(pid|tid):\[(\d+)\]", raw, re.M))
            assert found == {(k, str(v)) for k, v in got}, raw
            assert "pid:" not in raw
    out = tmp_path / "forms.pb.gz"
    with out.open("wb") as f:
        write_pprof(p, f)
    traces = _go_pprof(tmp_path, "-traces", "-sample_index=samples", str(out))
    if traces is not None:
        blocks = {b.split()[-1]: b for b in traces.split("-----------+") if b.strip().endswith(("a-1/2", "b-3", "c-?/4", "d-?", "e"))}
        assert re.search(r"pid:\s+1\n\s+tid:\s+2\n", blocks["a-1/2"]), traces
        assert "tid:" not in blocks["b-3"] and re.search(r"pid:\s+3\n", blocks["b-3"]), traces
        assert "pid:" not in blocks["c-?/4"] and re.search(r"tid:\s+4\n", blocks["c-?/4"]), traces
        assert "pid:" not in blocks["d-?"] and "tid:" not in blocks["d-?"], traces
    # comm-? is a command, not a task: the other outputs take it as such.
    assert not is_task(parse_task_frame("d-?")) and parse_task_frame("d-?").comm == "d-?"
    folded = tmp_path / "forms.folded"
    folded.write_text("".join(f"{';'.join(k)} {w}\n" for k, w in p.sorted_items()))
    for name in ("f.speedscope.json", "f.svg", "f.chrometrace.json"):
        assert main(["export", str(folded), "-o", str(tmp_path / name)]) == 0
    assert len(to_document(p)["profiles"]) == 1  # not every root is a task: one profile


@settings(max_examples=150, deadline=None)
@given(_profiles)
def test_speedscope_round_trip(p: Profile) -> None:
    doc = to_document(p)
    data = json.dumps(doc).encode()
    assert read_speedscope(data).stacks == p.stacks


def test_speedscope_one_profile_per_task() -> None:
    p = Profile()
    p.add(("app-1/1", "main", "a"), 3)
    p.add(("app-1/2", "main", "b"), 4)
    p.add(("app-1/2", "run (w.py:3)"), 1)
    doc = to_document(p)
    assert [x["name"] for x in doc["profiles"]] == ["app-1/1", "app-1/2"]
    assert [x["endValue"] for x in doc["profiles"]] == [3, 5]
    assert {"name": "run", "file": "w.py", "line": 3} in doc["shared"]["frames"]
    q = Profile()
    q.add(("main", "a"), 1)
    assert len(to_document(q)["profiles"]) == 1


def _stream() -> list[Sample]:
    ms = 1_000_000
    out = []
    for i in range(10):  # thread 2: f for 5 samples, then g; 1 ms apart
        out.append(Sample(1000 * ms + i * ms, ("app-1/2", "main", "f" if i < 5 else "g"), 1, pid=1, tid=2))
    for i in range(3):  # thread 3: idle gap after the second sample
        t = 1000 * ms + (i if i < 2 else 8) * ms
        out.append(Sample(t, ("app-1/3", "loop"), 1, pid=1, tid=3))
    return sorted(out, key=lambda s: s.time_ns)


def test_speedscope_evented_from_samples() -> None:
    doc = samples_document(_stream())
    assert [x["name"] for x in doc["profiles"]] == ["app (pid 1, tid 2)", "app (pid 1, tid 3)"]
    frames = [f["name"] for f in doc["shared"]["frames"]]
    ev = doc["profiles"][0]["events"]
    opened = [(e["at"], frames[e["frame"]]) for e in ev if e["type"] == "O"]
    assert opened == [(0, "app-1/2"), (0, "main"), (0, "f"), (5_000_000, "g")]
    ats = [e["at"] for e in ev]
    assert ats == sorted(ats)
    # Durations read back: f 5 ms, g 5 ms (the last sample lasts one interval).
    back = read_speedscope(json.dumps(doc).encode())
    assert back.stacks[("app-1/2", "main", "f")] == 5_000_000
    assert back.stacks[("app-1/2", "main", "g")] == 5_000_000
    # Thread 3 was idle from 2 ms to 8 ms: 3 samples = 3 ms, not 9.
    assert back.stacks[("app-1/3", "loop")] == 3_000_000
    assert back.labels["unit"] == "nanoseconds"


def test_chrometrace_from_samples() -> None:
    doc = samples_trace(_stream())
    ev = doc["traceEvents"]
    names = {(e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"app (pid 1, tid 2)", "app (pid 1, tid 3)"}
    xs = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X"]
    assert (2, "f", 0.0, 5000.0) in xs and (2, "g", 5000.0, 5000.0) in xs and (2, "main", 0.0, 10000.0) in xs
    assert (3, "loop", 0.0, 2000.0) in xs and (3, "loop", 8000.0, 1000.0) in xs
    json.dumps(doc, allow_nan=False)


def test_registry_and_extensions() -> None:
    assert choose(None, "x.pb.gz").name == "pprof"
    assert choose(None, "x.speedscope.json").name == "speedscope"
    assert choose(None, "x.trace.json").name == "chrometrace"
    assert get("chrometrace").wants_samples


def test_cli_export_round_trip_through_every_reader(tmp_path: Path) -> None:
    src = DATA / "bcc" / "profile-folded.txt.gz"
    pb_path = tmp_path / "p.pb.gz"
    assert main(["export", "-o", str(pb_path), "--sample-rate", "49", "--start-ns", "1000", "--duration-ns", "5",
                 str(src)]) == 0
    q = read_pprof(pb_path.read_bytes())
    assert q.stacks == real_profile().stacks and q.sample_rate == 49 and (q.start_ns, q.end_ns) == (1000, 1005)
    ss = tmp_path / "p.speedscope.json"
    assert main(["export", "-o", str(ss), str(pb_path)]) == 0
    back = tmp_path / "back.folded"
    assert main(["export", "--format", "folded", "-o", str(back), str(ss)]) == 0
    assert read_folded(back.open("rb")).stacks == real_profile().stacks
    err = io.StringIO()
    assert main(["export", str(src)], stderr=err) == 2
    assert "--format" in err.getvalue()
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\x0a\x03\x08\x01")  # looks like pprof, truncated
    err = io.StringIO()
    assert main(["export", "-f", "folded", str(bad)], stderr=err) == 1
    assert "bad.pb" in err.getvalue()


def test_cli_export_timeline_from_real_perf_capture(tmp_path: Path) -> None:
    from flamed.collapse import get as get_collapser
    from flamed.collapse.base import CollapseOptions

    src = DATA / "perf" / "c-pid-tid.txt.gz"
    with gzip.open(src, "rb") as f:
        samples = list(get_collapser("perf").samples(f, CollapseOptions(), source=str(src)))
    threads = {(s.pid, s.tid) for s in samples}
    assert len(samples) > 20 and len(threads) >= 2
    trace = tmp_path / "t.trace.json"
    assert main(["export", "-o", str(trace), str(src)]) == 0
    ev = json.loads(trace.read_text())["traceEvents"]
    assert {(e["pid"], e["tid"]) for e in ev if e["ph"] == "X"} == threads
    # Every sample's leaf is on its thread's track at the sample's time.
    t0 = min(s.time_ns for s in samples)
    spans = [(e["tid"], e["name"], e["ts"], e["ts"] + e["dur"]) for e in ev if e["ph"] == "X"]
    for s in samples[:50]:
        at = (s.time_ns - t0) / 1000.0
        assert any(tid == s.tid and name == s.stack[-1] and a <= at < b + 1e-3 for tid, name, a, b in spans), s
    ss = tmp_path / "t.speedscope.json"
    assert main(["export", "-o", str(ss), str(src)]) == 0
    doc = json.loads(ss.read_text())
    assert {p["type"] for p in doc["profiles"]} == {"evented"} and len(doc["profiles"]) == len(threads)
    agg = tmp_path / "a.speedscope.json"
    assert main(["export", "--aggregate", "-o", str(agg), str(src)]) == 0
    assert {p["type"] for p in json.loads(agg.read_text())["profiles"]} == {"sampled"}


def test_golden_exports() -> None:
    from support import golden

    p = real_profile()
    p.sample_rate = 99.0
    p.start_ns = 1_764_676_800_000_000_000
    p.end_ns = p.start_ns + 2_000_000_000
    golden(DATA / "exports" / "bcc.pb", to_proto(p).SerializeToString(deterministic=True))
    golden(DATA / "exports" / "bcc.speedscope.json", json.dumps(to_document(p), indent=1).encode())
    golden(DATA / "exports" / "stream.trace.json", json.dumps(samples_trace(_stream()), indent=1).encode())


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["profiles", "shared", "frames", "type", "samples", "weights", "events", "at", "frame",
                         "name", "unit", "file", "line"]), inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_speedscope_reader_never_crashes(doc: object) -> None:
    try:
        read_speedscope(json.dumps(doc).encode())
    except InputError:
        pass


def _sampled_doc(weights: list[object]) -> bytes:
    doc = {
        "shared": {"frames": [{"name": "main"}, {"name": "work"}]},
        "profiles": [{"type": "sampled", "name": "p", "unit": "none", "startValue": 0, "endValue": 1,
                      "samples": [[0, 1]] * len(weights), "weights": weights}],
    }
    return json.dumps(doc).encode()  # float('nan') and inf as JSON's NaN and Infinity, which speedscope files may hold


def test_speedscope_bad_weights_are_skipped_and_counted_as_folded_counts_are(tmp_path: Path) -> None:
    # A negative, NaN, infinite or past-int64 weight was dropped without a word
    # (the reader kept only weights > 0), while the folded reader reports a
    # negative count as a malformed line: both now skip, count and say so.
    from flamed.folded import ReadStats

    stats = ReadStats()
    data = _sampled_doc([3, -2, float("nan"), float("inf"), 1e30, 0, 4])
    p = read_speedscope(data, source="x.json", stats=stats)
    assert p.stacks == {("main", "work"): 7}
    assert stats.skipped == 4 and stats.records == 3
    assert stats.first_errors == [
        "x.json: profile 0, sample 1: weight -2 is negative: a weight is 0 or more",
        "x.json: profile 0, sample 2: weight nan is not a finite number",
        "x.json: profile 0, sample 3: weight inf is not a finite number",
        f"x.json: profile 0, sample 4: weight 1e+30 is over the int64 maximum ({2**63 - 1})",
    ]
    assert stats.summary() == (
        "skipped 4 malformed samples (first: x.json: profile 0, sample 1: weight -2 is negative: a weight is 0 or more)"
    )
    with pytest.raises(InputError, match=r"x.json: profile 0, sample 1: weight -2 is negative"):
        read_speedscope(data, source="x.json", strict=True)
    # An evented profile's event at a NaN time: counted, its open/close kept.
    ev = json.loads(data)
    ev["profiles"] = [{"type": "evented", "name": "e", "unit": "none", "startValue": 0, "endValue": 9, "events": [
        {"type": "O", "frame": 0, "at": 0}, {"type": "O", "frame": 1, "at": float("nan")},
        {"type": "C", "frame": 1, "at": 5}, {"type": "C", "frame": 0, "at": 9}]}]
    stats = ReadStats()
    p = read_speedscope(json.dumps(ev).encode(), source="e.json", stats=stats)
    assert stats.skipped == 1 and stats.first_errors == ["e.json: profile 0, event 1: time nan is not a finite number"]
    assert p.stacks == {("main",): 4}

    # The commands say it as they say it of a folded file's negative count.
    ss = tmp_path / "bad.speedscope.json"
    ss.write_bytes(_sampled_doc([3, -2]))
    folded = tmp_path / "bad.folded"
    folded.write_text("main;work 3\nmain;work -2\n")
    for path, first in ((ss, f"{ss}: profile 0, sample 1: weight -2 is negative"), (folded, f"{folded}:2: count -2 is negative")):
        out, err = io.StringIO(), io.StringIO()
        assert main(["export", "--format", "folded", str(path), "-o", str(tmp_path / "o.folded")], stdout=out, stderr=err) == 0
        assert (tmp_path / "o.folded").read_text() == "main;work 3\n"
        assert f"flamed export: skipped 1 malformed {'sample' if path == ss else 'line'} (first: {first}" in err.getvalue()
        err = io.StringIO()
        assert main(["export", "--strict", "--format", "folded", str(path)], stdout=out, stderr=err) == 1
        assert f"flamed export: error: {first}" in err.getvalue()


def test_speedscope_events_whose_time_goes_back_or_never_close_are_counted_not_inflated() -> None:
    from flamed.folded import ReadStats

    frames = [{"name": "a"}, {"name": "b"}]

    def doc(events: list[tuple[str, int, float]]) -> bytes:
        return json.dumps({"shared": {"frames": frames}, "profiles": [{
            "type": "evented", "name": "e", "unit": "none", "startValue": 0, "endValue": 10,
            "events": [{"type": t, "frame": f, "at": at} for t, f, at in events]}]}).encode()

    # b closes at 3, before it opened (8): the span 3..8 was counted a second time
    # (a 15 over a profile 10 long).  Now that event's time is skipped and counted.
    stats = ReadStats()
    p = read_speedscope(doc([("O", 0, 0), ("O", 1, 8), ("C", 1, 3), ("C", 0, 10)]), source="e.json", stats=stats)
    assert sum(p.stacks.values()) == 10, p.stacks
    assert p.stacks == {("a",): 10}
    assert stats.first_errors == ["e.json: profile 0, event 2: time 3 is before the previous event's (8)"]
    with pytest.raises(InputError, match="before the previous event"):
        read_speedscope(doc([("O", 0, 0), ("O", 1, 8), ("C", 1, 3), ("C", 0, 10)]), source="e.json", strict=True)
    # a frame never closed: what came before its last event counts, and the loss is said
    stats = ReadStats()
    p = read_speedscope(doc([("O", 0, 0), ("O", 1, 4), ("C", 1, 6)]), source="u.json", stats=stats)
    assert p.stacks == {("a",): 4, ("a", "b"): 2}
    assert stats.skipped == 1 and "1 frame(s) still open at the last event ('a' innermost)" in stats.first_errors[0]


def test_foreign_names_with_separators_stay_one_frame(tmp_path: Path) -> None:
    """A pprof or speedscope name holding ; or a newline (any program names its
    functions) is one frame: ; becomes :, LF a space; the folded output stays
    one record per line and reads back whole."""
    prof = pb.Profile()
    prof.string_table.extend(["", "samples", "count", "a;b\nc", "main"])
    t = prof.sample_type.add()
    t.type, t.unit = 1, 2
    for fid, name in ((1, 3), (2, 4)):
        f = prof.function.add()
        f.id, f.name = fid, name
        loc = prof.location.add()
        loc.id = fid
        loc.line.add().function_id = fid
    smp = prof.sample.add()
    smp.location_id.extend([1, 2])
    smp.value.append(5)
    assert read_pprof(prof.SerializeToString(), source="p.pb").stacks == {("main", "a:b c"): 5}
    ss = json.dumps({"shared": {"frames": [{"name": "x;y\nz"}, {"name": "q", "file": "f.py", "line": 3}]},
                     "profiles": [{"type": "sampled", "name": "s", "unit": "none", "startValue": 0, "endValue": 4,
                                   "samples": [[0, 1]], "weights": [4]}]}).encode()
    assert read_speedscope(ss, source="s.json").stacks == {("x:y z", "q (f.py:3)"): 4}
    pp = tmp_path / "p.pb"
    pp.write_bytes(prof.SerializeToString())
    out = tmp_path / "p.folded"
    assert main(["export", "-f", "folded", str(pp), "-o", str(out)], stdout=io.StringIO(), stderr=io.StringIO()) == 0
    assert out.read_text() == "main;a:b c 5\n"
    # a name's string index past the table is corrupt data naming the file, not an empty frame
    prof.function[0].name = 99
    with pytest.raises(InputError, match=r"p\.pb.*function 1 names string 99, past the string table's 5"):
        read_pprof(prof.SerializeToString(), source="p.pb")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_pprof_reader_never_crashes(data: bytes) -> None:
    # Garbage, and valid profiles with bytes flipped.
    try:
        read_pprof(data)
    except InputError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 255))
def test_pprof_reader_survives_corruption(pos: int, byte: int) -> None:
    raw = to_proto(real_profile()).SerializeToString()
    i = pos % len(raw)
    data = raw[:i] + bytes([byte]) + raw[i + 1:]
    try:
        read_pprof(data)
    except InputError:
        pass


def _default_perf_samples() -> list[Sample]:
    # perf script's default output: a 4-thread capture with thread ids only (no pid).
    from flamed.collapse import get as get_collapser
    from flamed.collapse.base import CollapseOptions

    src = DATA / "perf" / "c-default.txt.gz"
    with gzip.open(src, "rb") as f:
        return list(get_collapser("perf").samples(f, CollapseOptions(), source=str(src)))


def test_timelines_named_from_the_capture() -> None:
    samples = _default_perf_samples()
    doc = samples_document(samples)
    assert sorted(x["name"] for x in doc["profiles"]) == [
        "hot (tid 11166)", "job:2 (tid 11170)", "worker 0 (tid 11168)", "worker 1 (tid 11169)"]
    ev = samples_trace(samples)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    # No pid in the capture: each thread is its own process, never "swapper (0)" or pid 0.
    assert procs == {11166: "hot (tid 11166; no pid in the capture)", 11168: "worker 0 (tid 11168; no pid in the capture)",
                     11169: "worker 1 (tid 11169; no pid in the capture)", 11170: "job:2 (tid 11170; no pid in the capture)"}
    # With pids (perf script -F +pid): one process named after its main thread, four threads in it.
    from flamed.collapse import get as get_collapser
    from flamed.collapse.base import CollapseOptions

    src = DATA / "perf" / "c-pid-tid.txt.gz"
    with gzip.open(src, "rb") as f:
        samples = list(get_collapser("perf").samples(f, CollapseOptions(), source=str(src)))
    ev = samples_trace(samples)["traceEvents"]
    assert {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"} == {11166: "hot (11166)"}
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert threads[11166] == "hot (pid 11166, tid 11166)" and threads[11168] == "worker 0 (pid 11166, tid 11168)"
    assert {x["name"] for x in samples_document(samples)["profiles"]} == set(threads.values())


def test_flamechart_lanes_per_thread() -> None:
    from flamed.outputs._timeline import lanes

    samples = sorted(_default_perf_samples(), key=lambda s: s.time_ns)
    items = lanes(samples)
    roots = [stack[0] for stack, _ in items]
    # Each thread's samples are one run (one lane), and the lanes have distinct roots.
    runs = [r for i, r in enumerate(roots) if i == 0 or roots[i - 1] != r]
    assert sorted(runs) == sorted(set(runs)) and len(runs) == 4
    assert set(runs) == {"hot-?/11166", "worker 0-?/11168", "worker 1-?/11169", "job:2-?/11170"}
    assert sum(w for _, w in items) == sum(s.weight for s in samples)
    # Within a lane, time order is kept.
    lane = [s.stack[1:] for s in samples if s.tid == 11168]
    assert [st[1:] for st, _ in items if st[0] == "worker 0-?/11168"] == lane


def test_a_timeline_without_ids_has_a_lane_per_command(tmp_path: Path) -> None:
    """A trace whose root frames are bare commands: each command is a lane of
    its own in chrometrace and speedscope (every sample was drawn as one thread
    0, nginx's and postgres's interleaved in one lane)."""
    trace = tmp_path / "comm.trace"
    trace.write_text("".join(f"{t} {c};{f} 1\n" for t, c, f in
                             [(100, "nginx", "x"), (200, "postgres", "y"), (300, "nginx", "x"), (400, "postgres", "y")]))
    out = tmp_path / "t.json"
    assert main(["export", "-f", "chrometrace", str(trace), "-o", str(out)], stderr=io.StringIO()) == 0
    events = json.loads(out.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(lanes.values()) == ["nginx (no thread id in the capture)", "postgres (no thread id in the capture)"]
    by_lane = {tid: {e["name"] for e in events if e["ph"] == "X" and e["tid"] == tid} for tid in lanes}
    assert sorted(map(sorted, by_lane.values())) == [["nginx", "x"], ["postgres", "y"]]
    assert main(["export", "-f", "speedscope", str(trace), "-o", str(out)], stderr=io.StringIO()) == 0
    assert [p["name"] for p in json.loads(out.read_text())["profiles"]] == [
        "nginx (no thread id in the capture)", "postgres (no thread id in the capture)"]


def test_a_trace_exported_from_perf_script_keeps_its_threads(tmp_path: Path) -> None:
    """export -f trace writes each sample's task in its root frame, as merge
    does: a timeline drawn from the trace has the capture's threads (it had
    one lane per command, the samples of all a command's threads in it)."""
    perf = DATA / "perf" / "c-pid-tid.txt.gz"
    trace = tmp_path / "x.trace"
    assert main(["export", "-f", "trace", str(perf), "-o", str(trace)], stderr=io.StringIO()) == 0
    roots = {line.split(" ", 1)[1].split(";", 1)[0] for line in trace.read_text().splitlines()[1:]}
    assert roots == {"hot-11166/11166", "worker 0-11166/11168", "worker 1-11166/11169", "job:2-11166/11170"}

    def threads(src: Path) -> list[str]:
        out = tmp_path / "t.json"
        assert main(["export", "-f", "chrometrace", str(src), "-o", str(out)], stderr=io.StringIO()) == 0
        return sorted(e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"]
                      if e["ph"] == "M" and e["name"] == "thread_name")

    assert threads(trace) == threads(perf) == [
        "hot (pid 11166, tid 11166)", "job:2 (pid 11166, tid 11170)",
        "worker 0 (pid 11166, tid 11168)", "worker 1 (pid 11166, tid 11169)"]


def test_pprof_values_past_int64_are_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pprof's readers sum values in int64: a total past it would wrap (go tool pprof: 2014%, negative cum)."""
    src = tmp_path / "two.folded"
    src.write_bytes(b"a;b 9000000000000000000\na;c 9000000000000000000\n")
    out = tmp_path / "two.pb.gz"
    assert main(["export", "--format", "pprof", str(src), "-o", str(out)]) == 1
    assert "int64" in capsys.readouterr().err
    assert not out.exists()
    # The cpu/nanoseconds value too: samples times the period.
    src.write_bytes(b"a;b 10000000000\n")
    assert main(["export", "--format", "pprof", "--sample-rate", "1", str(src), "-o", str(out)]) == 1
    assert "period" in capsys.readouterr().err
    assert not out.exists()
    # At the limit: exact, and read back.
    src.write_bytes(b"a;b 9223372036854775000\na;c 807\n")
    assert main(["export", "--format", "pprof", str(src), "-o", str(out)]) == 0
    assert read_pprof(out.read_bytes()).stacks == {("a", "b"): 9223372036854775000, ("a", "c"): 807}
    top = _go_pprof(tmp_path, "-top", "-sample_index=samples", str(out))
    if top is not None:
        # go prints the values through float64; the point is: no wrapped negative total, no 2014%.
        assert re.search(r"100% of 922337203685477[0-9]{4} total", top) and "-9" not in top, top


@pytest.mark.parametrize(
    "cmd",
    [
        ["export", "--format", "speedscope"],
        ["export", "--format", "chrometrace"],
        ["svg", "--flamechart"],
    ],
    ids=["speedscope", "chrometrace", "flamechart"],
)
def test_timeline_outputs_report_skipped_lines(tmp_path: Path, cmd: list[str]) -> None:
    """The timeline path (samples in time order) skipped a malformed line without a
    word, where the aggregated path and collapse report it."""
    bad = DATA / "collapse" / "trace-one-bad-line.trace"  # a real capture, line 20 cut short
    out = tmp_path / "out"
    err = io.StringIO()
    assert main([*cmd, str(bad), "-o", str(out)], stderr=err) == 0
    assert f"skipped 1 malformed line (first: {bad}:20: expected 'TIMESTAMP STACK [COUNT]')" in err.getvalue()
    assert out.stat().st_size > 0
    err = io.StringIO()
    assert main([*cmd, "--strict", str(bad), "-o", str(tmp_path / "strict")], stderr=err) != 0
    assert f"{bad}:20:" in err.getvalue() and not (tmp_path / "strict").exists()


def test_a_timeline_of_inputs_not_all_timed_says_it_is_the_summed_profile(tmp_path: Path) -> None:
    """A timeline asked of a perf script and a folded file was written as the
    summed profile without a word; now stderr says which input keeps no time.
    Inputs that all keep no time (a folded file to speedscope) are summed, as
    documented, without a note."""
    folded = tmp_path / "x.folded"
    folded.write_text("main;work 3\n")
    perf = str(DATA / "perf" / "c-pid-tid.txt.gz")
    for args in (["export", "-f", "speedscope", "-o", str(tmp_path / "o.json")],
                 ["svg", "--flamechart", "-o", str(tmp_path / "o.svg")]):
        err = io.StringIO()
        assert main([*args, perf, str(folded)], stderr=err) == 0
        assert f"{folded} keeps no sample times" in err.getvalue() and "not a timeline" in err.getvalue()
        err = io.StringIO()
        assert main([*args, str(folded), str(folded)], stderr=err) == 0
        assert "keeps no sample times" not in err.getvalue()


def test_pprof_negative_and_mismatched_values_are_not_dropped_silently(tmp_path: Path) -> None:
    """A negative value (a profile of differences) was dropped without a word, and
    a sample with fewer values than the file's sample types was skipped; now the
    first is skipped and counted as a folded file's negative count is, the second
    is corrupt data naming the file (go tool pprof refuses it too)."""
    from flamed.folded import ReadStats

    def profile(values: list[list[int]]) -> bytes:
        prof = pb.Profile()
        prof.string_table.extend(["", "samples", "count", "cpu", "nanoseconds", "main"])
        for t, u in ((1, 2), (3, 4)):
            vt = prof.sample_type.add()
            vt.type, vt.unit = t, u
        f = prof.function.add()
        f.id, f.name = 1, 5
        loc = prof.location.add()
        loc.id = 1
        loc.line.add().function_id = 1
        for v in values:
            smp = prof.sample.add()
            smp.location_id.append(1)
            smp.value.extend(v)
        return prof.SerializeToString()

    stats = ReadStats()
    p = read_pprof(profile([[-5, -500], [5, 500], [0, 0]]), source="d.pb", stats=stats)
    assert p.stacks == {("main",): 5}
    assert stats.skipped == 1 and stats.records == 2
    assert stats.first_errors == ["d.pb: sample 0: value -5 is negative (a profile of differences?): a weight is 0 or more"]
    with pytest.raises(InputError, match="sample 0: value -5 is negative"):
        read_pprof(profile([[-5, -500]]), source="d.pb", strict=True)
    with pytest.raises(InputError, match=r"s\.pb.*sample 1 has 1 value\(s\) for 2 sample type\(s\)"):
        read_pprof(profile([[1, 1], [1]]), source="s.pb")
    # and the commands say it
    path = tmp_path / "d.pb"
    path.write_bytes(profile([[-5, -500], [5, 500]]))
    err = io.StringIO()
    assert main(["export", "-f", "folded", str(path), "-o", str(tmp_path / "o.folded")], stderr=err) == 0
    assert "skipped 1 malformed sample" in err.getvalue() and (tmp_path / "o.folded").read_text() == "main 5\n"


def test_pprof_main_binary_is_never_a_marker_frame() -> None:
    """A profile recorded with --root none has frames at its roots: `go tool pprof`
    showed "File: [truncated: no table]" (the heaviest root, taken for a command)."""
    from flamed.model import Profile
    from flamed.outputs.pprof import main_binary

    p = Profile({("[truncated: no table]", "main", "work"): 9, ("myapp-12", "main"): 2})
    assert main_binary(p) == "myapp"
    assert main_binary(Profile({("[truncated: no table]", "main"): 9, ("[unknown]", "x"): 3})) == ""


def test_json_tree_of_times_names_its_unit_and_counts_have_none() -> None:
    """The JSON tree of an off-CPU or wall profile held microseconds with nothing
    to say so (a reader took them for samples); its root now says "unit"."""
    from flamed.outputs.jsontree import build_tree, tree_unit, write_tree

    times = Profile(stacks={("a", "b"): 1500, ("a",): 500}, labels={"kind": "off_cpu", "unit": "microseconds"})
    counts = Profile(stacks={("a", "b"): 3})
    for prof, unit in ((times, "microseconds"), (counts, None)):
        out = io.BytesIO()
        get("json").write(prof, out)
        root = json.loads(out.getvalue())
        assert root.get("unit") == unit and root["value"] == prof.total(), root
        assert all("unit" not in c for c in root["children"]), root
        out = io.BytesIO()
        write_tree(build_tree(prof), out, name="all", indent=True, unit=tree_unit(prof))  # flamed tree's call
        assert json.loads(out.getvalue()).get("unit") == unit
