"""SVG flame graphs: structure parsed back from real profiles, options, escaping, colors."""

from __future__ import annotations

import gzip
import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import DATA, golden
from flamed.cli import main
from flamed.fastfolded import count_folded, profile_from_counts
from flamed.folded import ReadStats, read_folded
from flamed.layout import chart_frames, flame_frames, table_from_keyed, table_from_profile
from flamed.model import Profile
from flamed.outputs import choose
from flamed.outputs.base import OutputOptions
from flamed.outputs.svg import XPAD, parse_minwidth, render_profile
from flamed.palette import read_palette_file
from svgparse import NS, box_paths, expected_paths, parse_svg

BCC_FOLDED = DATA / "bcc" / "profile-folded.txt.gz"


def real_profile() -> Profile:
    with gzip.open(BCC_FOLDED, "rb") as f:
        return read_folded(f)


def render(profile: Profile, **kw: object) -> bytes:
    buf = io.BytesIO()
    render_profile(profile, buf, OutputOptions(**kw))  # type: ignore[arg-type]
    return buf.getvalue()


def test_real_profile_every_frame_with_its_width() -> None:
    p = real_profile()
    assert len(p) > 5
    _, boxes = parse_svg(render(p, minwidth=0))
    assert box_paths(boxes) == expected_paths(p)


def test_minwidth_prunes_exactly_the_narrow_frames() -> None:
    p = real_profile()
    minwidth_px = 7.0  # one sample of this profile is 6 px wide
    _, boxes = parse_svg(render(p, minwidth=minwidth_px))
    threshold = minwidth_px * p.total() / (1200 - 2 * XPAD)
    exp = expected_paths(p, threshold)
    assert box_paths(boxes) == exp
    assert len(exp) < len(expected_paths(p)), "the test profile must have frames to prune"


def test_synthetic_widths_with_shared_prefixes_and_tricky_sort_order() -> None:
    # ' ' and '.' sort before ';' in plain text: a naive text sort would split frame 'b'.
    p = Profile()
    p.add(("a", "b"), 3)
    p.add(("a", "b c"), 5)
    p.add(("a", "b", "d"), 7)
    p.add(("a", "b.x", "d"), 1)
    p.add(("z",), 2)
    _, boxes = parse_svg(render(p, minwidth=0))
    assert box_paths(boxes) == expected_paths(p)


def test_inverted_puts_root_on_top() -> None:
    p = real_profile()
    root, boxes = parse_svg(render(p, inverted=True, minwidth=0))
    top = min(b.y for b in boxes)
    assert [b.name for b in boxes if b.y == top] == ["all"]
    assert box_paths(boxes, inverted=True) == expected_paths(p)
    assert root.get("data-inverted") == "1"
    assert root.find(".//s:text[@id='title']", NS).text == "Icicle Graph"  # type: ignore[union-attr]


def test_flamechart_keeps_input_order() -> None:
    p = Profile()
    p.add(("main", "load"), 2)
    p.add(("main", "compute"), 5)
    p.add(("main", "load", "read"), 1)  # 'load' again later: a separate box in a chart
    _, boxes = parse_svg(render(p, flamechart=True, minwidth=0))
    row = sorted((b for b in boxes if b.name in ("load", "compute")), key=lambda b: b.x)
    assert [(b.name, b.x, b.width) for b in row] == [("load", 0, 2), ("compute", 2, 5), ("load", 7, 1)]
    # The same input as a flame graph merges 'load'.
    _, fg = parse_svg(render(p, minwidth=0))
    assert sorted(b.width for b in fg if b.name == "load") == [3]


def test_chart_frames_match_flame_frames_on_sorted_input() -> None:
    p = real_profile()
    table = table_from_profile(p)
    chart = chart_frames(sorted(p.stacks.items()), 0)
    flame = flame_frames(table, 0)
    assert sorted((b.depth, b.name, b.width) for b in chart) == sorted((b.depth, b.name, b.width) for b in flame)


def test_escaping_and_invalid_utf8_are_visible_and_well_formed() -> None:
    raw = b'a<b>&"c";f\xff\xfeo;ctl\x01x;\xe2\x82 9\nok;<script>alert(1)</script> 1\n'
    p = read_folded(io.BytesIO(raw))
    data = render(p, minwidth=0, title="t<&>", subtitle='s"')
    ET.fromstring(data)  # well-formed XML
    text = data.decode("utf-8")
    assert "<script>alert" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "f\\xff\\xfeo" in text and "ctl\\x01x" in text and "\\xe2\\x82" in text
    _, boxes = parse_svg(data)
    names = {b.name for b in boxes}
    assert 'a<b>&"c"' in names and "f\\xff\\xfeo" in names
    assert "t&lt;&amp;&gt;" in text


def test_output_is_deterministic_and_matches_golden() -> None:
    p = real_profile()
    a = render(p, palette="mixed", title="bcc profile", subtitle="tests/data/bcc/profile-folded.txt.gz")
    b = render(p.copy(dict(reversed(list(p.stacks.items())))), palette="mixed", title="bcc profile",
               subtitle="tests/data/bcc/profile-folded.txt.gz")
    assert a == b
    golden(DATA / "svg" / "bcc-mixed.svg", a)
    golden(DATA / "svg" / "bcc-inverted-hash.svg", render(p, inverted=True, hash=True, minwidth=1))


def _rgb(fill: str) -> tuple[int, int, int]:
    return int(fill[1:3], 16), int(fill[3:5], 16), int(fill[5:7], 16)


def test_mixed_palette_tells_kernel_native_python_apart() -> None:
    p = Profile()
    p.add(("python3-100/101", "_PyEval_EvalFrameDefault", "handle (app/web.py:42)", "sys_read_[k]"), 5)
    p.add(("python3-100/101", "_PyEval_EvalFrameDefault", "json_dumps (app/util.py:7)", "memcpy"), 5)
    _, boxes = parse_svg(render(p, palette="mixed", minwidth=0))
    fill = {b.name: _rgb(b.fill) for b in boxes}
    for name in ("handle (app/web.py:42)", "json_dumps (app/util.py:7)"):
        r, g, b = fill[name]
        assert g > r and g > b, f"python frame {name} should be green, got {fill[name]}"
    r, g, b = fill["sys_read_[k]"]
    assert b == 0 and r > g > 80, f"kernel frame should be orange, got {fill['sys_read_[k]']}"
    for name in ("_PyEval_EvalFrameDefault", "memcpy"):
        r, g, b = fill[name]
        assert r >= 200 and g < 140 and b < 140, f"native frame {name} should be red, got {fill[name]}"
    r, g, b = fill["python3-100/101"]
    assert abs(r - g) < 15 and abs(g - b) < 15, "task frames are grey"


def test_colors_stable_per_name_and_palette_file_shared(tmp_path: Path) -> None:
    pal = tmp_path / "colors.map"
    a = Profile()
    a.add(("main", "parse", "lex"), 4)
    b = Profile()
    b.add(("main", "render", "lex"), 9)
    _, ba = parse_svg(render(a, palette_file=str(pal), minwidth=0))
    saved = read_palette_file(str(pal))
    assert set(saved) == {"all", "main", "parse", "lex"}
    # A different palette for the second graph: names from the file keep their color.
    _, bb = parse_svg(render(b, palette="blue", palette_file=str(pal), minwidth=0))
    ca = {x.name: x.fill for x in ba}
    cb = {x.name: x.fill for x in bb}
    assert ca["lex"] == cb["lex"] and ca["main"] == cb["main"]
    assert _rgb(cb["render"])[2] > 200, "a new name gets the new palette's color"
    assert set(read_palette_file(str(pal))) == {"all", "main", "parse", "lex", "render"}


def test_title_subtitle_countname_width() -> None:
    p = real_profile()
    root, boxes = parse_svg(render(p, title="T", subtitle="S", countname="ms", width=800, minwidth=0))
    assert root.get("width") == "800"
    assert root.find(".//s:text[@id='subtitle']", NS).text == "S"  # type: ignore[union-attr]
    assert all(re.search(r" \([\d,]+ ms, [\d.]+%\)$", b.title) for b in boxes)
    fv = root.find(".//s:svg[@id='fv']", NS)
    assert fv is not None and fv.get("width") == str(800 - 2 * XPAD)
    assert box_paths(boxes) == expected_paths(p)


def test_labels_only_where_they_fit() -> None:
    p = real_profile()
    root, boxes = parse_svg(render(p, minwidth=0))
    labels = root.find(".//s:g[@id='labels']", NS)
    assert labels is not None
    texts = [t.text or "" for t in labels.findall("s:text", NS)]
    scale = (1200 - 2 * XPAD) / p.total()
    wide = [b for b in boxes if int(b.width * scale / (12 * 0.59)) >= 3]
    assert len(texts) == len(wide)
    for b, t in zip(sorted(wide, key=lambda b: (-b.y, b.x)), texts):
        assert t == b.name or (t.endswith("..") and b.name.startswith(t[:-2]))


def test_minwidth_parsing() -> None:
    assert parse_minwidth("0.5") == 0.5
    assert parse_minwidth("1%", 1020) == pytest.approx(10.0)
    with pytest.raises(Exception, match="minwidth"):
        parse_minwidth("wide")


def test_registry_picks_svg_by_extension() -> None:
    assert choose(None, "out.svg").name == "svg"


def test_empty_input_renders_a_valid_svg_and_warns(tmp_path: Path) -> None:
    src = tmp_path / "empty.folded"
    src.write_bytes(b"# nothing\n")
    out = tmp_path / "o.svg"
    err = io.StringIO()
    assert main(["svg", str(src), "-o", str(out)], stderr=err) == 0
    root = ET.fromstring(out.read_bytes())
    assert root.find(".//s:text[@id='empty']", NS) is not None
    assert "no stacks" in err.getvalue()


def test_cli_svg_reads_gzip_counts_bad_lines_and_strict_fails(tmp_path: Path) -> None:
    src = tmp_path / "in.folded"
    src.write_bytes(b"a;b 3\nthis line has no count\na;c 2\n")
    out = tmp_path / "o.svg"
    err = io.StringIO()
    assert main(["svg", str(src), str(BCC_FOLDED), "-o", str(out), "--minwidth", "0"], stderr=err) == 0
    assert "skipped 1 malformed line" in err.getvalue()
    _, boxes = parse_svg(out.read_bytes())
    expected = real_profile()
    expected.add(("a", "b"), 3)
    expected.add(("a", "c"), 2)
    assert box_paths(boxes) == expected_paths(expected)
    err = io.StringIO()
    assert main(["svg", "--strict", str(src), "-o", str(out)], stderr=err) == 1
    assert ":2:" in err.getvalue()


def test_cli_flamechart_keeps_file_order(tmp_path: Path) -> None:
    src = tmp_path / "t.folded"
    src.write_bytes(b"m;a 1\nm;b 1\nm;a 1\n")
    out = tmp_path / "o.svg"
    assert main(["svg", "--flamechart", str(src), "-o", str(out), "--minwidth", "0"]) == 0
    _, boxes = parse_svg(out.read_bytes())
    assert [b.name for b in sorted(boxes, key=lambda b: b.x) if b.name in "ab"] == ["a", "b", "a"]


# The fast counting reader must accept and reject exactly what read_folded does.
_frame = st.text(alphabet=st.sampled_from(list("ab ;#.\t(x)_[k]0-9\r")), min_size=0, max_size=6)
_line = st.one_of(
    st.builds(lambda s, c: f"{s} {c}", _frame, st.integers(0, 10**6)),
    st.builds(lambda s, c: f"{s}  {c}", _frame, st.integers(0, 99)),
    st.builds(lambda s, c: f"{s}\t{c}", _frame, st.integers(0, 99)),
    st.builds(lambda s, c: f"{s} {c}", _frame, st.sampled_from(["1.5", "-3", "+4", "1_0", "", "9" * 25, "07"])),
    _frame,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_line, max_size=12), st.booleans())
def test_fast_counting_equals_read_folded(lines: list[str], crlf: bool) -> None:
    data = ("\r\n" if crlf else "\n").join(lines).encode()
    s1, s2 = ReadStats(), ReadStats()
    slow = read_folded(io.BytesIO(data), stats=s1)
    fast = profile_from_counts(count_folded(io.BytesIO(data), stats=s2))
    assert fast.stacks == slow.stacks
    assert (s2.records, s2.skipped) == (s1.records, s1.skipped)


def test_keyed_and_profile_tables_lay_out_alike() -> None:
    with gzip.open(BCC_FOLDED, "rb") as f:
        counts = count_folded(f)
    a = flame_frames(table_from_keyed(counts), 0)
    b = flame_frames(table_from_profile(real_profile()), 0)
    assert a == b


def test_cli_flamechart_of_real_perf_capture_is_in_time_order(tmp_path: Path) -> None:
    from flamed.collapse import get as get_collapser
    from flamed.collapse.base import CollapseOptions

    src = DATA / "perf" / "c-pid-tid.txt.gz"
    with gzip.open(src, "rb") as f:
        samples = sorted(get_collapser("perf").samples(f, CollapseOptions(), source=str(src)), key=lambda s: s.time_ns)
    out = tmp_path / "chart.svg"
    assert main(["svg", "--flamechart", str(src), "-o", str(out), "--minwidth", "0"]) == 0
    _, boxes = parse_svg(out.read_bytes())
    root = next(b for b in boxes if b.name == "all")
    assert root.weight == sum(s.weight for s in samples)  # ns: drawn in scaled units, exact in titles
    # Walking the samples in time order, each one's root frame box starts where the
    # previous samples end: the x axis is time.
    x = 0.0
    firsts = sorted((b for b in boxes if b.width and b.y == root.y - 16), key=lambda b: b.x)
    for b in firsts:
        assert b.x == x
        x += b.width
    assert x == root.width
    # One lane per thread, in the order the threads first ran, each in time order.
    seq = [f"{s.stack[0]}-{s.pid}/{s.tid}" for s in samples]
    runs = list(dict.fromkeys(seq))
    assert [b.name for b in firsts] == runs and len(runs) == 4


def test_parallel_counting_gives_the_same_counts_and_line_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flamed.fastfolded as ff

    lines = []
    for i in range(3000):
        lines.append(f"root;f{i % 37};g{i % 11} {i % 5 + 1}")
        if i % 997 == 0:
            lines.append("no count here")
    src = tmp_path / "big.folded"
    src.write_text("\n".join(lines) + "\n")
    one, s1 = ff.count_folded_file(str(src), jobs=1), ReadStats()
    ff.count_folded_file(str(src), jobs=1, stats=s1)
    monkeypatch.setattr(ff, "PARALLEL_MIN_BYTES", 0)
    s3 = ReadStats()
    three = ff.count_folded_file(str(src), jobs=3, stats=s3)
    assert three == one
    assert (s3.lines, s3.records, s3.skipped) == (s1.lines, s1.records, s1.skipped) == (3004, 3000, 4)
    assert sorted(s3.first_errors) == sorted(s1.first_errors)
    out1, out3 = tmp_path / "1.svg", tmp_path / "3.svg"
    assert main(["svg", "-j", "1", str(src), "-o", str(out1)]) == 0
    assert main(["svg", "-j", "3", str(src), "-o", str(out3)]) == 0
    assert out1.read_bytes() == out3.read_bytes()


@pytest.mark.parametrize(
    "capture",
    sorted(p.name for p in (DATA / "perf").glob("*.txt*")) + sorted(p.name for p in (DATA / "bcc").glob("*.txt.gz")),
)
def test_real_captures_every_frame_with_its_width(capture: str) -> None:
    from flamed.inputs import load_profile

    path = DATA / ("perf" if (DATA / "perf" / capture).exists() else "bcc") / capture
    p = load_profile([str(path)])
    assert len(p) > 0
    for opts in ({"minwidth": 0}, {"minwidth": 0, "inverted": True, "palette": "mixed"}):
        _, boxes = parse_svg(render(p, **opts))  # parses as XML whatever the frame text
        assert box_paths(boxes, inverted=bool(opts.get("inverted"))) == expected_paths(p)


_any_frame = st.one_of(
    st.text(max_size=8).filter(lambda f: ";" not in f and "\n" not in f and "\x00" not in f),
    st.binary(max_size=8).map(lambda b: b.decode("utf-8", "surrogateescape")).filter(
        lambda f: ";" not in f and "\n" not in f and "\x00" not in f
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.lists(_any_frame, min_size=1, max_size=5).map(tuple), st.integers(1, 10**6), min_size=1,
                    max_size=15),
    st.booleans(),
)
def test_any_frame_text_gives_well_formed_svg_with_every_frame(stacks: dict[tuple[str, ...], int], inverted: bool) -> None:
    from flamed.outputs.svg import visible_text

    p = Profile(stacks=stacks)
    data = render(p, minwidth=0, inverted=inverted, palette="mixed")
    _, boxes = parse_svg(data)
    shown = Profile()
    for stack, w in stacks.items():
        shown.add(tuple(visible_text(f) for f in stack), w)
    assert box_paths(boxes, inverted=inverted) == expected_paths(shown)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4).map(tuple),
                       st.integers(1, 10**12), min_size=1, max_size=20))
def test_huge_weights_are_drawn_in_scaled_units(stacks: dict[tuple[str, ...], int]) -> None:
    # Browsers clamp coordinates past ~2^25: big totals are drawn in units of total/2^24.
    from flamed.outputs.svg import MAX_UNITS

    p = Profile(stacks=stacks)
    data = render(p, minwidth=0)
    root, boxes = parse_svg(data)
    fv = root.find(".//s:svg[@id='fv']", NS)
    assert fv is not None
    assert max(b.x + b.width for b in boxes) <= MAX_UNITS
    total = p.total()
    if total <= MAX_UNITS:
        assert fv.get("data-per-unit") is None
        assert box_paths(boxes) == expected_paths(p)
        return
    per_unit = float(fv.get("data-per-unit", "nan"))
    assert per_unit == pytest.approx(total / MAX_UNITS)
    drawn = box_paths(boxes)
    exp = expected_paths(p)
    # Every box drawn has its exact weight; only boxes under one unit are left out.
    assert all(exp[k] == v for k, v in drawn.items())
    assert all(v < 1.5 * per_unit for k, v in exp.items() if k not in drawn)
    for b in boxes:
        assert abs(b.width - b.weight / per_unit) <= 1.0


def test_pyspy_raw_takes_the_fast_path_with_identical_output(tmp_path: Path) -> None:
    from flamed.collapse.driver import collapse
    from flamed.inputs import all_folded

    src = tmp_path / "pyspy.txt"
    src.write_text(
        "process 12:\"python app.py\";<module> (app.py:3);main (app.py:9);work (lib/w.py:4) 7\n"
        "process 12:\"python app.py\";<module> (app.py:3);main (app.py:9) 2\n"
        "process 12:\"python app.py\";<module> (app.py:3);main (app.py:9);work (lib/w.py:5) 1\n"
    )
    assert all_folded([str(src)])
    out = tmp_path / "fast.svg"
    assert main(["svg", str(src), "-o", str(out)]) == 0
    slow = io.BytesIO()
    render_profile(collapse([str(src)]).profile, slow, OutputOptions())
    assert out.read_bytes() == slow.getvalue()


def test_hidden_boxes_keep_a_tab_in_their_name(tmp_path: Path) -> None:
    """The search matches drawn boxes by their title's name, which keeps a tab, and
    boxes too narrow to draw by their <metadata id="hidden"> line; that line had the
    tab turned into a space, so one name matched in one place and not the other."""
    src = tmp_path / "tab.folded"
    src.write_text("main;wide;a\tb 100000\nmain;narrow;a\tb 1\n")
    out = tmp_path / "tab.svg"
    assert main(["svg", str(src), "-o", str(out)]) == 0
    ns = {"s": "http://www.w3.org/2000/svg"}
    root = ET.parse(out).getroot()
    titles = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t.startswith("a\tb (") for t in titles)  # the drawn one
    hidden = root.find(".//s:metadata[@id='hidden']", ns)
    assert hidden is not None and hidden.text is not None
    names = [line.rpartition("\t")[0] for line in hidden.text.splitlines() if line]
    assert "a\tb" in names
