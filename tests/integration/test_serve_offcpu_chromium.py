"""``flamed serve``'s page on a daemon directory with off-CPU files: a profile selector, kinds never mixed.

The state directory is written by the daemon's store (CPU and off-CPU periods
side by side, as a daemon with ``[sampling] off_cpu = true`` writes them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cdp import Browser
from servedata import NS, T0
from serveproc import serve

from flamed.daemon.config import OutputConfig, RetentionConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.store import ProfileStore

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]


def write_both(path: Path, files: int = 3) -> None:
    store = ProfileStore(OutputConfig(state_dir=str(path), fsync=False, host="testhost", root_frame="pid"),
                         RetentionConfig(max_files=0, max_bytes=0, max_age=0), DaemonMetrics(process=False),
                         clock_ns=lambda: T0)
    for i in range(files):
        for j in range(60):
            start = T0 + (i * 60 + j) * NS
            store.add(start, start + NS, {(42, 42, "work", ("main", "crunch")): 97}, 97, {}, 99.0)
            # 0.5 s a second blocked in wait_for_reply
            store.add_offcpu(start, start + NS, {(42, 43, "work", ("main", "wait_for_reply", "[off-cpu: blocked]")):
                                                 500_000_000})
        assert store.rotate() is not None


def _graph_names(b: Browser) -> set[str]:
    b.wait_for("(() => { const w = document.getElementById('graph').contentWindow; return w && w.F && w.F.length > 0; })()")
    return set(b.eval("[...document.getElementById('graph').contentWindow.F].map(f => f.name)"))


def test_profile_selector_switches_between_cpu_and_offcpu(serve_browser: Browser, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_both(state)
    b = serve_browser
    with serve("--state-dir", str(state)) as url:
        b.navigate(url)
        b.wait_for("window.flamed && window.flamed.loads >= 1")
        assert b.eval("window.flamed.error") is None
        # both kinds present: the selector shows; CPU by default, samples, no off-CPU frame
        assert b.eval("document.getElementById('profile-box').hidden") is False
        names = _graph_names(b)
        assert "crunch" in names and "wait_for_reply" not in names, names
        assert b.eval("window.flamed.axes.legend.unit") == "samples"
        assert "(3 files)" in b.eval("document.getElementById('source').textContent")
        cpu_cells = sum(map(sum, b.eval("TL.cells")))
        assert abs(cpu_cells - 3 * 60 * 97) < 1e-6
        # off-CPU from the URL: the graph, legend and timeline are of microseconds off the CPU
        b.navigate(url + "?profile=offcpu")
        b.wait_for("window.flamed && window.flamed.loads >= 1")
        assert b.eval("window.flamed.error") is None
        assert b.eval("document.getElementById('profile').value") == "offcpu"
        names = _graph_names(b)
        assert "wait_for_reply" in names and "[off-cpu: blocked]" in names and "crunch" not in names, names
        assert b.eval("window.flamed.axes.legend.unit") == "us off-CPU"
        assert "3 off-CPU files" in b.eval("document.getElementById('source').textContent")
        assert abs(sum(map(sum, b.eval("TL.cells"))) - 3 * 60 * 500_000) < 1
        svg = b.eval("document.getElementById('graph').contentDocument.documentElement.outerHTML")
        assert "µs" in svg
        # the selector back to CPU, then apply: the URL drops the parameter
        b.eval("document.getElementById('profile').value = 'cpu'; document.getElementById('apply').click()")
        b.wait_for("window.flamed.loads >= 2")
        b.wait_for("!location.search.includes('profile=')")
        assert "crunch" in _graph_names(b)
