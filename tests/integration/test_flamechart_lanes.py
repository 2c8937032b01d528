"""A flame chart of a multi-thread capture in a real browser: one lane per thread."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdp import Browser, chromium_path
from support import ARTIFACTS, DATA, need
from flamed.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    need(chromium_path() is not None, "chromium (Debian package chromium)")
    b = Browser(tmp_path / "chromium-profile")
    try:
        yield b
    finally:
        b.close()


def test_flamechart_has_one_lane_per_thread(browser: Browser, tmp_path: Path) -> None:
    src = tmp_path / "perf.txt"
    with gzip.open(DATA / "perf" / "c-default.txt.gz", "rb") as f:
        src.write_bytes(f.read())  # 4 threads of one process, samples interleaved in time
    svg = tmp_path / "chart.svg"
    assert main(["svg", "--flamechart", "--minwidth", "0", "-o", str(svg), str(src)]) == 0
    b = browser
    b.navigate(svg.as_uri())
    b.wait_for("typeof F !== 'undefined' && F.length > 0")
    # The boxes right above "all", as the page's script sees them (name, x, width).
    lanes = b.eval(
        "(() => { const all = F.find(f => f.name === 'all');"
        " return F.filter(f => Math.abs(f.y - (all.y - fh)) < 0.5).map(f => [f.name, f.x, f.w]); })()"
    )
    names = [n for n, _, _ in lanes]
    assert sorted(names) == ["hot-?/11166", "job:2-?/11170", "worker 0-?/11168", "worker 1-?/11169"], names
    # Lanes tile the width, side by side in the order the threads first ran.
    lanes.sort(key=lambda x: x[1])
    total = b.eval("total")
    assert lanes[0][1] == 0 and all(abs(a[1] + a[2] - c[1]) < 1e-6 for a, c in zip(lanes, lanes[1:]))
    assert abs(lanes[-1][1] + lanes[-1][2] - total) < 1e-6
    # Within a lane a thread's runs of one function are one box: far fewer boxes than samples.
    n_samples = src.read_bytes().count(b"\n\n")
    assert b.eval("F.length") < n_samples
    worker = b.eval("F.filter(f => f.name === 'worker').length")
    assert worker <= 4  # about one "worker" box per thread's lane (1,000+ when threads interleave)
    b.screenshot(ARTIFACTS / "flamechart-lanes.png")
