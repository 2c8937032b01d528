"""merge, top and tree end to end on real captures."""

from __future__ import annotations

import csv
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flamed.cli import main
from flamed.collapse.trace import parse_trace_line
from flamed.merge import FRESH_ID_BASE
from flamed.model import parse_task_frame
from support import DATA, golden

pytestmark = pytest.mark.concurrent


def cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    return main(list(args), stderr=err), err.getvalue()


def folded_dict(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text(encoding="utf-8", errors="surrogateescape").splitlines():
        k, _, v = line.rpartition(" ")
        out[k] = out.get(k, 0) + int(v)
    return out


def test_merge_real_perf_captures_to_trace(tmp_path: Path) -> None:
    # Two real perf captures of the same program: the same pids/tids can occur in both
    # (the second is the first, recorded with -F pid,tid), so remapping must kick in.
    a = DATA / "perf" / "c-pid-tid.txt.gz"
    b = DATA / "perf" / "c-noperiod.txt.gz"
    trace = tmp_path / "all.trace"
    rc, err = cli("merge", str(a), str(b), "--label-root", "label", "-o", str(trace))
    assert rc == 0, err
    assert "remapped" in err
    lines = trace.read_text().splitlines()
    assert lines[0].startswith("# flamed trace")
    recs = [parse_trace_line(x) for x in lines[1:]]
    assert all(r is not None for r in recs)
    times = [r[0] for r in recs if r]
    assert times == sorted(times)
    n_a = gzip.decompress(a.read_bytes()).count(b"cpu-clock")
    n_b = gzip.decompress(b.read_bytes()).count(b"\n\n")
    assert len(recs) == n_a + n_b
    roots = {r[1][0] for r in recs if r}
    assert roots == {"c-pid-tid", "c-noperiod"}
    # Aggregating the merged trace equals collapsing each capture (with the label root):
    # with --tid for the first, whose ids are kept; the second's colliding ids are fresh.
    folded = tmp_path / "all.folded"
    assert cli("collapse", str(trace), "-o", str(folded))[0] == 0
    got = folded_dict(folded)
    first = tmp_path / "first.folded"
    assert cli("collapse", "--jobs", "1", "--tid", str(a), "-o", str(first))[0] == 0
    assert {k: v for k, v in got.items() if k.startswith("c-pid-tid;")} == {f"c-pid-tid;{k}": v for k, v in folded_dict(first).items()}
    assert all(parse_task_frame(k.split(";")[1]).tid is not None for k in got)
    per: dict[str, int] = {}
    for src, label in ((a, "c-pid-tid"), (b, "c-noperiod")):
        f = tmp_path / f"{label}.folded"
        assert cli("collapse", "--jobs", "1", str(src), "-o", str(f))[0] == 0
        for k, v in folded_dict(f).items():
            per[f"{label};{k}"] = per.get(f"{label};{k}", 0) + v
    commands: dict[str, int] = {}
    for k, v in got.items():
        label, task, rest = k.split(";", 2)
        key = f"{label};{parse_task_frame(task).comm};{rest}"
        commands[key] = commands.get(key, 0) + v
    assert commands == per
    # --from/--to keeps a window, timestamps untouched.
    lo, hi = times[len(times) // 4], times[len(times) // 2]
    win = tmp_path / "win.trace"
    assert cli("merge", str(trace), "--from", str(lo), "--to", str(hi), "-o", str(win))[0] == 0
    wtimes = [int(x.split(" ", 1)[0]) for x in win.read_text().splitlines()[1:]]
    assert wtimes and all(lo <= t < hi for t in wtimes) and wtimes == [t for t in times if lo <= t < hi]


def test_merge_pid_labels_remap_real_tids(tmp_path: Path) -> None:
    a = DATA / "perf" / "c-pid-tid.txt.gz"
    out = tmp_path / "twice.trace"
    rc, err = cli("merge", str(a), str(a), "--label-root", "pid", "-o", str(out))
    assert rc == 0, err
    roots = {x.split(" ", 2)[1].split(";", 1)[0] for x in out.read_text().splitlines()[1:]}
    # The same capture twice: every pid of the second copy is fresh.
    assert any(r.startswith(f"pid-{FRESH_ID_BASE}") or r.startswith("pid-1000000") for r in roots)
    assert any(not r.startswith("pid-1000000") for r in roots)


def test_unsorted_trace_reported_then_sorted(tmp_path: Path) -> None:
    a = DATA / "perf" / "dd.txt.gz"
    t = tmp_path / "dd.trace"
    assert cli("merge", str(a), "-o", str(t))[0] == 0
    lines = t.read_text().splitlines()
    shuffled = tmp_path / "shuffled.trace"
    shuffled.write_text("\n".join([lines[0]] + lines[1:][::-1]) + "\n")
    r = subprocess.run([sys.executable, "-m", "flamed", "merge", str(shuffled), str(t)], capture_output=True, timeout=60, check=False)
    assert r.returncode == 1 and b"shuffled.trace:3: timestamps go backwards" in r.stderr
    fixed = tmp_path / "fixed.trace"
    assert cli("merge", "--sort", "--sort-run", "50", "--keep-ids", str(shuffled), "-o", str(fixed))[0] == 0
    assert sorted(fixed.read_text().splitlines()[1:], key=lambda x: int(x.split()[0])) == fixed.read_text().splitlines()[1:]
    assert sorted(fixed.read_text().splitlines()[1:]) == sorted(lines[1:])


def test_top_on_real_recursive_python(tmp_path: Path) -> None:
    out = tmp_path / "top.csv"
    rc, err = cli("top", str(DATA / "pyspy" / "work-raw.txt"), "--csv", "--limit", "0", "--sort", "total", "-o", str(out))
    assert rc == 0, err
    rows = list(csv.DictReader(out.read_text().splitlines()))
    by = {r["function"]: r for r in rows}
    fib = [r for name, r in by.items() if name.startswith("fib (")]
    assert fib and all(float(r["total_pct"]) <= 100.0 for r in rows)
    assert float(by["<module> (work.py:26)"]["total_pct"]) == 100.0
    assert abs(sum(float(r["self_pct"]) for r in rows) - 100.0) < 0.1
    table = tmp_path / "top.txt"
    assert cli("top", str(DATA / "perf" / "rust.txt.gz"), "--limit", "5", "-o", str(table))[0] == 0
    text = table.read_text().splitlines()
    assert text[0].split() == ["SELF", "SELF%", "TOTAL", "TOTAL%", "FUNCTION"]
    assert "<[u8: 32] as hot::Hot>::churn" in text[1]
    golden(DATA / "top" / "rust-top5.txt", table.read_bytes())


def test_tree_json_on_real_capture(tmp_path: Path) -> None:
    out = tmp_path / "tree.json"
    assert cli("tree", str(DATA / "perf" / "cpp.txt.gz"), "-o", str(out))[0] == 0
    tree = json.loads(out.read_text())
    golden(DATA / "tree" / "cpp.json", out.read_bytes())
    folded = tmp_path / "cpp.folded"
    assert cli("collapse", str(DATA / "perf" / "cpp.txt.gz"), "-o", str(folded))[0] == 0
    assert tree["value"] == sum(folded_dict(folded).values())
    # Every root-to-leaf path whose node keeps weight of its own is a folded stack.
    paths: dict[str, int] = {}
    todo = [(c, c["name"]) for c in tree["children"]]
    while todo:
        node, path = todo.pop()
        own = node["value"] - sum(c["value"] for c in node["children"])
        if own:
            paths[path] = own
        todo.extend((c, path + ";" + c["name"]) for c in node["children"])
    assert paths == folded_dict(folded)


def test_text_tables_show_terminal_controls_escaped(tmp_path: Path) -> None:
    """Frame names are any process's: a name carrying an escape sequence
    (retitle the terminal, clear the screen), a BEL, a C1 CSI, a right-to-left
    override or a byte that is not UTF-8 is shown as \\xNN / \\uNNNN in top's
    and diff's tables, never written for the terminal to act on; CSV and
    folded keep the bytes."""
    hostile = b"app;\x1b]0;owned\x07name\x1b[2J;c1\xc2\x9b31m;rtl\xe2\x80\xaecod;bad\xff 5\napp;plain 2\n"
    before, after = tmp_path / "before.folded", tmp_path / "after.folded"
    before.write_bytes(b"app;plain 7\n")
    after.write_bytes(hostile)
    table = tmp_path / "top.txt"
    assert cli("top", str(after), "-o", str(table))[0] == 0
    diff = tmp_path / "diff.txt"
    assert cli("diff", "--format", "table", str(before), str(after), "-o", str(diff))[0] == 0
    for out in (table, diff):
        raw = out.read_bytes()
        assert not any(b < 0x20 and b != 0x0A or b == 0x7F for b in raw), raw
        text = raw.decode("utf-8")  # strict: no stray byte either
        assert not any(0x80 <= ord(c) <= 0x9F or c in "\u202e" for c in text), text
        assert "owned\\x07name\\x1b[2J" in text and "\\x1b]0" in text
        assert "c1\\x9b31m" in text and "rtl\\u202ecod" in text and "bad\\xff" in text
    csv_out = tmp_path / "top.csv"
    assert cli("top", "--csv", str(after), "-o", str(csv_out))[0] == 0
    assert b"owned\x07name\x1b[2J" in csv_out.read_bytes() and b"bad\xff" in csv_out.read_bytes()



def test_top_negative_limit_is_a_usage_error(tmp_path: Path) -> None:
    """-n -5 listed every function (as -n 0 does); it is refused as diff's --limit is."""
    src = tmp_path / "in.folded"
    src.write_text("a;b 3\na;c 2\n")
    rc, err = cli("top", "-n", "-5", str(src), "-o", str(tmp_path / "top.txt"))
    assert rc == 2 and "--limit must not be negative" in err and not (tmp_path / "top.txt").exists()
