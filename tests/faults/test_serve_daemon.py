"""``flamed serve`` over the state directory of a real daemon run (real BPF
sampler, Python frames read by the program), in headless Chromium: a
workload that runs func_a, then func_b; the page shows each phase's range
with its own function only, and the comparison says which grew and shrank.

(tests/integration/test_serve_chromium.py drives the page's gestures on
files written by the daemon's store code; this one checks the whole chain,
from samples to the page, on files the daemon wrote.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cdp import Browser
from serveproc import serve
from support import ARTIFACTS

pytestmark = pytest.mark.slow

PHASE_S = 7.0
WORK = f"""
import time
def func_a(end):
    while time.time() < end:
        pass
def func_b(end):
    while time.time() < end:
        pass
t0 = time.time()
print(t0, flush=True)
func_a(t0 + {PHASE_S})
t1 = time.time()
print(t1, flush=True)
func_b(t1 + {PHASE_S})
"""


def _wait_loads(b: Browser, n: int) -> None:
    b.wait_for(f"window.flamed && window.flamed.loads >= {n}")
    assert b.eval("window.flamed.error") is None


def _names(b: Browser) -> set[str]:
    b.wait_for("(() => { const w = document.getElementById('graph').contentWindow; return w && w.F && w.F.length > 0; })()")
    return set(b.eval("[...document.getElementById('graph').contentWindow.F].map(f => f.name)"))


def _has(names: Any, func: str) -> bool:
    return any(str(n).startswith(func + " (") for n in names)


def test_serve_a_real_daemon_run(require_bpf: None, daemon_factory: Any, serve_browser: Browser, tmp_path: Path) -> None:
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0}, output={"rotate_interval": 2.0})
    script = tmp_path / "phases.py"
    script.write_text(WORK)
    work = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert work.stdout is not None
        t0, t1 = float(work.stdout.readline()), float(work.stdout.readline())
        assert work.wait(timeout=60) == 0
    finally:
        if work.poll() is None:
            work.kill()
            work.wait()
    time.sleep(1.5)  # the last window of func_b drained
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    ms = lambda t: int(t * 1000)  # noqa: E731
    # Files are the daemon's finest stack resolution (2 s here): ranges kept 2.5 s from the switch.
    a0, a1 = ms(t0 + 0.5), ms(t1 - 2.5)
    b0, b1 = ms(t1 + 2.5), ms(t1 + PHASE_S - 0.5)
    b = serve_browser
    with serve("--state-dir", str(d.state_dir)) as url:
        b.navigate(f"{url}?start={a0}&end={a1}&pid={work.pid}")
        _wait_loads(b, 1)
        names = _names(b)
        assert _has(names, "func_a") and not _has(names, "func_b"), sorted(names)[:40]
        top = b.eval("[...document.querySelectorAll('#top tbody tr td:last-child')].map(t => t.textContent)")
        assert _has(top, "func_a") and not _has(top, "func_b"), top
        b.navigate(f"{url}?start={b0}&end={b1}&pid={work.pid}")
        _wait_loads(b, 1)
        names = _names(b)
        assert _has(names, "func_b") and not _has(names, "func_a"), sorted(names)[:40]
        # Compare A -> B: func_b grew, func_a shrank.
        b.navigate(f"{url}?start={a0}&end={a1}&bstart={b0}&bend={b1}&pid={work.pid}")
        _wait_loads(b, 1)
        rows = b.eval("[...document.querySelectorAll('#top tbody tr')].map(r => [r.className, r.lastChild.textContent])")
        assert any(c == "grown" and n.startswith("func_b (") for c, n in rows), rows
        assert any(c == "shrunk" and n.startswith("func_a (") for c, n in rows), rows
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        b.screenshot(ARTIFACTS / "serve-daemon-compare.png")
        # The timeline of the run: samples in both phases' seconds.
        tl = b.eval("TL")
        assert tl["view"] == "heatmap" and sum(map(sum, tl["cells"])) > 0
