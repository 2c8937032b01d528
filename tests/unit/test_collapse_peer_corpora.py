"""Inputs from FlameGraph's and inferno's regression corpora that ``flamed collapse`` got wrong
(issue 22): the files are vendored under tests/data/collapse/corpus/ (see its NOTICE)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from flamed.cli import main
from flamed.collapse import guess
from flamed.collapse.driver import read_head
from support import DATA

CORPUS = DATA / "collapse" / "corpus"
FLAMEGRAPH = CORPUS / "flamegraph"
INFERNO_PERF = CORPUS / "inferno" / "collapse-perf"


def run(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``flamed collapse ARGS``: exit status, folded output, stderr."""
    out = tmp_path / "out.folded"
    err = io.StringIO()
    rc = main(["collapse", "--jobs", "1", *args, "-o", str(out)], stderr=err)
    text = out.read_bytes().decode("utf-8", "surrogateescape") if out.exists() else ""
    return rc, text, err.getvalue()


def guessed(path: Path) -> str:
    with open(path, "rb") as f:
        return guess(read_head(f)).name


def folded_lines(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.strip():
            stack, _, n = line.rpartition(" ")
            out[stack] = out.get(stack, 0) + int(n)
    return out


# -- 5: perf before 3.x, "comm pid event:" headers and frames flush left -------------

def test_flush_left_old_perf_is_guessed(tmp_path: Path) -> None:
    path = FLAMEGRAPH / "perf-java-stacks-02.txt"
    assert guessed(path) == "perf"
    rc, auto, err = run(tmp_path, str(path))
    assert rc == 0, err
    rc, named, _ = run(tmp_path, "--format", "perf", str(path))
    assert rc == 0 and auto == named
    got = folded_lines(auto)
    assert sum(got.values()) == 2  # two samples, no period field
    (stack,) = got
    assert stack.startswith("java;start_thread;JavaMain;") and stack.endswith("native_write_msr_safe_[k]")


# -- 6: the default event filter: cycles:u and cycles are one event ----------------

def test_event_modifiers_are_the_same_event_by_default(tmp_path: Path) -> None:
    # inferno's single-line-stacks: perf script without -g, headers "cycles:u:" then "cycles:".
    path = INFERNO_PERF / "single-line-stacks.txt"
    rc, out, err = run(tmp_path, "--annotate", "none", str(path))
    assert rc == 0, err
    want = (INFERNO_PERF / "results" / "single-line-stacks-collapsed.txt").read_text()
    assert folded_lines(out) == folded_lines(want) == {"false;[unknown]": 1, "false;_dl_start": 1}
    assert "kept event" not in err  # nothing was dropped


def test_other_events_are_still_dropped_and_named(tmp_path: Path) -> None:
    f = tmp_path / "ev.txt"
    f.write_text(
        "a 1 1.0: 5 cycles:u: \n\t1 f (/x)\n\n"
        "b 1 1.1: 7 cycles: \n\t1 g (/x)\n\n"
        "c 1 1.2: 3 task-clock: \n\t1 h (/x)\n\n"
        "d 1 1.3: 2 sched:sched_switch: prev_comm=d\n\t1 h (/x)\n\n"
    )
    rc, out, err = run(tmp_path, str(f))
    assert rc == 0 and folded_lines(out) == {"a;f": 5, "b;g": 7}
    assert "kept event 'cycles:u', with 'cycles' (the first in the input, weight 12)" in err
    assert "task-clock (3)" in err and "sched:sched_switch (2)" in err
    # --event still names one spelling, or all of them without modifiers.
    assert folded_lines(run(tmp_path, "--event", "cycles:u", str(f))[1]) == {"a;f": 5}
    assert folded_lines(run(tmp_path, "--event", "cycles", str(f))[1]) == {"a;f": 5, "b;g": 7}


def test_event_base() -> None:
    from flamed.collapse.perf import event_base

    assert event_base("cycles:u") == event_base("cycles:uppp") == event_base("cycles") == "cycles"
    assert event_base("cpu-clock:ppp") == "cpu-clock"
    assert event_base("sched:sched_switch") == "sched:sched_switch"
    assert event_base("probe_libc:malloc") == "probe_libc:malloc"
    assert event_base("") == ""


# -- 8: an unreadable line inside a perf stack is counted, and an error under --strict --

def test_unreadable_frame_line_is_reported(tmp_path: Path) -> None:
    path = INFERNO_PERF / "weird-stack-line.txt"  # line 5: "\t          THIS_IS_A_WEIRD_LINE"
    rc, out, err = run(tmp_path, str(path))
    assert rc == 0, err
    assert folded_lines(out) == {"inline-counter;main": 250000, "inline-counter;[no frames]": 250000}
    assert "skipped 1 malformed line" in err and "weird-stack-line.txt:5: unreadable perf script frame line" in err
    rc, _, err = run(tmp_path, "--strict", str(path))
    assert rc == 1 and "weird-stack-line.txt:5: unreadable perf script frame line" in err


def test_unreadable_frame_line_counted_every_time(tmp_path: Path) -> None:
    # The same block twice: the second is not served from the frame-block cache unreported.
    # srcline lines ("file.c:12", "??:0") and blank-looking lines are not errors.
    block = ("x 1 1.0: 1 cpu-clock: \n\t 401b97 main+0x1f (/bin/x)\n  x.c:12\n  ??:0\n"
             "\t@@GARBAGE@@\n\t 401b00 _start (/bin/x)\n\n")
    f = tmp_path / "p.txt"
    f.write_text(block * 2)
    rc, out, err = run(tmp_path, "--format", "perf", str(f))
    assert rc == 0 and folded_lines(out) == {"x;_start;main": 2}
    assert "skipped 2 malformed lines (first: " in err and "p.txt:5: unreadable" in err
    from flamed.collapse import get
    from flamed.collapse.base import CollapseOptions
    from flamed.folded import ReadStats

    stats = ReadStats()
    with open(f, "rb") as fh:
        samples = list(get("perf").samples(fh, CollapseOptions(), source="p.txt", stats=stats))
    assert len(samples) == 2 and stats.skipped == 2


# -- 7: macOS `sample` reports were guessed as perf (one bogus stack, exit 0) --------

INFERNO_SAMPLE = CORPUS / "inferno" / "collapse-sample"


def test_macos_sample_is_guessed_and_matches_inferno(tmp_path: Path) -> None:
    path = INFERNO_SAMPLE / "sample.txt"
    assert guessed(path) == "sample"
    rc, out, err = run(tmp_path, str(path))
    assert rc == 0 and not err, err
    got = folded_lines(out)
    want = folded_lines((INFERNO_SAMPLE / "results" / "sample-default.txt").read_text())
    assert got.keys() == want.keys()
    # Two leaves of these stacks fold to one stack (File::open_c called from two offsets,
    # 7 + 5 + 2 and 3 + 3 + 2 samples): flamed adds them up, inferno keeps the last count.
    added = {k for k in got if k.startswith(("Thread_15758535;", "Thread_15758553;"))
             and k.endswith("ignore::dir::create_gitignore;rg`ignore::gitignore::GitignoreBuilder::add;"
                            "rg`std::fs::OpenOptions::_open;rg`std::sys::unix::fs::File::open;"
                            "rg`std::sys::unix::fs::File::open_c;rg`std::sys::unix::cvt_r;libsystem_kernel`__open")}
    assert {k: (got[k], want[k]) for k in added} == {
        min(added): (14, 2),
        max(added): (8, 2),
    }
    assert {k: v for k, v in got.items() if k not in added} == {k: v for k, v in want.items() if k not in added}


def test_macos_sample_reports_in_chunks(tmp_path: Path) -> None:
    from flamed.collapse.base import CollapseOptions
    from flamed.collapse.driver import collapse

    one = (INFERNO_SAMPLE / "sample.txt").read_bytes()
    two = tmp_path / "two.txt"
    two.write_bytes(one + one)  # two reports: cut before the second "Call graph:"
    a = collapse([str(INFERNO_SAMPLE / "sample.txt")], options=CollapseOptions(), jobs=1).profile.stacks
    b = collapse([str(two)], options=CollapseOptions(), jobs=2, chunk_bytes=4096).profile.stacks
    assert b == {k: 2 * v for k, v in a.items()}


@pytest.mark.parametrize(
    ("name", "line", "why"),
    [
        ("bad-stack-line.txt", 22, "call graph line without a function"),
        ("invalid-samples-field.txt", 22, "invalid sample count"),
        ("no-four-spaces.txt", 22, "not indented by 4 spaces"),
        ("odd-indentation.txt", 22, "odd indentation"),
        ("skipped-indentation.txt", 23, "skips an indentation level"),
        ("stack-line-only-indent-chars.txt", 22, "only indentation"),
        ("end-before-call-graph-end.txt", 34, "input ended inside the call graph"),
    ],
)
def test_macos_sample_malformed_lines(tmp_path: Path, name: str, line: int, why: str) -> None:
    # inferno's error cases: each a malformed line, counted (or an error under --strict).
    path = INFERNO_SAMPLE / name
    assert guessed(path) == "sample"
    rc, _, err = run(tmp_path, str(path))
    assert rc == 0 and "malformed line" in err and f"{name}:{line}: " in err and why in err, err
    rc, _, err = run(tmp_path, "--strict", str(path))
    assert rc == 1 and f"{name}:{line}: " in err and why in err, err


def test_unknown_format_is_refused_with_the_formats_tried(tmp_path: Path) -> None:
    # A sample report cut before its call graph is nothing flamed reads: an error, not a guess.
    rc, out, err = run(tmp_path, str(INFERNO_SAMPLE / "end-before-call-graph-start.txt"))
    assert rc == 1 and not out
    assert "cannot tell the input format (tried " in err and "sample" in err and "--format" in err
    rc, _, err = run(tmp_path, "--format", "sample", "--strict", str(INFERNO_SAMPLE / "end-before-call-graph-start.txt"))
    assert rc == 1 and "no 'Call graph:' section" in err
