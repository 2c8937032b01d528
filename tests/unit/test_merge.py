"""Merging sample streams: id remapping, labels, time range, order checks, external sort."""

from __future__ import annotations

import contextlib
import gzip
import io
import random
from pathlib import Path

import pytest

from flamed.cli import main
from flamed.collapse import get
from flamed.errors import InputError
from flamed.merge import FRESH_ID_BASE, IdRemapper, MergeOptions, Source, _external_sort, distinct_names, merge_sources
from flamed.model import Sample, parse_task_frame


def trace(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def merged(paths: list[Path], opts: MergeOptions | None = None, labels: list[str] | None = None) -> list[Sample]:
    srcs = [Source(str(p), str(p), (labels or [p.stem] * len(paths))[i], get("trace")) for i, p in enumerate(paths)]
    with contextlib.ExitStack() as stack:
        return list(merge_sources(srcs, opts or MergeOptions(), stack))


def test_remapper_keeps_first_owner_and_is_stable() -> None:
    r = IdRemapper()
    assert r(0, 10) == 10 and r(0, 11) == 11
    assert r(1, 10) == FRESH_ID_BASE  # taken by source 0
    assert r(1, 12) == 12
    assert r(1, 10) == FRESH_ID_BASE  # same answer again
    assert r(0, 10) == 10
    assert r(2, 10) == FRESH_ID_BASE + 1
    assert r.remapped == 2


def test_kway_merge_preserves_timestamps_and_remaps(tmp_path: Path) -> None:
    a = trace(tmp_path / "a.trace", ["1.0 app-10/11;main;work 1", "3.0 app-10/11;main;idle", "5 app-10/12;x 2"])
    b = trace(tmp_path / "b.trace", ["1.0 db-10/11;q 1", "2.000000001 db-10/11;q 1", "4.0 other;z 7"])
    # (the last line of a.trace is 5 ns: integer timestamps are ns. Keep it sorted by moving it first.)
    a = trace(tmp_path / "a.trace", ["5 app-10/12;x 2", "1.0 app-10/11;main;work 1", "3.0 app-10/11;main;idle"])
    out = merged([a, b])
    assert [s.time_ns for s in out] == [5, 10**9, 10**9, 2 * 10**9 + 1, 3 * 10**9, 4 * 10**9]
    # Ties: the earlier source first.
    assert out[1].source == 0 and out[2].source == 1
    # No id is shared between sources, and root frames name the remapped ids.
    ids = {src: {i for s in out if s.source == src for i in (s.pid, s.tid) if i is not None} for src in (0, 1)}
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert ids[0] | ids[1] >= {10, FRESH_ID_BASE}
    for s in out:
        if s.pid is not None:
            assert s.stack[0].endswith(f"-{s.pid}/{s.tid}")
    assert out[5].stack == ("other", "z") and out[5].weight == 7 and out[5].pid is None
    kept = merged([a, b], MergeOptions(remap_ids=False))
    assert [s.stack[0] for s in kept[:3]] == ["app-10/12", "app-10/11", "db-10/11"]


def test_time_range_and_labels(tmp_path: Path) -> None:
    a = trace(tmp_path / "a.trace", ["1.0 a;x", "2.0 a;y", "3.0 a;z"])
    b = trace(tmp_path / "b.trace.gz", [])
    import gzip

    b.write_bytes(gzip.compress(b"2.5 b;y 2\n"))
    out = merged([a, b], MergeOptions(start_ns=2 * 10**9, end_ns=3 * 10**9, label_root="label"), labels=["web1", "web2"])
    assert [(s.time_ns, s.stack, s.weight) for s in out] == [
        (2 * 10**9, ("web1", "a", "y"), 1),
        (2_500_000_000, ("web2", "b", "y"), 2),
    ]
    out = merged([a, b], MergeOptions(label_root="file"))
    assert {s.stack[0] for s in out} == {"a.trace", "b.trace.gz"}


def test_unsorted_input_names_file_and_line(tmp_path: Path) -> None:
    a = trace(tmp_path / "a.trace", ["# flamed trace", "1.0 a;x", "", "3.0 a;y", "2.0 a;z"])
    with pytest.raises(InputError, match=r"a.trace:5: timestamps go backwards.*--sort"):
        merged([a])


@pytest.mark.parametrize("run", [1, 3, 1000])
def test_external_sort_equals_stable_sort(run: int) -> None:
    rnd = random.Random(run)
    samples = [Sample(time_ns=rnd.randrange(20), stack=(f"f{i}",), weight=1) for i in range(200)]
    with contextlib.ExitStack() as stack:
        got = list(_external_sort(iter(samples), run=run, tmpdir=None, stack=stack))
    assert got == sorted(samples, key=lambda s: s.time_ns)  # stable: ties keep input order


def test_sort_option_merges_unsorted(tmp_path: Path) -> None:
    a = trace(tmp_path / "a.trace", ["3.0 a;y", "1.0 a;x", "2.0 a;z"])
    b = trace(tmp_path / "b.trace", ["1.5 b;q"])
    out = merged([a, b], MergeOptions(sort=True, sort_run=2))
    assert [s.stack[-1] for s in out] == ["x", "q", "z", "y"]


def run_main(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    return main(list(args), stderr=err), err.getvalue()


def test_sort_runs_that_cannot_be_written_are_an_error_naming_the_directory(tmp_path: Path) -> None:
    """--sort spilling its runs into a --tmpdir that is missing, or is a
    file, is an error that names it and says what to do (it was a
    traceback), and -o is left unwritten."""
    a = trace(tmp_path / "a.trace", ["3.0 a;y", "1.0 a;x", "2.0 a;z"])
    not_dir = tmp_path / "file"
    not_dir.write_text("")
    out = tmp_path / "all.trace"
    for tmpdir in (tmp_path / "missing", not_dir):
        rc, err = run_main("merge", "--sort", "--sort-run", "1", "--tmpdir", str(tmpdir), str(a), "-o", str(out))
        assert rc == 1 and "Traceback" not in err, err
        assert f"--sort cannot write its sorted runs to {tmpdir}" in err and "--tmpdir" in err, err
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.trace", "file"]


def test_cli_trace_output_round_trips(tmp_path: Path) -> None:
    a = trace(tmp_path / "a.trace", ["1.000000001 app-1/1;main 1", "2.0 app-1/1;main;f 2"])
    b = trace(tmp_path / "b.trace", ["1.5 app-1/1;main 3"])
    out = tmp_path / "all.trace"
    rc, err = run_main("merge", str(a), str(b), "-o", str(out))
    assert rc == 0, err
    assert "remapped 1 pid/tid" in err
    text = out.read_text().splitlines()
    assert text[0].startswith("# flamed trace")
    assert text[1:] == [
        "1000000001 app-1/1;main 1",
        f"1500000000 app-{FRESH_ID_BASE}/{FRESH_ID_BASE};main 3",
        "2000000000 app-1/1;main;f 2",
    ]
    # Merging the merged trace again changes nothing (its ids no longer collide).
    out2 = tmp_path / "again.trace"
    assert run_main("merge", str(out), "-o", str(out2))[0] == 0
    assert out2.read_text() == out.read_text()
    out3 = tmp_path / "s.trace"
    assert run_main("merge", str(out), "--time-format", "seconds", "-o", str(out3))[0] == 0
    assert out3.read_text().splitlines()[1] == "1.000000001 app-1/1;main 1"


def test_cli_folded_sum_and_errors(tmp_path: Path) -> None:
    a = tmp_path / "a.folded"
    a.write_text("x-1;f 1\ng 2\n")
    b = tmp_path / "b.folded"
    b.write_text("x-1;f 4\n")
    out = tmp_path / "sum.folded"
    rc, err = run_main("merge", str(a), str(b), "-o", str(out))
    assert rc == 0, err
    assert out.read_text() == f"g 2\nx-1;f 1\nx-{FRESH_ID_BASE};f 4\n"
    rc, err = run_main("merge", "--keep-ids", str(a), str(b), "-o", str(out))
    assert out.read_text() == "g 2\nx-1;f 5\n"
    rc, err = run_main("merge", "--from", "1.0", str(a), str(b))
    assert rc == 2 and "need timestamps" in err
    rc, err = run_main("merge", "--output-format", "trace", str(a))
    assert rc == 2 and "needs timestamps" in err
    rc, err = run_main("merge", "--label", "one", str(a), str(b))
    assert rc == 2 and "one per input" in err
    rc, err = run_main("merge", "--from", "yesterday", str(a))
    assert rc == 2 and "--from" in err


@pytest.mark.parametrize("bounds", [["--from", "²s"], ["--from", "1.²s"], ["--to", "٣ms"], ["--from", "2s", "--to", "1s"],
                                    ["--from", "1700000000.5", "--to", "1700000000500000000"]])
def test_time_bounds_out_of_shape_are_usage_errors(tmp_path: Path, bounds: list[str]) -> None:
    """A bound in non-ASCII digits (str.isdigit() takes '²', int() refuses it:
    a traceback) or a --to not after --from (an empty output and exit 0) is a
    usage error naming the option."""
    trace = tmp_path / "a.trace"
    trace.write_text("# flamed trace\n1700000000000000000 app-1/1;main 1\n")
    rc, err = run_main("merge", *bounds, str(trace))
    assert rc == 2 and "Traceback" not in err and bounds[-2] in err, err


@pytest.mark.parametrize(
    "opts",
    [
        MergeOptions(),
        MergeOptions(remap_ids=False),
        MergeOptions(label_root="label"),
        MergeOptions(label_root="file", start_ns=1_200_000_000, end_ns=3_000_000_000),
        MergeOptions(label_root="pid"),
        MergeOptions(label_root="pid", remap_ids=False),
    ],
)
@pytest.mark.parametrize("time_format", ["ns", "seconds"])
def test_trace_fast_path_writes_the_sample_path_bytes(tmp_path: Path, opts: MergeOptions, time_format: str) -> None:
    from flamed.merge import merge_trace_files
    from flamed.outputs.trace import write_trace

    a = trace(
        tmp_path / "a.trace",
        [
            "# flamed trace",
            "1000000000 app-10/11;main;work 1",
            "1.1 app-10/11;main;idle",
            "1200000000 app-10/12;x 007",
            "1300000000 worker 0;run 2.50",
            "",
            "1400000000  spaced;stack  3 \r",
            "1500000000 \xff\xfe-3;y 4",
            "1600000000 w-?/11;z 1",
            "not a line at all",
            "2000000000 db-7;q 1",
        ],
    )
    b = trace(tmp_path / "b.trace", ["1000000000 db-10/11;q 2", "1.25 app-10/12;x 1", "1.65 w-?/11;z 1", "2.5 db-7;q 9"])
    srcs = [Source(str(p), str(p), p.stem, get("trace")) for p in (a, b)]
    slow = io.BytesIO()
    with contextlib.ExitStack() as stack:
        write_trace(merge_sources(srcs, opts, stack), slow, time_format=time_format)
    fast = io.BytesIO()
    with contextlib.ExitStack() as stack:
        merge_trace_files(srcs, opts, stack, fast, time_format=time_format)
    assert fast.getvalue() == slow.getvalue()
    assert fast.getvalue().count(b"\n") > 3


@pytest.mark.parametrize("opts", [MergeOptions(), MergeOptions(label_root="pid", start_ns=1_100_000_000), MergeOptions(remap_ids=False, label_root="label")])
def test_trace_aggregate_fast_path_equals_sample_path(tmp_path: Path, opts: MergeOptions) -> None:
    from flamed.merge import aggregate_trace_files
    from flamed.model import profile_from_samples

    a = trace(tmp_path / "a.trace", ["1.0 app-10/11;main 1", "1.1 app-10/11;main 2.5", "1.2 app-10/12;x 007"])
    with a.open("ab") as f:
        f.write(b"2.0 \xff;y 1\n")  # invalid UTF-8 stays byte-exact
    b = trace(tmp_path / "b.trace", ["1.0 app-10/11;main 2", "1.3 z 1"])
    srcs = [Source(str(p), str(p), p.stem, get("trace")) for p in (a, b)]
    with contextlib.ExitStack() as stack:
        slow = profile_from_samples(merge_sources(srcs, opts, stack))
    with contextlib.ExitStack() as stack:
        fast = aggregate_trace_files(srcs, opts, stack)
    assert fast.stacks == slow.stacks
    assert (fast.start_ns, fast.end_ns) == (slow.start_ns, slow.end_ns)


# -- malformed lines: reported as collapse reports them -------------------------

DATA = Path(__file__).resolve().parent.parent / "data"
BAD_TRACE = DATA / "collapse" / "trace-one-bad-line.trace"  # 40 samples of a real capture, line 20 cut short
BAD_MSG = f"skipped 1 malformed line (first: {BAD_TRACE}:20: expected 'TIMESTAMP STACK [COUNT]')"


@pytest.mark.parametrize(
    "extra",
    [
        ["-o", "{tmp}/out.trace"],  # trace to trace: the line-level path
        ["--output-format", "folded", "-o", "{tmp}/out.folded"],  # traces summed line by line
        ["--sort", "-o", "{tmp}/out.trace"],  # the Sample path
        ["-o", "{tmp}/out.json", "--output-format", "speedscope"],
    ],
)
def test_cli_reports_malformed_trace_lines(tmp_path: Path, extra: list[str]) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    rc, err = run_main("merge", "--format", "trace", str(BAD_TRACE), *args)
    assert rc == 0, err
    assert BAD_MSG in err
    rc, err = run_main("merge", "--format", "trace", "--strict", str(BAD_TRACE), *args)
    assert rc != 0
    assert f"{BAD_TRACE}:20: expected 'TIMESTAMP STACK [COUNT]'" in err


def test_cli_reports_malformed_perf_samples(tmp_path: Path) -> None:
    import gzip

    blocks = gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes()).split(b"\n\n")
    bad = tmp_path / "perf.txt"
    bad.write_bytes(b"\n\n".join(blocks[:3] + [b"Warning: lost 3 chunks"] + blocks[3:]))
    line = b"\n\n".join(blocks[:3]).count(b"\n") + 3
    rc, err = run_main("merge", str(bad), "-o", str(tmp_path / "out.trace"))
    assert rc == 0, err
    assert f"skipped 1 malformed line (first: {bad}:{line}: unrecognised perf script header)" in err
    rc, err = run_main("merge", "--strict", str(bad), "-o", str(tmp_path / "out.trace"))
    assert rc != 0 and f"{bad}:{line}: unrecognised perf script header" in err


def test_trace_with_one_bad_line_is_still_a_trace(tmp_path: Path) -> None:
    # Guessed as a trace, so merge writes a trace (folded input would have no timestamps).
    out = tmp_path / "out.trace"
    rc, err = run_main("merge", str(BAD_TRACE), "-o", str(out))
    assert rc == 0, err
    assert len(out.read_text().splitlines()) == 1 + 39


# -- task identity: root frames comm-PID/TID and comm-?/TID ----------------------

PERF_PID_TID = DATA / "perf" / "c-pid-tid.txt.gz"  # real perf script -F comm,pid,tid,time,...: "hot 11166/11166"
PERF_DEFAULT = DATA / "perf" / "c-default.txt.gz"  # real default perf script: "hot 11166 [000]", no pid


def trace_roots(path: Path) -> list[str]:
    return [line.split(" ", 1)[1].rsplit(" ", 1)[0].split(";", 1)[0] for line in path.read_text().splitlines()[1:]]


def thread_names(path: Path) -> list[str]:
    import json

    ev = json.loads(path.read_text())["traceEvents"]
    return sorted(e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name")


def collapse_folded(tmp_path: Path, *args: str) -> dict[str, int]:
    out = tmp_path / "c.folded"
    rc, err = run_main("collapse", "--jobs", "1", *args, "-o", str(out))
    assert rc == 0, err
    return {k: int(v) for k, _, v in (line.rpartition(" ") for line in out.read_text().splitlines())}


@pytest.mark.parametrize("capture", [PERF_PID_TID, PERF_DEFAULT], ids=["pid-tid", "default"])
def test_merged_perf_script_names_each_task(tmp_path: Path, capture: Path) -> None:
    one = tmp_path / "one.trace"
    rc, err = run_main("merge", str(capture), "-o", str(one))
    assert rc == 0, err
    # The root frames are what 'collapse --tid' writes: comm-PID/TID, or comm-?/TID without a pid.
    assert collapse_folded(tmp_path, str(one)) == collapse_folded(tmp_path, "--tid", str(capture))
    assert len(set(trace_roots(one))) == 4
    if capture is PERF_DEFAULT:
        assert all("-?/" in r for r in trace_roots(one))
    # A timeline of the merged trace has the capture's threads, as one of the capture has.
    direct, merged = tmp_path / "direct.trace.json", tmp_path / "merged.trace.json"
    assert run_main("export", "-o", str(direct), str(capture))[0] == 0
    assert run_main("export", "-o", str(merged), str(one))[0] == 0
    assert thread_names(merged) == thread_names(direct) and len(thread_names(direct)) == 4
    # The general path (--sort) and folded output say the same.
    again = tmp_path / "sorted.trace"
    assert run_main("merge", "--sort", str(capture), "-o", str(again))[0] == 0
    assert again.read_text() == one.read_text()
    folded = tmp_path / "m.folded"
    assert run_main("merge", str(capture), "-o", str(folded))[0] == 0
    assert collapse_folded(tmp_path, str(folded)) == collapse_folded(tmp_path, "--tid", str(capture))


@pytest.mark.parametrize("capture", [PERF_PID_TID, PERF_DEFAULT], ids=["pid-tid", "default"])
def test_remapped_ids_of_perf_script_are_in_the_output(tmp_path: Path, capture: Path) -> None:
    out = tmp_path / "twice.trace"
    rc, err = run_main("merge", str(capture), str(capture), "-o", str(out))
    assert rc == 0, err
    roots = set(trace_roots(out))
    fresh = {i for r in roots for i in (parse_task_frame(r).pid, parse_task_frame(r).tid) if i is not None and i >= FRESH_ID_BASE}
    assert fresh and f"remapped {len(fresh)} pid/tid(s)" in err
    assert len(roots) == 8  # 4 threads per copy, told apart
    timeline = tmp_path / "twice.trace.json"
    assert run_main("export", "-o", str(timeline), str(out))[0] == 0
    assert len(thread_names(timeline)) == 8


@pytest.mark.parametrize("capture", [PERF_PID_TID, PERF_DEFAULT], ids=["pid-tid", "default"])
def test_perf_script_summed_with_folded_input_names_each_task(tmp_path: Path, capture: Path) -> None:
    """A folded input beside a perf script makes merge sum instead of stream; the
    perf script's samples must still name their tasks (as the streaming merge and
    'collapse --tid' do) and have their ids remapped, not fall back to 'comm'."""
    extra = tmp_path / "extra.folded"
    extra.write_text("other;work 3\n")
    out = tmp_path / "sum.folded"
    rc, err = run_main("merge", "--jobs", "1", str(capture), str(capture), str(extra), "-o", str(out))
    assert rc == 0, err
    got = collapse_folded(tmp_path, str(out))
    assert got.pop("other;work") == 3
    per_task = collapse_folded(tmp_path, "--tid", str(capture))
    roots = {k.split(";", 1)[0] for k in got}
    assert len(roots) == 8  # the 4 threads of each copy, told apart
    assert {k for k in got if k.split(";", 1)[0] in {r.split(";", 1)[0] for r in per_task}} == set(per_task)
    fresh = {i for r in roots for i in (parse_task_frame(r).pid, parse_task_frame(r).tid) if i is not None and i >= FRESH_ID_BASE}
    assert fresh and f"remapped {len(fresh)} pid/tid(s)" in err
    assert sum(got.values()) == 2 * sum(per_task.values())


MULTI_EVENT = DATA / "perf" / "multi-event.txt.gz"  # real: perf record -e cpu-clock -e task-clock, 272 samples each


@pytest.mark.parametrize("extra", [[], ["--sort"], ["--output-format", "folded"]], ids=["trace", "sort", "folded"])
def test_merge_of_a_two_event_capture_keeps_one_event(tmp_path: Path, extra: list[str]) -> None:
    """The sample stream of perf script kept every event, so a capture of two events
    merged into a trace (and a timeline) of both: each thread's time counted twice."""
    out = tmp_path / "out"
    rc, err = run_main("merge", str(MULTI_EVENT), *extra, "-o", str(out))
    assert rc == 0, err
    # The event collapse keeps, with the stacks and weights of 'collapse --tid'.
    assert collapse_folded(tmp_path, str(out)) == collapse_folded(tmp_path, "--tid", str(MULTI_EVENT))
    assert "kept event 'cpu-clock' (the first named in the input); left out 272 samples of other events" in err
    assert "task-clock (272 samples, weight 545,090,176)" in err


@pytest.mark.parametrize("fmt", ["speedscope", "chrometrace"])
def test_timeline_of_a_two_event_capture_keeps_one_event(tmp_path: Path, fmt: str) -> None:
    one, both = tmp_path / "one.json", tmp_path / "both.json"
    cpu = tmp_path / "cpu.txt"
    # The capture with its task-clock samples cut out: the timeline must be this one's.
    blocks = gzip.decompress(MULTI_EVENT.read_bytes()).split(b"\n\n")
    cpu.write_bytes(b"\n\n".join(b for b in blocks if b"task-clock:" not in b.split(b"\n", 1)[0]))
    rc, err = run_main("export", "--format", fmt, "-o", str(one), str(cpu))
    assert rc == 0 and "left out" not in err, err
    rc, err = run_main("export", "--format", fmt, "-o", str(both), str(MULTI_EVENT))
    assert rc == 0, err
    assert "left out 272 samples of other events" in err
    assert both.read_bytes() == one.read_bytes()


def test_task_frame_without_pid_round_trips() -> None:
    from flamed.model import Profile, Task, task_frame

    assert parse_task_frame("w-?/11") == Task("w", None, 11)
    assert task_frame("w", None, 11) == "w-?/11"
    assert parse_task_frame("worker 0-?/11168") == Task("worker 0", None, 11168)
    assert parse_task_frame("w-?") == Task("w-?")  # 'collapse --pid' without pids: no id to read
    assert parse_task_frame("a-1/2") == Task("a", 1, 2) and parse_task_frame("a-1") == Task("a", 1)
    p = Profile({("w-?/11", "a"): 2, ("w-?/12", "b"): 1, ("x", "c"): 4})
    assert p.filtered(tid=11).stacks == {("w-?/11", "a"): 2}
    assert p.filtered(comm="^w$").total() == 3


def test_task_frames_without_pid_elsewhere() -> None:
    from flamed.model import Profile
    from flamed.outputs.speedscope import to_document
    from flamed.palette import mixed_kind

    assert mixed_kind("w-?/11", 1) == "other" and mixed_kind("w-11", 1) == "other"
    doc = to_document(Profile({("w-?/11", "a"): 2, ("w-?/12", "b"): 1}))
    assert sorted(x["name"] for x in doc["profiles"]) == ["w-?/11", "w-?/12"]  # one profile per task


def test_trace_of_threads_without_pid_has_a_lane_per_thread(tmp_path: Path) -> None:
    from flamed.collapse.trace import iter_trace
    from flamed.outputs._timeline import lanes

    t = trace(tmp_path / "t4.trace", ["1000 w-?/11;a 1", "2000 w-?/12;b 1", "3000 w-?/11;c 1"])
    with t.open("rb") as f:
        samples = list(iter_trace(f, source=str(t)))
    assert [(s.pid, s.tid) for s in samples] == [(None, 11), (None, 12), (None, 11)]
    assert [st for st, _ in lanes(samples)] == [("w-?/11", "a"), ("w-?/11", "c"), ("w-?/12", "b")]
    out = tmp_path / "t4.trace.json"
    assert run_main("export", "-o", str(out), str(t))[0] == 0
    assert thread_names(out) == ["w (tid 11)", "w (tid 12)"]


@pytest.mark.parametrize("extra", [[], ["--sort"], ["--output-format", "folded"], ["--output-format", "speedscope"]])
def test_merge_remaps_tids_of_frames_without_pid(tmp_path: Path, extra: list[str]) -> None:
    q = trace(tmp_path / "q.trace", ["1000 comm-?/55;a 1", "2000 comm-?/56;b 1"])
    out = tmp_path / "out.x"
    rc, err = run_main("merge", *extra, str(q), str(q), "-o", str(out))
    assert rc == 0, err
    assert "remapped 2 pid/tid(s)" in err
    text = out.read_text()
    for root in ("comm-?/55", "comm-?/56", f"comm-?/{FRESH_ID_BASE}", f"comm-?/{FRESH_ID_BASE + 1}"):
        assert root in text


def test_folded_merge_remaps_tids_of_frames_without_pid(tmp_path: Path) -> None:
    a = tmp_path / "a.folded"
    a.write_text("w-?/11;f 1\n")
    out = tmp_path / "sum.folded"
    rc, err = run_main("merge", str(a), str(a), "-o", str(out))
    assert rc == 0, err
    assert out.read_text() == f"w-?/{FRESH_ID_BASE};f 1\nw-?/11;f 1\n"


# -- labels are one frame each ------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [["-o", "{tmp}/o.trace"], ["--sort", "-o", "{tmp}/o.trace"], ["--output-format", "folded", "-o", "{tmp}/o.folded"]],
    ids=["trace-lines", "samples", "aggregate"],
)
def test_labels_are_sanitized_frames(tmp_path: Path, extra: list[str]) -> None:
    a = trace(tmp_path / "a.trace", ["1000 app-10;a 1"])
    b = trace(tmp_path / "b.trace", ["1500 srv-10;x 1"])
    c = trace(tmp_path / "c.trace", ["1700 db;y 1"])
    args = [x.replace("{tmp}", str(tmp_path)) for x in extra]
    out = Path(args[-1])
    rc, err = run_main("merge", "--label", "x;y", "--label", "p\nq\r", "--label", "", "--label-root", "label", str(a), str(b), str(c), *args)
    assert rc == 0, err
    stacks = {line.split(" ", 1)[1].rsplit(" ", 1)[0] if out.suffix == ".trace" else line.rsplit(" ", 1)[0] for line in out.read_text().splitlines() if not line.startswith("#")}
    assert stacks == {"x:y;app-10;a", "p q ;srv-10000000;x", "[unknown];db;y"}


@pytest.mark.parametrize("root", ["label", "file"])
def test_label_from_a_file_name_with_a_semicolon_is_one_frame(tmp_path: Path, root: str) -> None:
    a = trace(tmp_path / "web;1.trace", ["1000 app;a 1"])
    for extra in ([], ["--sort"], ["--output-format", "folded"]):
        out = tmp_path / "o.txt"
        rc, err = run_main("merge", "--label-root", root, *extra, str(a), "-o", str(out), *([] if extra else ["--output-format", "trace"]))
        assert rc == 0, err
        want = "web:1;app;a" if root == "label" else "web:1.trace;app;a"
        assert want in out.read_text(), (extra, out.read_text())
    f = tmp_path / "web;2.folded"
    f.write_text("app;a 1\n")
    out = tmp_path / "o.folded"
    assert run_main("merge", "--label-root", root, str(f), "-o", str(out))[0] == 0
    assert out.read_text() == ("web:2;app;a 1\n" if root == "label" else "web:2.folded;app;a 1\n")


@pytest.mark.parametrize("root", ["label", "file"])
def test_inputs_of_one_name_in_two_directories_keep_apart(tmp_path: Path, root: str) -> None:
    """d1/x.trace and d2/x.trace (one capture's name on two hosts): their default
    labels and file roots take the directory that tells them apart, instead of
    both becoming 'x' and their samples one root."""
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    a = trace(tmp_path / "d1" / "x.trace", ["1000 app-10;a 1"])
    b = trace(tmp_path / "d2" / "x.trace", ["1500 app-10;a 1"])
    out = tmp_path / "o.folded"
    rc, err = run_main("merge", "--label-root", root, str(a), str(b), "-o", str(out))
    assert rc == 0, err
    roots = {line.split(";", 1)[0] for line in out.read_text().splitlines()}
    assert roots == ({"d1/x", "d2/x"} if root == "label" else {"d1/x.trace", "d2/x.trace"})
    # The same file twice: told apart by order.
    rc, err = run_main("merge", "--label-root", root, str(a), str(a), "-o", str(out))
    assert rc == 0, err
    roots = {line.split(";", 1)[0] for line in out.read_text().splitlines()}
    assert roots == ({"x", "x#2"} if root == "label" else {"x.trace", "x.trace#2"})


def test_distinct_names() -> None:
    assert distinct_names(["a/b/x.t", "c/b/x.t", "y.t"]) == ["a/b/x.t", "c/b/x.t", "y.t"]
    assert distinct_names(["/h1/p.trace", "/h2/p.trace"]) == ["h1/p.trace", "h2/p.trace"]
    assert distinct_names(["p", "p", "q"]) == ["p", "p#2", "q"]
    assert distinct_names(["-"]) == ["-"]


# -- gzip on standard input ----------------------------------------------------------


@pytest.mark.parametrize("src", [PERF_PID_TID, DATA / "collapse" / "trace-one-bad-line.trace"], ids=["perf", "trace"])
def test_merge_guesses_the_format_of_gzip_on_stdin(tmp_path: Path, src: Path) -> None:
    import gzip
    import subprocess
    import sys

    data = src.read_bytes()
    raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    want = tmp_path / "want.trace"
    assert run_main("merge", str(src), "-o", str(want))[0] == 0
    for stdin in (gzip.compress(raw), raw):
        r = subprocess.run([sys.executable, "-m", "flamed", "merge", "-"], input=stdin, capture_output=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        assert r.stdout == want.read_bytes()
