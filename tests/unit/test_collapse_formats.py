"""bcc, py-spy, trace and folded readers, and format guessing, on real captures and edge cases."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest

from flamed.cli import main
from flamed.collapse import guess
from flamed.collapse.base import CollapseOptions
from flamed.collapse.driver import collapse
from flamed.collapse.trace import format_timestamp, parse_timestamp, parse_trace_line
from flamed.errors import InputError
from flamed.model import EMPTY_STACK_FRAME
from support import DATA


def texts(path: Path | str, **kw: object) -> dict[str, object]:
    p = collapse([str(path)], options=CollapseOptions(**kw), jobs=1).profile  # type: ignore[arg-type]
    return {";".join(k): v for k, v in p.stacks.items()}


@pytest.mark.parametrize(
    ("path", "fmt"),
    [
        ("perf/c-default.txt.gz", "perf"),
        ("perf/c-minimal.txt.gz", "perf"),
        ("perf/c-noperiod.txt.gz", "perf"),
        ("perf/tracepoint.txt.gz", "perf"),
        ("perf/hostile.txt", "perf"),
        ("bcc/profile-multiline.txt.gz", "bcc"),
        ("bcc/profile-multiline-delimited.txt.gz", "bcc"),
        ("bcc/profile-folded-annotated.txt.gz", "bcc"),
        ("pyspy/work-raw.txt", "pyspy"),
        ("pyspy/work-raw-threads.txt", "pyspy"),
    ],
)
def test_guess_real_captures(path: str, fmt: str) -> None:
    raw = (DATA / path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    assert guess(raw[:65536]).name == fmt


def test_guess_trace_folded_and_garbage() -> None:
    assert guess(b"# flamed trace: TIMESTAMP(ns) STACK COUNT\n").name == "trace"
    assert guess(b"1700000000.5 app-1/2;main;work 3\n1700000000.6 app-1/2;main 1\n").name == "trace"
    assert guess(b"main;work 3\nmain 1\n").name == "folded"
    assert guess(b"").name == "folded"
    with pytest.raises(InputError, match="cannot tell the input format"):
        guess(b"\x00\x01binary\xff\n\x02")


def test_bcc_multiline_real_capture() -> None:
    got = texts(DATA / "bcc" / "profile-multiline.txt.gz")
    assert got and all(k.startswith("python3;") for k in got)
    assert sum(got.values()) > 10  # type: ignore[arg-type]


def test_bcc_multiline_delimiter_annotates_kernel(tmp_path: Path) -> None:
    f = tmp_path / "bcc.txt"
    f.write_text(
        "Sampling at 49 Hertz of all threads by user + kernel stack... Hit Ctrl-C to end.\n\n"
        "    _raw_spin_unlock_irqrestore\n    do_syscall_64\n    --\n    write\n    main\n"
        "    -                worker 0 (4242)\n        7\n\n"
        "    b'only_user'\n    -                job;2 (17)\n        2\n\n"
        "    [Missed User Stack]\n    -                x (1)\n        1\n\n"
    )
    assert texts(f) == {
        "worker 0;main;write;do_syscall_64_[k];_raw_spin_unlock_irqrestore_[k]": 7,
        "job:2;only_user": 2,
        "x;[Missed User Stack]": 1,
    }
    assert "worker 0-4242;main;write;do_syscall_64_[k];_raw_spin_unlock_irqrestore_[k]" in texts(f, include_pid=True)


def test_bcc_folded_delimiter(tmp_path: Path) -> None:
    f = tmp_path / "bcc-f.txt"
    f.write_text("dd;main;write;-;ksys_write;vfs_write 5\ndd;main;-;do_exit_[k] 1\n")
    assert texts(f) == {"dd;main;write;ksys_write_[k];vfs_write_[k]": 5, "dd;main;do_exit_[k]": 1}


def test_pyspy_raw_real_capture() -> None:
    got = texts(DATA / "pyspy" / "work-raw.txt")
    assert any("fib (work.py:15)" in k for k in got)
    threads = texts(DATA / "pyspy" / "work-raw-threads.txt")
    assert all(k.startswith("thread (") for k in threads)


@pytest.mark.parametrize(
    ("tok", "ns"),
    [("1700000000.123456789", 1_700_000_000_123_456_789), ("1700000000.5", 1_700_000_000_500_000_000), ("42", 42), ("0.000000001", 1)],
)
def test_timestamps(tok: str, ns: int) -> None:
    assert parse_timestamp(tok) == ns


@pytest.mark.parametrize("tok", ["", "1e9", "-5", "1.", "1.1234567891", "abc", "１２"])
def test_bad_timestamps(tok: str) -> None:
    assert parse_timestamp(tok) is None


def test_timestamp_round_trip() -> None:
    for ns in (0, 1, 999_999_999, 1_700_000_000_123_456_789):
        assert parse_timestamp(format_timestamp(ns, "seconds")) == ns
        assert parse_timestamp(format_timestamp(ns)) == ns


def test_trace_lines() -> None:
    assert parse_trace_line("5 a;b 3") == (5, ("a", "b"), 3)
    assert parse_trace_line("5 a;b") == (5, ("a", "b"), 1)
    assert parse_trace_line("5 a;handle (app.py:12) 2.5") == (5, ("a", "handle (app.py:12)"), 2.5)
    assert parse_trace_line("1.5 worker 0;run 1") == (1_500_000_000, ("worker 0", "run"), 1)
    assert parse_trace_line("x a;b 1") is None
    assert parse_trace_line("5") is None
    # The count as folded text reads it: after a tab too; a negative or exponent
    # count is a malformed line (both once became part of the leaf's name, weight 1).
    assert parse_trace_line("5 a;b\t4") == (5, ("a", "b"), 4)
    assert parse_trace_line("5 a;d -3") is None
    assert parse_trace_line("5 a;b 1e3") is None
    assert parse_trace_line("5 a;lib 1.2.3") == (5, ("a", "lib 1.2.3"), 1)  # not a number: a name
    # a time past int64 ns (the year 2262) fits no output and no viewer range: malformed
    assert parse_trace_line("9223372036.854775807 a 1") == (2**63 - 1, ("a",), 1)
    assert parse_trace_line("99999999999.5 a 1") is None
    assert parse_trace_line("9999999999999999999 a 1") is None
    # only ASCII white space is taken off, as merge's line-level path does: a name
    # ending in a no-break space, U+3000 or \x1f keeps it (merge --sort and collapse
    # once wrote "leaf" for all three, and summed them)
    for end in ("\u00a0", "\u3000", "\x1f"):
        assert parse_trace_line(f"5 a;leaf{end} 3") == (5, ("a", f"leaf{end}"), 3)


def test_trace_collapse_time_range(tmp_path: Path) -> None:
    f = tmp_path / "t.trace"
    f.write_text("# flamed trace\n3.0 a;b\n1.0 a;b 2\n\n2.5 a;c 1\nnot a line\n")
    res = collapse([str(f)], jobs=1)
    assert {";".join(k): v for k, v in res.profile.stacks.items()} == {"a;b": 3, "a;c": 1}
    assert (res.profile.start_ns, res.profile.end_ns) == (1_000_000_000, 3_000_000_000)
    assert res.stats.skipped == 1 and "t.trace:6:" in res.stats.first_errors[0]


def test_folded_input_edge_cases(tmp_path: Path) -> None:
    f = tmp_path / "f.folded"
    f.write_bytes(b"a;b 1\r\na;b\t2\n\n# c\n a 1\nbad\n;; 3\n\xff\xfe;x 1\n 5\n")
    res = collapse([str(f)], jobs=1)
    got = {";".join(k): v for k, v in res.profile.stacks.items()}
    assert got["a;b"] == 3
    assert got[" a"] == 1
    assert got[";;"] == 3
    assert got[EMPTY_STACK_FRAME] == 5
    assert "\udcff\udcfe;x" in got
    assert res.stats.skipped == 1
    with pytest.raises(InputError, match=r"f.folded:6:"):
        collapse([str(f)], jobs=1, options=CollapseOptions(strict=True))


@pytest.mark.parametrize("where", ["end", "middle"])
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_bcc_multiline_stack_without_task_line_is_counted(tmp_path: Path, where: str, jobs: str) -> None:
    """Frames that no task and count line close -- the last stack cut at the end of the
    input, or one followed by a blank line -- are one malformed line, as a stack
    without a count line is; --strict fails on it."""
    text = gzip.decompress((DATA / "bcc" / "profile-multiline.txt.gz").read_bytes()).decode()
    lines = text.split("\n")
    tasks = [i for i, ln in enumerate(lines) if ln.startswith("    -   ")]
    k = tasks[-1] if where == "end" else tasks[len(tasks) // 2]
    first = k - 1
    while lines[first - 1].startswith("    "):
        first -= 1  # the first frame of that stack
    full = tmp_path / "full.txt"
    full.write_text(text)
    cut = tmp_path / "cut.txt"
    if where == "end":
        cut.write_text("\n".join(lines[:k]) + "\n")  # cut after the last stack's frames
    else:
        cut.write_text("\n".join(lines[:k] + lines[k + 2 :]))  # its task and count lines dropped
    expected = dict(texts(full))
    gone = ";".join(("python3", *reversed([ln.strip() for ln in lines[first:k]])))
    expected[gone] -= int(lines[k + 1])  # type: ignore[operator]
    if not expected[gone]:
        del expected[gone]
    out = tmp_path / "out.folded"
    err = io.StringIO()
    args = ["collapse", "--format", "bcc", "--jobs", jobs, "--chunk-size", "1024", str(cut), "-o", str(out)]
    assert main(args, stderr=err) == 0
    got = {ln.rsplit(" ", 1)[0]: int(ln.rsplit(" ", 1)[1]) for ln in out.read_text().splitlines()}
    assert got == expected
    assert f"skipped 1 malformed line (first: {cut}:{first + 1}: bcc stack without a task and count line)" in err.getvalue()
    with pytest.raises(InputError, match=f":{first + 1}: bcc stack without a task and count line"):
        collapse([str(cut)], fmt="bcc", options=CollapseOptions(strict=True), jobs=1)


@pytest.mark.parametrize("jobs, chunk", [(1, None), (2, 4096)], ids=["serial", "pool"])
def test_folded_input_beside_perf_script_is_kept(tmp_path: Path, jobs: int, chunk: int | None) -> None:
    """A folded (or py-spy) file collapsed in one run with a perf script: its stacks
    have no event, and were filed with perf's "samples without an event field",
    which the default event choice leaves out -- the whole file vanished."""
    perf = tmp_path / "perf.txt"
    perf.write_bytes(gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes()))
    folded = tmp_path / "py.folded"
    folded.write_text("main;work 7\nmain;idle 2\n" * 1000)
    extra = {"chunk_bytes": chunk} if chunk else {}
    alone = collapse([str(perf)], jobs=jobs, **extra)
    for inputs in ([perf, folded], [folded, perf]):
        res = collapse([str(p) for p in inputs], jobs=jobs, **extra)
        got = dict(res.profile.stacks)
        assert got.pop(("main", "work")) == 7000 and got.pop(("main", "idle")) == 2000
        assert got == alone.profile.stacks
        assert res.messages == alone.messages
    # --event picks among perf's events; the folded file has none and stays.
    ev = collapse([str(folded), str(perf)], jobs=jobs, options=CollapseOptions(event=alone.kept_event), **extra)
    assert ev.profile.stacks[("main", "work")] == 7000


BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("jobs, chunk", [(1, None), (2, 4096)], ids=["serial", "ranged"])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_byte_order_mark_is_not_part_of_the_first_frame(tmp_path: Path, jobs: int, chunk: int | None, gz: bool) -> None:
    """A UTF-8 byte order mark (what some editors and Windows tools write first)
    became part of the first sample's command: '\\ufeffhot' beside 'hot'."""
    text = gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes())
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_bytes(text)
    marked.write_bytes(gzip.compress(BOM + text) if gz else BOM + text)
    extra = {"chunk_bytes": chunk} if chunk else {}
    want = collapse([str(plain)], jobs=jobs, **extra).profile.stacks
    got = collapse([str(marked)], jobs=jobs, **extra).profile.stacks
    assert got == want and not any("\ufeff" in s[0] for s in got)


def test_byte_order_mark_before_folded_and_trace_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flamed.fastfolded as ff

    folded = tmp_path / "f.folded"
    folded.write_bytes(BOM + b"main;a 1\nmain;b 2\n" * 200)
    for jobs in (1, 3):
        monkeypatch.setattr(ff, "PARALLEL_MIN_BYTES", 0 if jobs > 1 else ff.PARALLEL_MIN_BYTES)
        assert ff.count_folded_file(str(folded), jobs=jobs) == {b"main;a": 200, b"main;b": 400}  # svg's path
    out = tmp_path / "top.csv"
    assert main(["top", "--csv", "-o", str(out), str(folded)]) == 0
    assert "\ufeff" not in out.read_text() and "main,0,0.00,600,100.00" in out.read_text()
    # A trace is recognised by its first line, also on stdin, where the format is guessed from a peek.
    trace = tmp_path / "t.trace"
    trace.write_bytes(BOM + b"# flamed trace\n1.5 a;b 2\n")
    merged = tmp_path / "m.trace"
    with open(trace, "rb") as f:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(f))
        assert main(["merge", "-", "-o", str(merged)]) == 0
    assert merged.read_text().splitlines()[1:] == ["1500000000 a;b 2"]
