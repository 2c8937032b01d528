"""Inputs from FlameGraph's and inferno's regression corpora that ``flamed collapse`` got wrong
(issue 22): the files are vendored under tests/data/collapse/corpus/ (see its NOTICE)."""

from __future__ import annotations

import io
from pathlib import Path

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
