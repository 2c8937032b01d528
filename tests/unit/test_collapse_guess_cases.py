"""Inputs whose format guess or fields went wrong: perf script without time/event fields,
traces with a bad line, very long folded lines, stackvis's collapsed output."""

from __future__ import annotations

from pathlib import Path

import pytest

from flamed.collapse import guess
from flamed.collapse.base import CollapseOptions
from flamed.collapse.driver import collapse, read_head
from flamed.collapse.perf import parse_header

DATA = Path(__file__).resolve().parent.parent / "data"


def folded(path: Path | str, jobs: int = 1, chunk: int | None = None, **kw: object) -> dict[str, int]:
    extra = {"chunk_bytes": chunk} if chunk else {}
    res = collapse([str(path)], options=CollapseOptions(**kw), jobs=jobs, **extra)  # type: ignore[arg-type]
    return {";".join(k): int(v) for k, v in res.profile.stacks.items()}


def guessed(path: Path) -> str:
    with open(path, "rb") as f:
        return guess(read_head(f)).name


# -- perf script -F comm,tid,period,ip,sym (recorded with perf 6.1 from a two-thread C program) --

@pytest.mark.parametrize("name", ["fields-comm-tid-period.txt", "fields-comm-tid-period-nog.txt"])
def test_perf_without_time_and_event_is_guessed(name: str) -> None:
    assert guessed(DATA / "perf" / name) == "perf"


def test_perf_comm_tid_period_reads_tid_and_period() -> None:
    # 40 samples of perf record -F 999 (cpu-clock, period 1001001 ns each).
    out = folded(DATA / "perf" / "fields-comm-tid-period.txt", include_tid=True)
    assert sum(out.values()) == 40 * 1001001
    assert {k.split(";")[0] for k in out} == {"worker 0-?/16989", "worker 1-?/16990"}
    assert out["worker 1-?/16990;start_thread;worker;recurse;recurse;recurse"] == 3 * 1001001
    # --weight samples counts them.
    assert sum(folded(DATA / "perf" / "fields-comm-tid-period.txt", weight="samples").values()) == 40


def test_perf_without_g_comm_tid_period_one_line_per_sample() -> None:
    path = DATA / "perf" / "fields-comm-tid-period-nog.txt"
    out = folded(path, include_tid=True)
    assert out == {"worker 0-?/16989;recurse": 19 * 1001001, "worker 1-?/16990;recurse": 21 * 1001001}
    assert folded(path, jobs=2, chunk=256, include_tid=True) == out


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        # -F comm,tid,period: perf right-aligns the period in 10 columns after the tid
        ("worker 0  8006    1001001 ", ("worker 0", None, 8006, "", 1001001)),
        ("worker 0  8006 11948948937 ", ("worker 0", None, 8006, "", 11948948937)),
        ("worker 0 16987/16989    1001001 ", ("worker 0", 16987, 16989, "", 1001001)),
        ("worker 0 16989 [001]    1001001 ", ("worker 0", None, 16989, "", 1001001)),
        # -F comm,tid: a comm ending in a digit keeps it
        ("worker 0  8006 ", ("worker 0", None, 8006, "", 0)),
        ("worker 0 16989 ", ("worker 0", None, 16989, "", 0)),
    ],
)
def test_time_less_header_period(header: str, expected: tuple[object, ...]) -> None:
    h = parse_header(header)
    assert h is not None and h[:5] == expected


# -- a timestamped trace with a bad line stays a trace -------------------------

BAD_TRACE = DATA / "collapse" / "trace-one-bad-line.trace"  # 40 samples of a real capture, line 20 cut short


def test_trace_with_one_bad_line_is_guessed_as_trace() -> None:
    assert guessed(BAD_TRACE) == "trace"


def test_trace_with_many_bad_lines_is_not_guessed_as_trace(tmp_path: Path) -> None:
    lines = BAD_TRACE.read_text().splitlines()
    for i in range(0, len(lines), 4):
        lines[i] = lines[i].partition(" ")[2]  # every fourth line loses its timestamp: folded-ish text
    p = tmp_path / "x.txt"
    p.write_text("\n".join(lines) + "\n")
    assert guessed(p) != "trace"


# -- a 1 MB folded line (a deep recursion) is still folded -----------------------

def test_one_megabyte_folded_line_is_guessed(tmp_path: Path) -> None:
    from flamed.cli import main

    # The deepest stack of a real capture, its frames repeated as a deep recursion would.
    real = (DATA / "collapse" / "perf-cpp.folded").read_text().splitlines()
    stack, _, _ = max(real, key=lambda ln: ln.count(";")).rpartition(" ")
    frames = stack.split(";")
    deep = frames[:1] + frames[1:] * (1_100_000 // len(stack) + 1)
    line = ";".join(deep) + " 3"
    assert len(line) > 1 << 20
    p = tmp_path / "deep.folded"
    p.write_text(line + "\n" + real[0] + "\n")
    assert guessed(p) == "folded"
    out = tmp_path / "out.folded"
    assert main(["collapse", str(p), "-o", str(out)]) == 0
    got = dict(ln.rsplit(" ", 1) for ln in out.read_text().splitlines())
    assert got[";".join(deep)] == "3"


# -- node-stackvis's collapsed output: frames joined by "," ---------------------

def test_stackvis_collapsed_frames_are_split_on_commas() -> None:
    # stackvis's output-collapsed writes frames.join(',') + ' ' + count, root first.
    path = DATA / "collapse" / "stackvis-collapsed.txt"
    assert guessed(path) == "stackvis"
    assert folded(path) == {
        "genunix`syscall_mstate;genunix`gethrtime_unscaled;unix`tsc_gethrtimeunscaled": 3,
        "node`main;node`uv_run;node`uv__io_poll": 12,
        "node`main;node`uv_run": 4,
    }


def test_folded_with_commas_in_frames_stays_folded(tmp_path: Path) -> None:
    p = tmp_path / "x.folded"
    p.write_text("main;std::map<int, int>::find 3\nmain 1\n")
    assert guessed(p) == "folded"
