"""``flamed serve``'s page in headless Chromium: select, compare, filter, URL round trip.

The state directory is written by the daemon's own store writer
(flamed.daemon.store.ProfileStore, the code a daemon rotation runs), not by a
daemon run: ten one-minute files of 1 s windows, func_a then func_b.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest

from cdp import Browser
from servedata import NS, T0, write_state_dir
from serveproc import serve
from support import ARTIFACTS

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]
T0_MS = T0 // 1_000_000


def _names(b: Browser) -> set[str]:
    b.wait_for("(() => { const w = document.getElementById('graph').contentWindow; return w && w.F && w.F.length > 0; })()")
    return set(b.eval("[...document.getElementById('graph').contentWindow.F].map(f => f.name)"))


def _wait_loads(b: Browser, n: int) -> None:
    b.wait_for(f"window.flamed && window.flamed.loads >= {n}")
    assert b.eval("window.flamed.error") is None


def _cell(b: Browser, col: int, row: int) -> tuple[float, float]:
    r = b.eval("(() => { const c = document.getElementById('timeline'); const r = c.getBoundingClientRect();"
               " return [r.x, r.y, c.width, c.height]; })()")
    tl = b.eval("[TL.cols, TL.rows, TL.view]")
    assert tl[2] == "heatmap"
    cw, ch = r[2] / tl[0], r[3] / tl[1]
    return r[0] + (col + 0.5) * cw, r[1] + (row + 0.5) * ch


def _drag(b: Browser, a: tuple[float, float], z: tuple[float, float]) -> None:
    b.mouse("mouseMoved", *a)
    b.mouse("mousePressed", *a, 1)
    b.mouse("mouseMoved", (a[0] + z[0]) / 2, (a[1] + z[1]) / 2)
    b.mouse("mouseMoved", *z)
    b.mouse("mouseReleased", *z, 1)


def _diff_rows(b: Browser) -> list[tuple[str, str]]:
    return b.eval("[...document.querySelectorAll('#top tbody tr')].map(r => [r.className, r.lastChild.textContent])")


def test_serve_page_select_compare_filter_url(serve_browser: Browser, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state_dir(state, files=10)
    b = serve_browser
    with serve("--state-dir", str(state)) as url:
        b.navigate(url)
        _wait_loads(b, 1)
        # Opening: the whole input (10 min, under the default hour), both functions.
        names = _names(b)
        assert {"func_a", "func_b"} <= names
        assert b.eval("[flamed.state.start, flamed.state.end]") == [T0_MS, T0_MS + 600_000]

        # Drag over the first five minute-columns of the heatmap: the first half.
        _drag(b, _cell(b, 0, 0), _cell(b, 4, 59))
        _wait_loads(b, 2)
        assert b.eval("[flamed.state.start, flamed.state.end]") == [T0_MS, T0_MS + 300_000]
        names = _names(b)
        assert "func_a" in names and "func_b" not in names
        top = b.eval("[...document.querySelectorAll('#top tbody tr td:last-child')].map(t => t.textContent)")
        assert "func_a" in top and "func_b" not in top
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(b.eval("location.href")).query)
        assert q["start"] == [str(T0_MS)] and q["end"] == [str(T0_MS + 300_000)]

        # Compare: B = the second half -> func_b grown, func_a shrunk.
        b.eval("document.getElementById('cmpmode').click()")
        _drag(b, _cell(b, 5, 0), _cell(b, 9, 59))
        _wait_loads(b, 3)
        rows = _diff_rows(b)
        assert ["grown", "func_b"] in rows and ["shrunk", "func_a"] in rows
        titles = b.eval("[...document.getElementById('graph').contentDocument.querySelectorAll('title')].map(t => t.textContent)")
        assert any(t.startswith("func_b (") and "; +" in t for t in titles)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        b.screenshot(ARTIFACTS / "serve-compare.png")

        # URL round trip: the link reopens the same comparison.
        link = b.eval("location.href")
        assert "bstart=" in link
        b.navigate("about:blank")
        b.navigate(link)
        _wait_loads(b, 1)
        assert b.eval("[flamed.state.start, flamed.state.end, flamed.state.bstart, flamed.state.bend]") == [
            T0_MS, T0_MS + 300_000, T0_MS + 300_000, T0_MS + 600_000]
        assert _diff_rows(b) == rows

        # Filters in the URL apply to the graph and the timeline: only func_b's stacks.
        b.navigate(f"{url}?start={T0_MS}&end={T0_MS + 600_000}&include=func_b&kinds=native,python")
        _wait_loads(b, 1)
        assert b.eval("document.getElementById('include').value") == "func_b"
        names = _names(b)
        assert "func_b" in names and "func_a" not in names and "sys_read_[k]" not in names
        cells = b.eval("TL.cells")
        assert sum(map(sum, cells[:5])) == 0 and sum(map(sum, cells[5:])) > 0
        b.screenshot(ARTIFACTS / "serve-filtered.png")
        # Download links carry the range and the filters.
        href = b.eval("document.querySelector('.dl-pprof').href")
        assert "include=func_b" in href and f"start={T0_MS}" in href


def test_serve_page_live_refresh(serve_browser: Browser, tmp_path: Path) -> None:
    """The open page's timeline takes in files the daemon writes while it is shown."""
    state = tmp_path / "state"
    write_state_dir(state, files=4)
    b = serve_browser
    with serve("--state-dir", str(state)) as url:
        b.navigate(url)
        _wait_loads(b, 1)
        assert b.eval("[TL.view, TL.cols]") == ["heatmap", 4]
        write_state_dir(state, files=2, t0=T0 + 240 * NS)
        b.wait_for("TL.cols === 6", timeout=30)
        cells = b.eval("TL.cells")
        assert sum(cells[4]) == sum(cells[0]) > 0
        assert "(6 files)" in b.eval("document.getElementById('source').textContent")


def test_serve_page_thread_filter_url(serve_browser: Browser, tmp_path: Path) -> None:
    """tid from the URL fills its box and filters the graph and the timeline; a typed tid goes to the URL."""
    state = tmp_path / "state"
    write_state_dir(state, files=4, root_frame="tid")
    b = serve_browser
    with serve("--state-dir", str(state)) as url:
        b.navigate(f"{url}?start={T0_MS}&end={T0_MS + 240_000}&tid=4243")
        _wait_loads(b, 1)
        assert b.eval("document.getElementById('tid').value") == "4243"
        names = _names(b)
        assert "common" in names and "func_a" not in names and "func_b" not in names
        assert sum(map(sum, b.eval("TL.cells"))) == 4 * 60 * 3
        # Typed in the box and applied: the thread running the functions, in the URL.
        b.eval("document.getElementById('tid').value = '4242'; document.getElementById('apply').click()")
        _wait_loads(b, 2)
        names = _names(b)
        assert {"func_a", "func_b"} <= names and "common" not in names
        assert sum(map(sum, b.eval("TL.cells"))) == 4 * 60 * 97
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(b.eval("location.href")).query)
        assert q["tid"] == ["4242"]


def _in_graph(b: Browser, selector_js: str) -> tuple[float, float]:
    """Page coordinates of the centre of an element of the embedded graph."""
    x, y = b.eval("(() => { const f = document.getElementById('graph'); const fr = f.getBoundingClientRect();"
                  f" const e = ({selector_js})(f.contentWindow, f.contentDocument); const r = e.getBoundingClientRect();"
                  " return [fr.x + f.clientLeft + r.x + r.width / 2, fr.y + f.clientTop + r.y + r.height / 2]; })()")
    return x, y


def test_serve_page_search_zoom_url(serve_browser: Browser, tmp_path: Path) -> None:
    """The graph's search and zoom, done in the graph with the mouse, go to the page URL; the link reopens them."""
    state = tmp_path / "state"
    write_state_dir(state, files=4)
    b = serve_browser
    with serve("--state-dir", str(state)) as url:
        b.navigate(f"{url}?start={T0_MS}&end={T0_MS + 240_000}")
        _wait_loads(b, 1)
        _names(b)
        # Search with the graph's own button and prompt.
        b.click_nowait(*_in_graph(b, "(w, d) => d.getElementById('search')"))
        b.answer_prompt("^func_")
        b.wait_for("new URLSearchParams(location.search).get('search') === '^func_'")
        # Zoom: click the box of "run".
        b.click(*_in_graph(b, "(w, d) => w.F.find(f => f.name === 'run').r"))
        b.wait_for("new URLSearchParams(location.search).get('zoom') !== null")
        link = b.eval("location.href")
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(link).query)
        zoom = int(q["zoom"][0])
        matched = b.eval("document.getElementById('graph').contentDocument.getElementById('matched').textContent")
        assert matched.startswith("Matched: ") and "of view" in matched

        b.navigate("about:blank")
        b.navigate(link)
        _wait_loads(b, 1)
        g = "document.getElementById('graph').contentWindow"
        b.wait_for(f"{g}.F && {g}.F.length > 0")
        assert b.eval(f"{g}.searchRe && {g}.searchRe.source") == "^func_"
        assert b.eval(f"{g}.F[{zoom}].name") == "run"
        assert b.eval(f"[{g}.view.x, {g}.view.w]") == b.eval(f"[{g}.F[{zoom}].x, {g}.F[{zoom}].w]")
        assert b.eval(f"{g}.document.getElementById('matched').textContent") == matched
        # Escape in the graph resets both: gone from the URL too.
        b.click(*_in_graph(b, "(w, d) => w.F.find(f => f.name === 'run').r"))
        b.key("Escape", 27)
        b.wait_for("!location.search.includes('search=') && !location.search.includes('zoom=')")
        # Another range drops the zoom (frame indices of another graph) and keeps the search.
        b.eval(f"document.getElementById('graph').contentWindow.search('func_b')")
        b.wait_for("new URLSearchParams(location.search).get('search') === 'func_b'")
        _drag(b, _cell(b, 2, 0), _cell(b, 3, 59))
        _wait_loads(b, 2)
        b.wait_for(f"{g}.searchRe && {g}.searchRe.source === 'func_b'")
        assert "search=func_b" in b.eval("location.search") and "zoom=" not in b.eval("location.search")
