"""Differential profiles: difffolded semantics, normalization, colors, table, CLI."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from flamed.cli import main
from flamed.diff import changes, diff_profiles, format_table
from flamed.model import Profile
from svgparse import box_paths, parse_svg


def _pair() -> tuple[Profile, Profile]:
    before = Profile()
    before.add(("main", "parse", "lex"), 10)
    before.add(("main", "parse"), 5)
    before.add(("main", "gone"), 3)
    after = Profile()
    after.add(("main", "parse", "lex"), 20)
    after.add(("main", "parse"), 2)
    after.add(("main", "new"), 4)
    return before, after


def test_pairs_and_normalize_like_difffolded() -> None:
    b, a = _pair()
    d = diff_profiles(b, a)
    assert d.pairs == {("main", "parse", "lex"): (10, 20), ("main", "parse"): (5, 2), ("main", "gone"): (3, 0),
                       ("main", "new"): (0, 4)}
    n = diff_profiles(b, a, normalize=True)  # 18 -> 26: int(count * 26 / 18), as difffolded.pl -n
    assert n.pairs[("main", "parse", "lex")] == (14, 20)
    assert n.pairs[("main", "parse")] == (7, 2)
    assert n.pairs[("main", "gone")] == (4, 0)


def test_changes_rank_by_self_delta() -> None:
    d = diff_profiles(*_pair())
    ch = changes(d)
    assert [(c.function, c.self_delta) for c in ch[:4]] == [("lex", 10), ("new", 4), ("parse", -3), ("gone", -3)]
    parse = next(c for c in ch if c.function == "parse")
    assert (parse.total_before, parse.total_after, parse.total_delta) == (15, 22, 7)
    text = format_table(d, limit=2)
    assert "+10" in text and "lex" in text and "gone" not in text
    # 0 is every changed function (as top's --limit 0), never "no changes"
    every = format_table(d, limit=0)
    assert "no changes" not in every
    assert all(f" {c.function}\n" in every for c in ch if c.self_delta or c.total_delta), every


def _rgb(fill: str) -> tuple[int, int, int]:
    return int(fill[1:3], 16), int(fill[3:5], 16), int(fill[5:7], 16)


def test_diff_svg_widths_after_colors_by_delta(tmp_path: Path) -> None:
    b, a = _pair()
    bp, ap = tmp_path / "b.folded", tmp_path / "a.folded"
    bp.write_text("main;parse;lex 10\nmain;parse 5\nmain;gone 3\n")
    ap.write_text("main;parse;lex 20\nmain;parse 2\nmain;new 4\n")
    out = tmp_path / "d.svg"
    assert main(["diff", str(bp), str(ap), "-o", str(out), "--minwidth", "0"]) == 0
    _, boxes = parse_svg(out.read_bytes())
    assert box_paths(boxes) == {("all",): 26, ("all", "main"): 26, ("all", "main", "parse"): 22,
                                ("all", "main", "parse", "lex"): 20, ("all", "main", "new"): 4}
    fill = {x.name: _rgb(x.fill) for x in boxes}
    assert fill["lex"][0] == 255 and fill["lex"][1] < 100, "grew the most: deep red"
    assert fill["new"][0] == 255 and fill["new"][1] > fill["lex"][1], "grew less: paler red"
    # By default a box is colored by its own change, as flamegraph.pl: main has
    # no samples of its own, so it is white although everything under it grew.
    main_box = next(x for x in boxes if x.name == "main")
    assert main_box.title.endswith("; 0.00%)") and _rgb(main_box.fill) == (255, 255, 255)
    parse_box = next(x for x in boxes if x.name == "parse")
    assert parse_box.title.endswith(f"; {100 * -3 / 26:+.2f}%)") and _rgb(parse_box.fill)[2] == 255, "own time shrank: blue"
    # --inclusive: main: +10 (lex) - 3 (parse) + 4 (new) - 3 (gone, no box of its own) = +8
    assert main(["diff", "--inclusive", str(bp), str(ap), "-o", str(out), "--minwidth", "0"]) == 0
    _, boxes = parse_svg(out.read_bytes())
    title = next(x.title for x in boxes if x.name == "main")
    assert title.endswith(f"; {100 * 8 / 26:+.2f}%)")
    shrink = Profile()
    shrink.add(("main", "parse"), 1)
    sp = tmp_path / "s.folded"
    sp.write_text("main;parse 1\n")
    assert main(["diff", str(bp), str(sp), "-o", str(out), "--minwidth", "0"]) == 0
    _, boxes = parse_svg(out.read_bytes())
    r, g, bl = _rgb(next(x.fill for x in boxes if x.name == "parse"))
    assert bl == 255 and r < 255, "shrank: blue"


def test_diff_cli_table_and_folded(tmp_path: Path) -> None:
    bp, ap = tmp_path / "b.folded", tmp_path / "a.folded"
    bp.write_text("main;parse;lex 10\nmain;parse 5\nmain;gone 3\n")
    ap.write_text("main;parse;lex 20\nmain;parse 2\nmain;new 4\n")
    out = io.StringIO()
    table = tmp_path / "t.txt"
    assert main(["diff", str(bp), str(ap), "-o", str(table)], stdout=out) == 0
    assert table.read_text().splitlines()[2].split()[:1] == ["+10"]
    fo = tmp_path / "d.folded"
    assert main(["diff", "--format", "folded", str(bp), str(ap), "-o", str(fo)]) == 0
    assert fo.read_text() == "main;gone 3 0\nmain;new 0 4\nmain;parse 5 2\nmain;parse;lex 10 20\n"
    err = io.StringIO()
    assert main(["diff", str(bp), str(tmp_path / "missing")], stderr=err) == 1
    assert "no such file" in err.getvalue()


DIFF = Path(__file__).resolve().parents[1] / "data" / "diff"


def _fg_boxes(svg: str) -> Counter[tuple[str, tuple[int, ...]]]:
    """(title, rgb) of every box of a flamegraph.pl or flamed SVG; flamed's _[k]-style
    annotations are dropped from names, as flamegraph.pl drops them when it draws."""
    found = re.findall(r'<title>([^<]*)</title><rect [^>]*fill="([^"]*)"', svg)
    out: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for title, fill in found:
        m = re.match(r"rgb\((\d+),(\d+),(\d+)\)", fill)
        rgb = tuple(map(int, m.groups())) if m else _rgb(fill)
        out[(re.sub(r"_\[[kwij]\](?= \()", "", title), rgb)] += 1
    return out


def test_svg_draws_difffolded_output_as_flamegraph_pl_does(tmp_path: Path) -> None:
    out = tmp_path / "d.svg"
    err = io.StringIO()
    assert main(["svg", str(DIFF / "difffolded.txt"), "-o", str(out)], stderr=err) == 0
    assert err.getvalue() == ""
    ours = _fg_boxes(out.read_text())
    ref = _fg_boxes((DIFF / "flamegraph.svg").read_text())
    # Every box flamegraph.pl draws, flamed draws with the same title (samples,
    # share, change) and the same color; only the root's title differs in form.
    missing = [t for t in (ref - ours).elements() if not t[0].startswith("all (")]
    assert missing == []
    # Widths are AFTER's: the root is AFTER's total, and no name ends in a count.
    after_total = sum(int(ln.rsplit(" ", 1)[1]) for ln in (DIFF / "after.folded").read_text().splitlines())
    root = next(t for t, _ in ours if t.startswith("all ("))
    assert root.startswith(f"all ({after_total:,} ")
    assert not [t for t, _ in ours if re.search(r" \d{4,} \(", t)], "BEFORE count glued onto a name"


def test_a_malformed_line_does_not_make_difffolded_output_folded(tmp_path: Path) -> None:
    """A line of real difffolded.pl output spoiled (a negative count, a stray
    message) is skipped and reported: the file is still drawn as differential,
    as without it, instead of as folded text with every BEFORE count glued
    onto a leaf (``cc1 7007007``) for the sake of one line."""
    lines = (DIFF / "difffolded.txt").read_text().splitlines(keepends=True)
    spoiled = tmp_path / "spoiled.txt"
    spoiled.write_text("".join(lines[:40]) + "cc1;main 3 -1\n" + "".join(lines[40:]) + "warning: something\n")
    out, ref = tmp_path / "spoiled.svg", tmp_path / "ref.svg"
    err = io.StringIO()
    assert main(["svg", str(spoiled), "-o", str(out)], stderr=err) == 0
    assert "skipped 2 malformed lines" in err.getvalue() and "BEFORE AFTER" in err.getvalue(), err.getvalue()
    assert main(["svg", str(DIFF / "difffolded.txt"), "-o", str(ref)]) == 0
    assert out.read_bytes() == ref.read_bytes()
    # A plain folded line among them still makes it folded, and other readers refuse the spoiled file.
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("".join(lines) + "cc1;main 3\n")
    assert main(["svg", str(mixed), "-o", str(out)], stderr=io.StringIO()) == 0
    assert re.search(r"<title>[^<]* \d+ \(", out.read_text())  # counts glued: read as folded
    err = io.StringIO()
    assert main(["top", str(spoiled)], stdout=io.StringIO(), stderr=err) == 1 and "differential" in err.getvalue()


def test_svg_reads_difffolded_output_from_a_pipe(tmp_path: Path) -> None:
    data = (DIFF / "difffolded.txt").read_bytes()
    p = subprocess.run(
        [sys.executable, "-m", "flamed", "svg"], input=data, capture_output=True, timeout=60, check=False
    )
    assert p.returncode == 0, p.stderr
    direct = tmp_path / "d.svg"
    assert main(["svg", str(DIFF / "difffolded.txt"), "-o", str(direct)]) == 0
    assert p.stdout == direct.read_bytes()


def test_diff_folded_output_is_difffolded_pl_s(tmp_path: Path) -> None:
    out = tmp_path / "d.txt"
    assert main(["diff", "--format", "folded", str(DIFF / "before.folded"), str(DIFF / "after.folded"), "-o", str(out)]) == 0
    assert sorted(out.read_text().splitlines()) == sorted((DIFF / "difffolded.txt").read_text().splitlines())


def test_diff_normalized_folded_output_is_difffolded_pl_n_s(tmp_path: Path) -> None:
    # difffolded.pl -n truncates int(count * total2 / total1); rounding would write
    # 17 of these BEFORE counts one higher.
    out = tmp_path / "d.txt"
    args = ["diff", "--normalize", "--format", "folded", str(DIFF / "before.folded"), str(DIFF / "after.folded")]
    assert main([*args, "-o", str(out)]) == 0
    assert sorted(out.read_text().splitlines()) == sorted((DIFF / "difffolded-n.txt").read_text().splitlines())


def test_normalize_truncates_and_leaves_equal_totals_alone() -> None:
    before, after = Profile(), Profile()
    before.add(("a",), 2)
    before.add(("b",), 1)
    after.add(("a",), 5)
    # 2 * 5 / 3 = 3.33 and 1 * 5 / 3 = 1.67: both truncated.
    assert diff_profiles(before, after, normalize=True).pairs == {("a",): (3, 5), ("b",): (1, 0)}
    same = Profile()
    same.add(("a",), 3)
    assert diff_profiles(before, same, normalize=True).pairs == {("a",): (2, 3), ("b",): (1, 0)}


def test_differential_input_is_refused_where_a_profile_is_read(tmp_path: Path) -> None:
    for cmd in (["collapse"], ["top"], ["export", "--format", "folded"], ["merge"]):
        err = io.StringIO()
        code = main([*cmd, str(DIFF / "difffolded.txt"), "-o", str(tmp_path / "x")], stderr=err)
        assert code != 0, cmd
        assert "BEFORE AFTER" in err.getvalue() and "flamed svg" in err.getvalue(), (cmd, err.getvalue())


def test_root_change_never_reads_minus_zero(tmp_path: Path) -> None:
    bp, ap = tmp_path / "b.folded", tmp_path / "a.folded"
    bp.write_text("main;x 1000001\n")
    ap.write_text("main;x 1000000\n")
    out = tmp_path / "d.svg"
    for extra in ([], ["--inclusive"]):
        assert main(["diff", *extra, str(bp), str(ap), "-o", str(out)]) == 0
        titles = re.findall(r"<title>([^<]*)</title>", out.read_text())
        assert titles and not [t for t in titles if "-0.00%" in t], titles
        assert titles[0].startswith("all (") and titles[0].endswith("; 0.00%)")


def test_table_of_an_empty_after_gives_shares_of_before(tmp_path: Path) -> None:
    """AFTER empty (a capture that saw nothing): the changes are shares of
    BEFORE's total, so what vanished reads -100% in all, not -500% (a share
    of 1 sample, the stand-in for a zero total)."""
    before, after = tmp_path / "before.folded", tmp_path / "after.folded"
    before.write_text("main;lex 5\nmain;parse 15\n")
    after.write_text("")
    out = tmp_path / "table.txt"
    err = io.StringIO()
    assert main(["diff", "--format", "table", str(before), str(after), "-o", str(out)], stderr=err) == 0, err.getvalue()
    lines = out.read_text().splitlines()
    assert lines[0] == "before: 20 samples, after: 0 samples (after is empty: Δ% of before)"
    rows = {ln.split()[-1]: ln.split() for ln in lines[2:]}
    assert rows["parse"][:2] == ["-15", "-75.00%"] and rows["lex"][:2] == ["-5", "-25.00%"]
    assert rows["main"][4:6] == ["-20", "-100.00%"]


def test_fractional_weights_add_up_in_the_table(tmp_path: Path) -> None:
    """Weights with decimals (normalized, --factor, seconds): a function whose
    weight did not change is not listed with a change of 1e-16, and totals
    read 0.7 and 0.3, not 0.6999999999999998 and 0.30000000000000004."""
    before, after = tmp_path / "before.folded", tmp_path / "after.folded"
    before.write_text("a;b 0.1\na;c 0.2\n")
    after.write_text("a;b 0.7\n")
    out = tmp_path / "table.txt"
    assert main(["diff", "--normalize", "--format", "table", str(before), str(after), "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "before: 0.7 samples (normalized), after: 0.7 samples"
    assert sorted(ln.split()[-1] for ln in lines[2:]) == ["b", "c"]  # not a, whose total is 0.7 in both
    top = tmp_path / "top.txt"
    assert main(["top", str(before), "-o", str(top)]) == 0
    text = top.read_text().splitlines()
    assert text[-1] == "total weight 0.3 in 2 distinct stacks"
    assert text[3].split() == ["0", "0.00", "0.3", "100.00", "a"]
