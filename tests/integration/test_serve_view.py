"""``flamed serve``'s first view in headless Chromium (issue 22 items 10 and 11).

10. A store whose stacks hold two 905-frame recursions (as a real day's did):
    the graph opens at its root, with the root and the process frames in
    view, and fits its frame's width.
11. The timeline has a time axis (UTC ticks on the columns' edges), the
    offsets of the rows, a colour scale and range A marked.

Each test leaves a screenshot under its tmp dir, named in its assertions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cdp import Browser
from servedata import T0, write_busy_state_dir, write_state_dir
from serveproc import serve

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]
T0_MS = T0 // 1_000_000
G = "document.getElementById('graph')"


def _wait_graph(b: Browser) -> None:
    b.wait_for("window.flamed && window.flamed.loads >= 1")
    assert b.eval("window.flamed.error") is None
    b.wait_for(f"(() => {{ const w = {G}.contentWindow; return w && w.F && w.F.length > 0; }})()")


def _boxes(b: Browser, names_js: str) -> list[dict[str, Any]]:
    """Boxes of the embedded graph matching a predicate on the frame, in the frame's viewport."""
    return b.eval(f"""(() => {{ const w = {G}.contentWindow;
        return [...w.F].filter(f => ({names_js})(f)).map(f => {{ const r = f.r.getBoundingClientRect();
          return {{name: f.name, top: r.top, bottom: r.bottom, left: r.left, right: r.right}}; }}); }})()""")


def test_deep_graph_opens_at_its_root_and_fits(serve_browser: Browser, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_busy_state_dir(state, 3, stacks_per_file=200, tower_depth=905)
    b = serve_browser
    shot = tmp_path / "serve-deep-open.png"
    with serve("--state-dir", str(state)) as url:
        b.navigate(url)
        _wait_graph(b)
        time.sleep(0.2)
        b.screenshot(shot)
        view_h, view_w = b.eval(f"[{G}.clientHeight, {G}.clientWidth]")
        svg_h = b.eval(f"Number({G}.contentDocument.documentElement.getAttribute('height'))")
        assert svg_h > 905 * 16, f"the graph is not deep ({svg_h} px); screenshot {shot}"
        # The root (the widest box) and the processes' frames are on screen.
        root = max(_boxes(b, "f => true"), key=lambda r: r["right"] - r["left"])
        procs = _boxes(b, "f => /^(deep|svc\\d+)-\\d+$/.test(f.name)")
        assert procs, f"no process frames; screenshot {shot}"
        frame_top, page_h = b.eval(f"[{G}.getBoundingClientRect().top + {G}.clientTop, innerHeight]")
        for box in [root, *procs]:
            assert 0 <= box["top"] and box["bottom"] <= view_h, \
                f"{box['name']} at {box['top']:.0f}..{box['bottom']:.0f}, frame shows 0..{view_h}; screenshot {shot}"
            # and in the window, without scrolling the page
            assert frame_top + box["bottom"] <= page_h, f"{box['name']} below the window; screenshot {shot}"
        # Fitted to the frame: no horizontal scroll, the root spans the graph's width.
        doc_w = b.eval(f"{G}.contentDocument.documentElement.scrollWidth")
        assert doc_w <= view_w, f"graph {doc_w} px wide in a {view_w} px frame; screenshot {shot}"
        assert root["right"] - root["left"] >= view_w - 60, f"root {root}; screenshot {shot}"
        # The tower's tip is above, out of view, reached by scrolling up.
        tips = _boxes(b, "f => /^leaf_/.test(f.name)")
        assert tips and all(t["bottom"] < 0 for t in tips), f"{tips}; screenshot {shot}"


def test_timeline_has_time_axis_legend_and_range_marks(serve_browser: Browser, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state_dir(state, files=10)
    b = serve_browser
    shot = tmp_path / "serve-heatmap-axes.png"
    with serve("--state-dir", str(state)) as url:
        b.navigate(url)
        _wait_graph(b)
        b.screenshot(shot)
        axes = b.eval("window.flamed.axes")
        assert axes, f"no axes drawn; screenshot {shot}"
        w = b.eval("document.getElementById('timeline').width")
        # Time axis: a tick on each minute column's edge, labelled with its UTC time.
        ticks = axes["ticks"]
        want = [T0_MS + k * 60_000 for k in range(11)]
        assert [t["ms"] for t in ticks] == want, f"{ticks}; screenshot {shot}"
        for k, t in enumerate(ticks):
            assert abs(t["x"] - k * w / 10) < 1, (t, w)
            assert t["label"] == time.strftime("%H:%M", time.gmtime(t["ms"] / 1000)), f"{t}; screenshot {shot}"
        assert ticks[0]["day"] == time.strftime("%Y-%m-%d", time.gmtime(T0_MS / 1000))
        # The ticks and labels are drawn: dark pixels under each tick.
        dark = b.eval("""(() => { const c = document.getElementById('tlaxis'), g = c.getContext('2d');
            return window.flamed.axes.ticks.map(t => { const x = Math.min(c.width - 1, Math.round(t.x));
              const d = g.getImageData(x, 2, 1, 8).data; let n = 0;
              for (let i = 3; i < d.length; i += 4) if (d[i] > 100) n++; return n; }); })()""")
        assert all(n > 0 for n in dark), f"tick marks missing {dark}; screenshot {shot}"
        # Rows: the offset of a row inside its minute column.
        assert axes["rows"][:3] == ["+0", "+10 s", "+20 s"], f"{axes['rows']}; screenshot {shot}"
        # Colour scale: 0 .. the hottest cell, the top of the bar in the hottest colour.
        cells = b.eval("TL.cells")
        assert axes["legend"]["max"] == max(map(max, cells)) > 0
        assert axes["legend"]["cell_ms"] == 1000
        top = b.eval("Array.from(document.getElementById('tllegend').getContext('2d').getImageData(10, 17, 1, 1).data)")
        assert top[0] == 255 and top[1] <= 45 and top[2] <= 10, f"legend top {top}; screenshot {shot}"
        # Range A (the whole input at first) is marked on the axis; a drag moves the mark.
        assert axes["marks"]["A"] == [0, w], axes["marks"]
        r = b.eval("(() => { const r = document.getElementById('timeline').getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()")
        y = r[1] + r[3] / 2
        b.mouse("mouseMoved", r[0] + 2, y)
        b.mouse("mousePressed", r[0] + 2, y, 1)
        b.mouse("mouseMoved", r[0] + r[2] * 0.45, y)
        b.mouse("mouseReleased", r[0] + r[2] * 0.45, y, 1)
        b.wait_for("window.flamed.loads >= 2")
        x0, x1 = b.eval("window.flamed.axes.marks.A")
        s, e = b.eval("[flamed.state.start, flamed.state.end]")
        assert abs(x0 - (s - T0_MS) / 600_000 * w) < 1 and abs(x1 - (e - T0_MS) / 600_000 * w) < 1
        assert x1 < w * 0.5, (x0, x1, w)
        b.screenshot(tmp_path / "serve-heatmap-axes-selected.png")
