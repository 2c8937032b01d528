"""flamegraph.pl's options, by flamegraph.pl's names, on `flamed svg` and `flamed diff`."""

from __future__ import annotations

import io
import re
from collections import Counter
from pathlib import Path

import pytest

from flamed.cli import main
from svgparse import box_paths, parse_svg

FOLDED = (
    "java;java/lang/Thread:::run;com/example/App:::work_[j];JVM_Sleep;do_nanosleep_[k] 30\n"
    "java;java/lang/Thread:::run;Interpreter::call 20\n"
    "java;start_thread;C2Compiler::compile_[i] 10\n"
)


def _svg(tmp_path: Path, *args: str, text: str = FOLDED) -> str:
    src = tmp_path / "in.folded"
    src.write_text(text)
    out = tmp_path / "out.svg"
    err = io.StringIO()
    assert main(["svg", str(src), "-o", str(out), "--minwidth", "0", *args], stderr=err) == 0, err.getvalue()
    return out.read_text()


def _fills(svg: str) -> dict[str, str]:
    _, boxes = parse_svg(svg.encode())
    return {b.name: b.fill for b in boxes}


def _rgb(fill: str) -> tuple[int, int, int]:
    return int(fill[1:3], 16), int(fill[3:5], 16), int(fill[5:7], 16)


def test_colors_is_palette_and_java_colors_by_kind(tmp_path: Path) -> None:
    a = _svg(tmp_path, "--colors", "java")
    assert a == _svg(tmp_path, "--palette", "java")
    f = {k: _rgb(v) for k, v in _fills(a).items()}
    # flamegraph.pl's java palette: Java and JIT frames green, C++ yellow, kernel orange,
    # inlined aqua, the rest (system) red.
    for name in ("java/lang/Thread:::run", "com/example/App:::work_[j]"):
        r, g, b = f[name]
        assert g >= 200 and r < 120 and b < 120, (name, f[name])
    r, g, b = f["Interpreter::call"]
    assert r == g and b < 80, f["Interpreter::call"]
    r, g, b = f["do_nanosleep_[k]"]
    assert r >= 190 and 90 <= g <= 155 and b == 0
    r, g, b = f["C2Compiler::compile_[i]"]
    assert g == b and r < g, f["C2Compiler::compile_[i]"]
    r, g, b = f["JVM_Sleep"]
    assert r >= 200 and g == b and g < 140


@pytest.mark.parametrize("palette", ["js", "perl", "wakeup", "chain"])
def test_other_multi_palettes_are_accepted(tmp_path: Path, palette: str) -> None:
    assert "<svg" in _svg(tmp_path, "--colors", palette)


def test_js_perl_wakeup_chain_rules(tmp_path: Path) -> None:
    js = {k: _rgb(v) for k, v in _fills(_svg(tmp_path, "--colors", "js", text="node;LazyCompile:*main /app/x.js:1_[j];v8::Run;Builtin:Call_[j] 5\n")).items()}
    assert js["LazyCompile:*main /app/x.js:1_[j]"][1] >= 200  # JIT with a path: green (source)
    r, g, b = js["Builtin:Call_[j]"]
    assert g == b and r < g  # JIT without a path: aqua (builtin)
    r, g, b = js["v8::Run"]
    assert r == g and b < 80  # C++: yellow
    perl = {k: _rgb(v) for k, v in _fills(_svg(tmp_path, "--colors", "perl", text="perl;Perl_runops;main::x;foo.pl:3 5\n")).items()}
    assert perl["Perl_runops"][1] >= 200 and perl["foo.pl:3"][1] >= 200
    assert perl["main::x"][0] == perl["main::x"][1]
    wake = {k: _rgb(v) for k, v in _fills(_svg(tmp_path, "--colors", "wakeup", text="a;b;c 5\n")).items()}
    assert all(g == b and r < g for n, (r, g, b) in wake.items() if n != "all")
    # chain: frames after the "--" separator are the waker's (aqua), the others off-CPU (blue).
    chain = _svg(tmp_path, "--colors", "chain", text="sleeper;schedule;--;waker;try_to_wake_up 5\n")
    ch = {k: _rgb(v) for k, v in _fills(chain).items()}
    r, g, b = ch["schedule"]
    assert b > r and r == g, "off-CPU: blue"
    r, g, b = ch["waker_[w]"]
    assert g == b and r < g, "waker: aqua"
    assert 'stop-color="#e0e0ff"' in chain, "chain graphs default to the blue background"


def test_bgcolors(tmp_path: Path) -> None:
    assert 'stop-color="#eeeeb0"' in _svg(tmp_path)  # hot: yellow
    assert 'stop-color="#e0e0ff"' in _svg(tmp_path, "--bgcolors", "blue")
    assert 'stop-color="#e8e8e8"' in _svg(tmp_path, "--colors", "red")  # flat palettes: grey
    flat = _svg(tmp_path, "--bgcolors", "#123456")
    assert flat.count('stop-color="#123456"') == 2
    err = io.StringIO()
    src = tmp_path / "in.folded"
    assert main(["svg", str(src), "--bgcolors", "pink", "-o", str(tmp_path / "x.svg")], stderr=err) == 2
    assert "--bgcolors" in err.getvalue()


def test_height_fontsize_fonttype_fontwidth_nametype_notes(tmp_path: Path) -> None:
    svg = _svg(tmp_path, "--height", "24", "--fontsize", "14", "--fonttype", "DejaVu Sans Mono",
               "--nametype", "Symbol:", "--notes", "build 42 -- nightly")
    _, boxes = parse_svg(svg.encode())
    ys = sorted({b.y for b in boxes})
    assert len(ys) == 6 and {b - a for a, b in zip(ys, ys[1:])} == {24.0}
    rects = re.findall(r'<g><title>[^<]*</title><rect [^>]* height="(\d+)"', svg)
    assert rects and set(rects) == {"23"}
    assert 'data-fs="14"' in svg and 'data-fh="24"' in svg and 'data-nametype="Symbol:"' in svg
    assert 'text{font-family:"DejaVu Sans Mono",sans-serif;font-size:14px}' in svg
    assert "<!-- NOTES: build 42 - - nightly -->" in svg
    # --fontwidth: the file's labels fit more characters when glyphs are said to be narrower.
    long = "java;" + "x" * 400 + " 5\n"
    wide = re.findall(r"<text x=[^>]*>(x+\.\.)</text>", _svg(tmp_path, text=long))
    narrow = re.findall(r"<text x=[^>]*>(x+\.\.)</text>", _svg(tmp_path, "--fontwidth", "0.4", text=long))
    assert wide and narrow and len(narrow[0]) > len(wide[0])


@pytest.mark.parametrize("font", ["]]><script>alert(1)</script>", 'My "Font"; x}', "ctl\x01\x7f", "bad\udcff byte"])
def test_any_fonttype_gives_a_well_formed_svg(tmp_path: Path, font: str) -> None:
    """--fonttype goes into the stylesheet's CDATA section as a CSS string:
    ``]]>`` (which ended the section: malformed XML, and markup of the
    caller's), quotes, controls XML cannot carry and a byte that is not UTF-8
    (argv's surrogateescape; it was a traceback) are CSS escapes there."""
    import xml.dom.minidom

    svg = _svg(tmp_path, "--fonttype", font)
    doc = xml.dom.minidom.parseString(svg.encode("utf-8"))
    assert [s.getAttribute("type") for s in doc.getElementsByTagName("script")] == ["text/ecmascript"]
    style = "".join(n.data for s in doc.getElementsByTagName("style") for n in s.childNodes)
    rule = re.search(r'text\{font-family:("(?:[^"\\]|\\[0-9a-f]+ )*"),sans-serif;font-size:12px\}', style)
    assert rule, style[-300:]
    # The CSS string reads back as the family asked for (an invalid byte as its Latin-1 character).
    family = re.sub(r"\\([0-9a-f]+) ", lambda m: chr(int(m.group(1), 16)), rule.group(1)[1:-1])
    assert family == font.replace("\udcff", "\xff")


def test_reverse_factor_random(tmp_path: Path) -> None:
    _, boxes = parse_svg(_svg(tmp_path, "--reverse").encode())
    paths = box_paths(boxes)
    assert ("all", "do_nanosleep_[k]", "JVM_Sleep") in paths and ("all", "java") not in paths
    two = _svg(tmp_path, "--factor", "2")
    assert "<title>all (120 samples, 100.00%)</title>" in two
    half = _svg(tmp_path, "--factor", "0.5")
    assert "<title>all (30 samples, 100.00%)</title>" in half
    # --random: colors drawn at random, one per name within the graph.
    r1, r2 = _fills(_svg(tmp_path, "--random")), _fills(_svg(tmp_path, "--random"))
    assert r1 != r2 or r1 != _fills(_svg(tmp_path))


def test_negate_swaps_differential_hues(tmp_path: Path) -> None:
    bp, ap = tmp_path / "b.folded", tmp_path / "a.folded"
    bp.write_text("main;grow 1\nmain;shrink 9\n")
    ap.write_text("main;grow 9\nmain;shrink 1\n")
    out = tmp_path / "d.svg"
    assert main(["diff", str(bp), str(ap), "-o", str(out)]) == 0
    plain = {b.name: (_rgb(b.fill), b.title) for b in parse_svg(out.read_bytes())[1]}
    assert main(["diff", "--negate", str(bp), str(ap), "-o", str(out)]) == 0
    neg = {b.name: (_rgb(b.fill), b.title) for b in parse_svg(out.read_bytes())[1]}
    assert plain["grow"][0][0] == 255 and neg["grow"][0][2] == 255, "red becomes blue"
    assert plain["grow"][1].endswith("+80.00%)") and neg["grow"][1].endswith("-80.00%)")


FGPL = Path(__file__).resolve().parents[1] / "data" / "svg" / "flamegraph-pl"


def _titled_fills(svg: str) -> Counter[tuple[str, tuple[int, int, int]]]:
    """(title, rgb) of every box but the root, of a flamegraph.pl or flamed SVG."""
    out: Counter[tuple[str, tuple[int, int, int]]] = Counter()
    for title, fill in re.findall(r'<title>([^<]*)</title><rect [^>]*fill="([^"]*)"', svg):
        if title.startswith("all ("):
            continue  # flamed draws the root grey, flamegraph.pl in the palette
        m = re.match(r"rgb\((\d+),(\d+),(\d+)\)$", fill)
        out[(title, (int(m[1]), int(m[2]), int(m[3])) if m else _rgb(fill))] += 1
    return out


@pytest.mark.parametrize("palette", ["hot", "java", "mem", "io"])
def test_hash_colors_are_flamegraph_pl_s(tmp_path: Path, palette: str) -> None:
    # flamegraph.pl --hash output of the same input: every box it draws, flamed draws
    # with the same title and the same rgb (module`names, unicode, annotations included).
    ours = _titled_fills(_svg(tmp_path, "--hash", "--colors", palette, "--minwidth", "0.1",
                              text=(FGPL / "names.folded").read_text()))
    ref = _titled_fills((FGPL / f"hash-{palette}.svg").read_text())
    assert len(ref) > 90
    assert sorted((ref - ours).elements()) == []


def test_annotations_are_left_out_of_titles_and_labels(tmp_path: Path) -> None:
    # flamegraph.pl colors by the _[k]/_[j]/_[i]/_[w] annotation and shows the name without it.
    svg = _svg(tmp_path, "--colors", "java", "--width", "3000")
    titles = re.findall(r"<title>([^<]*) \(", svg)
    labels = re.findall(r"<text x=[^>]*>([^<]*)</text>", svg)
    for name in ("do_nanosleep", "com/example/App:::work", "C2Compiler::compile"):
        assert name in titles and name in labels, name
    assert not [t for t in titles + labels if re.search(r"_\[[kwij]\]", t)]
    # The annotation stays in the file, for the search and for readers of the file.
    assert '<g data-a="k"><title>do_nanosleep (' in svg
    chain = _svg(tmp_path, "--colors", "chain", text="sleeper;schedule;--;waker;try_to_wake_up 5\n")
    assert '<g data-a="w"><title>waker (' in chain and "_[w]" not in re.sub(r"<script.*</script>", "", chain, flags=re.S)
    # Only a trailing annotation is one.
    odd = _svg(tmp_path, text="a_[k]x;b_[k]_[k];c_[q] 5\n")
    assert {"a_[k]x", "b_[k]", "c_[q]"} <= set(re.findall(r"<title>([^<]*) \(", odd))


def _boxes_markup(svg: str) -> dict[str, tuple[str, dict[str, str], str]]:
    """Each box's element, attributes (flamed's own data-* left out) and title text, by
    the name its title starts with (a whole title that --nameattr replaced)."""
    out: dict[str, tuple[str, dict[str, str], str]] = {}
    for tag, attrs, title in re.findall(r"<(g|a)( [^>]*)?>\s*<title>([^<]*)</title><rect", svg):
        pairs = dict(re.findall(r'([\w:-]+)="([^"]*)"', attrs or ""))
        name = title[: title.rindex(" (")] if " (" in title else title
        out[name] = (tag, {k: v for k, v in pairs.items() if not k.startswith("data-") or k == "data-x"}, title)
    return out


def test_total_encoding_nameattr_as_flamegraph_pl(tmp_path: Path) -> None:
    # One drawing by flamegraph.pl --hash --total 200 --encoding ISO-8859-1 --nameattr.
    ref = (FGPL / "opts.svg").read_text()
    args = ["--hash", "--total", "200", "--encoding", "ISO-8859-1", "--nameattr", str(FGPL / "nameattr.tsv")]
    src = tmp_path / "in.folded"
    src.write_bytes((FGPL / "opts.folded").read_bytes())
    out = tmp_path / "out.svg"
    err = io.StringIO()
    assert main(["svg", str(src), "-o", str(out), *args], stderr=err) == 0, err.getvalue()
    assert err.getvalue() == ""
    ours = out.read_bytes().decode("iso-8859-1")
    assert ours.splitlines()[0] == ref.splitlines()[0] == '<?xml version="1.0" encoding="ISO-8859-1" standalone="no"?>'
    # --total: shares of 200 samples, and the root stands for all 200 of them.
    assert _titled_fills(ours) == _titled_fills(ref)
    _, boxes = parse_svg(out.read_bytes())
    root = next(b for b in boxes if b.name == "all")
    assert root.title == "all (200 samples, 100.00%)" and root.width == 200
    assert sum(b.width for b in boxes if b.y == root.y - 16) == 60
    # --nameattr: the same elements, attributes and tooltips.
    theirs = _boxes_markup(ref)
    mine = _boxes_markup(ours)
    assert theirs["lexer: tokens"] == ("a", {"xlink:href": "https://example.com/lex?a=1&amp;b=2", "target": "_top"},
                                       "lexer: tokens")
    for name in ("lexer: tokens", "parse", "main()", "sys_read", "eval", "jit_fn", "a&amp;b&lt;c&gt;"):
        assert mine[name] == theirs[name], name
    assert 'xmlns:xlink="http://www.w3.org/1999/xlink"' in ours
    # The replaced tooltips keep the names for the script and for readers of the file.
    assert {b.name for b in boxes} == {"all", "main", "parse", "lex", "eval", "sys_read_[k]", "jit_fn_[j]", "a&b<c>"}


def test_total_smaller_than_the_input_is_ignored_with_a_warning(tmp_path: Path) -> None:
    plain = _svg(tmp_path)
    src = tmp_path / "in.folded"
    err = io.StringIO()
    out = tmp_path / "t.svg"
    assert main(["svg", str(src), "-o", str(out), "--minwidth", "0", "--total", "10"], stderr=err) == 0
    assert "--total 10 is less than the input's total 60" in err.getvalue()
    assert out.read_text() == plain
    # Before --factor, as flamegraph.pl compares it with the counts it reads.
    assert "<title>all (240 samples, 100.00%)</title>" in _svg(tmp_path, "--total", "120", "--factor", "2")
    # Differentials and flame charts take it too.
    assert "<title>all (100 samples, 100.00%)</title>" in _svg(tmp_path, "--total", "100", "--flamechart")
    bp, ap = tmp_path / "b.folded", tmp_path / "a.folded"
    bp.write_text("main;grow 1\nmain;shrink 9\n")
    ap.write_text("main;grow 9\nmain;shrink 1\n")
    assert main(["diff", str(bp), str(ap), "-o", str(out), "--total", "20"]) == 0
    assert "main;grow" not in out.read_text() and "<title>grow (9 samples, 45.00%; +40.00%)</title>" in out.read_text()
    for bad in ("-1", "x", "nan"):
        err = io.StringIO()
        assert main(["svg", str(src), "-o", str(out), "--total", bad], stderr=err) == 2, bad
        assert "--total" in err.getvalue()


def test_encoding_writes_what_it_declares(tmp_path: Path) -> None:
    text = "main;réponse_ü;日本語 5\n"
    data = (tmp_path / "x.svg")
    svg_utf8 = _svg(tmp_path, text=text)
    assert svg_utf8.startswith('<?xml version="1.0" standalone="no"?>')
    assert main(["svg", str(tmp_path / "in.folded"), "-o", str(data), "--encoding", "latin-1"]) == 0
    raw = data.read_bytes()
    assert raw.startswith(b'<?xml version="1.0" encoding="latin-1" standalone="no"?>')
    assert "réponse_ü".encode("latin-1") in raw and "&#26085;&#26412;&#35486;".encode() in raw
    _, boxes = parse_svg(raw)  # the parser decodes by the declaration
    assert {"réponse_ü", "日本語"} <= {b.name for b in boxes}
    for bad in ("utf-16", "no-such-codec", 'x"y'):
        err = io.StringIO()
        assert main(["svg", str(tmp_path / "in.folded"), "-o", str(data), "--encoding", bad], stderr=err) == 2, bad
        assert "--encoding" in err.getvalue()


def test_nameattr_file_errors(tmp_path: Path) -> None:
    src = tmp_path / "in.folded"
    src.write_text(FOLDED)
    attrs = tmp_path / "attrs.tsv"
    for content, why in (("JVM_Sleep\n", "NAME<TAB>"), ("JVM_Sleep\tnoequals\n", "key=value"),
                         ('JVM_Sleep\tg_extra=onclick="x\n', "well-formed"), ("JVM_Sleep\tg_extra=id=\"a\" id=\"b\"\n", "well-formed")):
        attrs.write_text(content)
        err = io.StringIO()
        assert main(["svg", str(src), "-o", str(tmp_path / "o.svg"), "--nameattr", str(attrs)], stderr=err) != 0
        assert why in err.getvalue() and "attrs.tsv:1" in err.getvalue(), (content, err.getvalue())
    assert not (tmp_path / "o.svg").exists()
    # A value is escaped where it would break the file, its references are kept.
    attrs.write_text("JVM_Sleep\ttitle=<b> & &lt;i&gt;\tclass=a\"b\n\nInterpreter::call\tunknown=1\n")
    svg = _svg(tmp_path, "--nameattr", str(attrs))
    assert '<g class="a&quot;b" data-n="JVM_Sleep"><title>&lt;b&gt; &amp; &lt;i&gt;</title>' in svg
    assert "<g><title>Interpreter::call (" in svg


def test_cp_is_flamegraph_pl_s_palette_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (FGPL / "names.folded").read_text()
    # flamegraph.pl --cp's palette.map pins the colors: flamed draws with its colors.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "palette.map").write_bytes((FGPL / "cp.map").read_bytes())
    ours = _titled_fills(_svg(tmp_path, "--cp", "--minwidth", "0.1", text=text))
    ref = _titled_fills((FGPL / "cp.svg").read_text())
    assert len(ref) > 90 and sorted((ref - ours).elements()) == []
    assert set((FGPL / "cp.map").read_text().splitlines()) <= set((tmp_path / "palette.map").read_text().splitlines())
    # A first --cp --hash run writes flamegraph.pl's lines (the root aside: "" there, "all" here).
    (tmp_path / "palette.map").unlink()
    _svg(tmp_path, "--cp", "--hash", "--minwidth", "0.1", text=text)
    mine = set((tmp_path / "palette.map").read_text().splitlines())
    theirs = set((FGPL / "cp-hash.map").read_text().splitlines())
    assert {ln for ln in mine if not ln.startswith("all->")} == {ln for ln in theirs if not ln.startswith("->")}
    # --palette-file names another file.
    _svg(tmp_path, "--cp", "--palette-file", "other.map")
    assert (tmp_path / "other.map").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["svg", "--factor", "1e308"],
        ["svg", "--factor", "1e-320"],
        ["svg", "--factor", "inf"],
        ["svg", "--factor", "nan"],
        ["svg", "--width", "99999999999999999999999"],
        ["svg", "--height", "1"],
        ["svg", "--fontsize", "inf"],
        ["svg", "--fontwidth", "1e308"],
        ["diff", "--factor", "-1"],
        ["export", "--format", "pprof", "--sample-rate", "1e-300"],
        ["export", "--format", "pprof", "--sample-rate", "inf"],
        ["export", "--format", "pprof", "--sample-rate", "0"],
        ["export", "--format", "pprof", "--start-ns", "99999999999999999999999"],
        ["export", "--format", "pprof", "--start-ns", "-1"],
        ["export", "--format", "pprof", "--duration-ns", "-5"],
        ["export", "--format", "pprof", "--start-ns", "9223372036854775000", "--duration-ns", "1000"],
    ],
)
def test_out_of_range_numbers_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               args: list[str]) -> None:
    """A number the command cannot use is exit 2 with the option's name, never a traceback or a silent yes."""
    src = tmp_path / "in.folded"
    src.write_bytes(b"a;b 2\na;b;c 3\n")
    out = tmp_path / "out"
    inputs = [str(src), str(src)] if args[0] == "diff" else [str(src)]
    assert main([*args, "-o", str(out), *inputs]) == 2
    err = capsys.readouterr().err
    option = next(a for a in reversed(args) if a.startswith("--") and a != "--format")
    assert option in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["svg", "--factor", "1e9"],
        ["svg", "--factor", "1e-9"],
        ["export", "--format", "pprof", "--sample-rate", "1e-9", "--start-ns", "0", "--duration-ns", "9223372036854775807"],
        ["export", "--format", "pprof", "--sample-rate", "1e9", "--start-ns", "9223372036854775807", "--duration-ns", "0"],
    ],
)
def test_numbers_at_the_ends_of_their_ranges_work(tmp_path: Path, args: list[str]) -> None:
    src = tmp_path / "in.folded"
    # svg: the largest counts times the largest factor; export: 5 samples of a period of 1e18 ns.
    src.write_bytes(b"a;b 9000000000000000000\na;b;c 3\n" if args[0] == "svg" else b"a;b 2\na;b;c 3\n")
    out = tmp_path / "out"
    assert main([*args, "-o", str(out), str(src)]) == 0
    assert out.stat().st_size > 0
