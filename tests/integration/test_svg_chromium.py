"""The SVG's script in a real browser: hover, search, click-zoom, reset (headless Chromium over CDP)."""

from __future__ import annotations

import gzip
import io
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdp import Browser, chromium_path
from support import ARTIFACTS, DATA, need
from flamed.folded import read_folded
from flamed.model import Profile
from flamed.outputs.base import OutputOptions
from flamed.outputs.svg import render_profile
from svgparse import ParsedBox, parse_svg

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    need(chromium_path() is not None, "chromium (Debian package chromium)")
    b = Browser(tmp_path / "chromium-profile")
    try:
        yield b
    finally:
        b.close()


def _profile() -> Profile:
    with gzip.open(DATA / "bcc" / "profile-folded.txt.gz", "rb") as f:
        p = read_folded(f)
    # A Python frame and a kernel frame under two different parents, so that a
    # search matches nested and separate boxes.
    p.add(("worker 0", "start_thread", "worker", "recurse", "recurse", "sys_read_[k]"), 20)
    p.add(("job", "2", "start_thread", "worker", "recurse", "handle (app/web.py:12)", "recurse"), 10)
    return p


def _center(b: Browser, selector_js: str) -> tuple[float, float]:
    r = b.eval(f"(() => {{ const r = ({selector_js}).getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; }})()")
    return r[0] + r[2] / 2, r[1] + r[3] / 2


def _frame_js(name: str) -> str:
    # The widest box of that name.
    return f"F.filter(f => f.name === {name!r}).sort((a, b) => b.w - a.w)[0].r"


def _widest(boxes: list[ParsedBox], name: str) -> ParsedBox:
    return max((x for x in boxes if x.name == name), key=lambda x: x.width)


def test_svg_in_chromium_hover_search_zoom_reset(browser: Browser, tmp_path: Path) -> None:
    p = _profile()
    buf = io.BytesIO()
    render_profile(p, buf, OutputOptions(title="bcc profile", palette="mixed", minwidth=0))
    svg = tmp_path / "graph.svg"
    svg.write_bytes(buf.getvalue())
    _, boxes = parse_svg(buf.getvalue())
    total = p.total()
    b = browser
    b.navigate(svg.as_uri())
    b.wait_for("typeof F !== 'undefined' && F.length > 0")

    # Loaded: the script saw every box, and relabelling draws the labels it drew at load.
    assert b.eval("F.length") == len(boxes)
    server_labels = b.eval("[...document.querySelectorAll('#labels text')].map(t => t.textContent)")
    assert server_labels
    b.eval("relabel()")
    assert b.eval("[...document.querySelectorAll('#labels text')].map(t => t.textContent)") == server_labels

    # Hover: the details line names the frame, its samples and share.
    x, y = _center(b, _frame_js("spin_for"))
    b.mouse("mouseMoved", x, y)
    details = b.eval("document.getElementById('details').textContent")
    spin = int(_widest(boxes, "spin_for").width)
    assert spin > 1
    assert details == f"Function: spin_for ({spin:,} samples, {100 * spin / total:.2f}%)"
    # The floating tooltip shows the same, next to the pointer.
    assert not b.eval("document.getElementById('tip').classList.contains('hide')")
    assert b.eval("document.getElementById('tipname').textContent") == "spin_for"
    assert b.eval("document.getElementById('tipinfo').textContent") == f"{spin:,} samples, {100 * spin / total:.2f}%"
    tr = b.eval("(() => { const r = document.getElementById('tip').getBoundingClientRect(); return [r.x, r.y, r.width]; })()")
    assert abs(tr[1] - y) < 60 and tr[2] > 50, tr
    b.screenshot(ARTIFACTS / "svg-hover.png")
    b.mouse("mouseMoved", 5, 5)
    assert b.eval("document.getElementById('tip').classList.contains('hide')")

    # Search through the real button and prompt: nested matches count once.
    sx, sy = _center(b, "document.getElementById('search')")
    b.click_nowait(sx, sy)
    dialog = b.answer_prompt("^recurse$")
    assert dialog["params"]["type"] == "prompt"
    b.wait_for("!document.getElementById('matched').classList.contains('hide')")
    want = sum(w for s, w in p.stacks.items() if "recurse" in s)
    matched_text = b.eval("document.getElementById('matched').textContent")
    assert matched_text == f"Matched: {100 * want / total:.2f}%"
    n_recurse = sum(1 for x in boxes if x.name == "recurse")
    assert n_recurse >= 3
    assert b.eval("F.filter(f => f.r.getAttribute('fill') === '#e600e6').length") == n_recurse
    assert b.eval("F.filter(f => f.name !== 'recurse' && f.r.getAttribute('fill') === '#e600e6').length") == 0

    # Click-zoom on 'spin_for': the view becomes its range, ancestors fade, siblings leave the view.
    spin_box = _widest(boxes, "spin_for")
    x, y = _center(b, _frame_js("spin_for"))
    b.click(x, y)
    vb = b.eval("document.getElementById('fv').getAttribute('viewBox')").split()
    assert [float(vb[0]), float(vb[2])] == [spin_box.x, spin_box.width]
    assert not b.eval("document.getElementById('unzoom').classList.contains('hide')")
    faded = set(b.eval("F.filter(f => f.g.classList.contains('a')).map(f => f.name)"))
    ancestors = {
        x.name for x in boxes
        if x.y > spin_box.y and x.x <= spin_box.x and x.x + x.width >= spin_box.x + spin_box.width
    }
    assert faded == ancestors and "all" in faded and len(faded) >= 3
    # The zoomed box now spans the drawing; a box outside it is out of view.
    zr = b.eval(f"(() => {{ const r = {_frame_js('spin_for')}.getBoundingClientRect(); return [r.x, r.width]; }})()")
    assert zr[0] == pytest.approx(10, abs=1) and zr[1] == pytest.approx(1180, abs=1)
    other = next(x for x in boxes if x.x + x.width <= spin_box.x or x.x >= spin_box.x + spin_box.width)
    idx = boxes.index(other)
    orect = b.eval(f"(() => {{ const r = F[{idx}].r.getBoundingClientRect(); return [r.x, r.width]; }})()")
    assert orect[0] + orect[1] <= 10.5 or orect[0] >= 1189.5, f"box {other.name} should be out of view: {orect}"
    labels = b.eval("[...document.querySelectorAll('#labels text')].map(t => t.textContent)")
    assert "lib_inner" in labels and "spin_for" in labels
    # Search share of the zoomed view is shown too.
    assert "of view" in b.eval("document.getElementById('matched').textContent")
    b.screenshot(ARTIFACTS / "svg-zoomed-search.png")

    # Reset: full view, no fading, the original labels; Escape clears the search.
    ux, uy = _center(b, "document.getElementById('unzoom')")
    b.click(ux, uy)
    vb = b.eval("document.getElementById('fv').getAttribute('viewBox')").split()
    assert float(vb[0]) == 0 and float(vb[2]) == total
    assert b.eval("document.getElementById('unzoom').classList.contains('hide')")
    assert b.eval("F.filter(f => f.g.classList.contains('a')).length") == 0
    assert b.eval("[...document.querySelectorAll('#labels text')].map(t => t.textContent)") == server_labels
    b.key("Escape", 27)
    assert b.eval("F.filter(f => f.r.getAttribute('fill') === '#e600e6').length") == 0
    assert b.eval("document.getElementById('matched').classList.contains('hide')")
    b.screenshot(ARTIFACTS / "svg-reset.png")


def test_svg_search_from_url_and_bad_regex(browser: Browser, tmp_path: Path) -> None:
    p = _profile()
    buf = io.BytesIO()
    render_profile(p, buf, OutputOptions(minwidth=0))
    svg = tmp_path / "graph.svg"
    svg.write_bytes(buf.getvalue())
    b = browser
    b.navigate(svg.as_uri() + "?s=" + urllib.parse.quote(r"_\[k\]$"))
    b.wait_for("typeof F !== 'undefined' && F.length > 0")
    want = sum(w for s, w in p.stacks.items() if any(f.endswith("_[k]") for f in s))
    assert b.eval("document.getElementById('matched').textContent") == f"Matched: {100 * want / p.total():.2f}%"
    # Names are shown without their annotation, as flamegraph.pl shows them, and the
    # search finds them by that name too.
    assert b.eval("F.filter(f => f.full === 'sys_read_[k]').map(f => [f.name, f.title.split(' (')[0]])") == [
        ["sys_read", "sys_read"]
    ]
    b.eval("search('^sys_read$')")
    assert b.eval("document.getElementById('matched').textContent") == f"Matched: {100 * want / p.total():.2f}%"
    b.eval("search('(')")
    assert re.match(r"Bad regex", b.eval("document.getElementById('matched').textContent"))


def test_svg_icicle_zoom_from_url(browser: Browser, tmp_path: Path) -> None:
    p = _profile()
    buf = io.BytesIO()
    render_profile(p, buf, OutputOptions(minwidth=0, inverted=True))
    svg = tmp_path / "icicle.svg"
    svg.write_bytes(buf.getvalue())
    _, boxes = parse_svg(buf.getvalue())
    target = _widest(boxes, "lib_inner")
    idx = boxes.index(target)
    b = browser
    b.navigate(svg.as_uri() + f"?z={idx}")
    b.wait_for("typeof F !== 'undefined' && F.length > 0")
    vb = b.eval("document.getElementById('fv').getAttribute('viewBox')").split()
    assert [float(vb[0]), float(vb[2])] == [target.x, target.width]
    # In an icicle the ancestors are above (smaller y).
    faded = b.eval("F.filter(f => f.g.classList.contains('a')).map(f => f.y)")
    assert faded and all(y < target.y for y in faded)
    want = {x.y for x in boxes if x.y < target.y and x.x <= target.x and x.x + x.width >= target.x + target.width}
    assert set(faded) == want
    b.screenshot(ARTIFACTS / "svg-icicle-zoomed.png")


def test_svg_nanosecond_weights_draw_to_scale(browser: Browser, tmp_path: Path) -> None:
    # Weights in ns (perf's period) make totals of 1e10 and more; boxes must still
    # be drawn to scale and zoom exactly (browsers clamp huge coordinates).
    p = Profile()
    p.add(("main", "left"), 6_000_000_000)
    p.add(("main", "right", "leaf"), 3_000_000_000)
    p.add(("main", "right"), 3_000_000_000)
    buf = io.BytesIO()
    render_profile(p, buf, OutputOptions(minwidth=0, countname="ns"))
    svg = tmp_path / "ns.svg"
    svg.write_bytes(buf.getvalue())
    b = browser
    b.navigate(svg.as_uri())
    b.wait_for("typeof F !== 'undefined' && F.length > 0")

    def width(name: str) -> float:
        return float(b.eval(f"{_frame_js(name)}.getBoundingClientRect().width"))

    assert width("all") == pytest.approx(1180, abs=1)
    assert width("left") == pytest.approx(590, abs=1)
    assert width("leaf") == pytest.approx(295, abs=1)
    x, y = _center(b, _frame_js("right"))
    b.click(x, y)
    assert width("right") == pytest.approx(1180, abs=1)
    assert width("leaf") == pytest.approx(590, abs=1)


def _label_fits_js() -> str:
    # For every drawn label: [text, its width as drawn, the px of its box in view,
    # the width of the label one character longer (or -1 when it is the whole name)].
    return """(() => {
      const vx = view ? view.x : 0, vw = view ? view.w : total, scale = dw / vw;
      const probe = document.createElementNS(NS, 'text');
      labels.appendChild(probe);
      const width = s => { probe.textContent = s; return probe.getComputedTextLength(); };
      const out = [];
      for (const t of [...labels.querySelectorAll('text')]) {
        if (t === probe) continue;
        const x = parseFloat(t.getAttribute('x')) - 3, y = parseFloat(t.getAttribute('y'));
        const f = F.find(f => Math.abs(f.y + fh - 5 - y) < 0.01 &&
                              Math.abs(left + (Math.max(f.x, vx) - vx) * scale - x) < 0.06);
        const a = Math.max(f.x, vx), b = Math.min(f.x + f.w, vx + vw), px = (b - a) * scale;
        const s = t.textContent, cut = s.endsWith('..') && s !== f.name;
        const kept = cut ? s.length - 2 : s.length;
        const next = cut && kept < f.name.length ? width(f.name.slice(0, kept + 1) + '..') : -1;
        out.push([s, t.getComputedTextLength(), px, next, f.name]);
      }
      probe.remove();
      return out;
    })()"""


def test_svg_labels_are_cut_by_measured_width_after_a_zoom(browser: Browser, tmp_path: Path) -> None:
    p = Profile()
    # Names of narrow glyphs ("i", "l") that a fixed 7.08 px per character cuts far too early.
    p.add(("main", "fill_illicit_little_list_" + "il" * 20, "leaf_" + "i" * 80), 30)
    p.add(("main", "other_" + "l" * 150), 50)
    p.add(("main", "wide_" + "W" * 40), 20)
    buf = io.BytesIO()
    render_profile(p, buf, OutputOptions(minwidth=0))
    svg = tmp_path / "labels.svg"
    svg.write_bytes(buf.getvalue())
    b = browser
    b.navigate(svg.as_uri())
    b.wait_for("typeof F !== 'undefined' && F.length > 0")
    b.eval("zoom(F.find(f => f.name === 'main'))")
    rows = b.eval(_label_fits_js())
    assert len(rows) >= 4
    fs, fw = 12, 0.59
    longer_than_fixed = 0
    for text, drawn, px, next_w, name in rows:
        assert drawn <= px - 3 + 0.5, (text, drawn, px)  # it fits in its box
        if next_w >= 0:
            assert next_w > px - 3 - 0.5, (text, next_w, px)  # one more character would not
        fixed = int(px / (fs * fw))
        if len(name) > fixed and len(text) > fixed:
            longer_than_fixed += 1
    assert longer_than_fixed >= 2, rows  # narrow names keep more than 7.08 px per character allows
    # The wide name is cut too, before it overflows.
    wide = next(r for r in rows if r[4].startswith("wide_"))
    assert wide[0].endswith("..")


def test_svg_search_counts_samples_of_boxes_too_narrow_to_draw(browser: Browser, tmp_path: Path) -> None:
    p = Profile()
    p.add(("main", "busy"), 100_000)
    # 300 stacks of one sample each, every one far narrower than 0.1 px: none is drawn.
    for i in range(300):
        p.add(("main", f"caller_{i}", "tiny_target"), 1)
    p.add(("main", "busy", "tiny_target"), 2)
    buf = io.BytesIO()
    render_profile(p, buf, OutputOptions(nametype="Symbol:"))
    svg = tmp_path / "narrow.svg"
    svg.write_bytes(buf.getvalue())
    _, boxes = parse_svg(buf.getvalue())
    assert not [x for x in boxes if x.name == "tiny_target"], "the boxes are too narrow to draw"
    b = browser
    b.navigate(svg.as_uri() + "?s=" + urllib.parse.quote("^tiny_target$"))
    b.wait_for("typeof F !== 'undefined' && F.length > 0")
    want = 302 / p.total()
    assert b.eval("document.getElementById('matched').textContent") == f"Matched: {100 * want:.2f}%"
    # Nested and separate matches still count each sample once.
    b.eval("search('tiny_target|^caller_1')")
    assert b.eval("document.getElementById('matched').textContent") == f"Matched: {100 * want:.2f}%"
    # --nametype names the hovered frames in the details line.
    x, y = _center(b, _frame_js("busy"))
    b.mouse("mouseMoved", x, y)
    assert b.eval("document.getElementById('details').textContent").startswith("Symbol: busy (")


def test_svg_nameattr_links_and_tooltips(browser: Browser, tmp_path: Path) -> None:
    # flamegraph.pl's --nameattr: a replaced tooltip, and a box that is a link
    # (a click follows it, a Ctrl-click zooms, as in flamegraph.pl).
    attrs = tmp_path / "attrs.tsv"
    attrs.write_text("spin_for\ttitle=spin: the hot loop\nlib_inner\thref=#lib\tclass=lib\n")
    buf = io.BytesIO()
    render_profile(_profile(), buf, OutputOptions(minwidth=0, extra={"nameattr": str(attrs)}))
    svg = tmp_path / "attrs.svg"
    svg.write_bytes(buf.getvalue())
    b = browser
    b.navigate(svg.as_uri())
    b.wait_for("typeof F !== 'undefined' && F.length > 0")
    x, y = _center(b, _frame_js("spin_for"))
    b.mouse("mouseMoved", x, y)
    assert b.eval("document.getElementById('tipname').textContent") == "spin_for"
    assert b.eval("document.getElementById('tipinfo').textContent") == "spin: the hot loop"
    assert b.eval("document.getElementById('details').textContent") == "Function: spin: the hot loop"
    link = f"{_frame_js('lib_inner')}.parentNode"
    assert b.eval(f"{link}.localName + ' ' + {link}.getAttribute('class')") == "a lib"
    b.eval(f"{_frame_js('lib_inner')}.dispatchEvent(new MouseEvent('click', {{bubbles: true, cancelable: true}}))")
    assert b.eval("document.getElementById('unzoom').classList.contains('hide')")
    b.eval(f"{_frame_js('lib_inner')}.dispatchEvent(new MouseEvent('click', {{bubbles: true, cancelable: true, ctrlKey: true}}))")
    assert not b.eval("document.getElementById('unzoom').classList.contains('hide')")
    assert b.eval("zoomed") == b.eval("F.indexOf(F.filter(f => f.name === 'lib_inner').sort((a, b) => b.w - a.w)[0])")
