"""Pull: ``/debug/pprof/profile?seconds=N`` of a real daemon, read by ``go tool pprof`` itself.

Real BPF daemon, a C workload with a known function, Go's own pprof as the
client (Debian golang-go; packaging/setup.sh --test installs it).  Every
daemon, workload and scraper is gone when a test ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemonproc import metric_value
from support import need, write_config

from flamed.outputs.pprof import read_pprof, top_functions

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

SPIN_C = r"""
#include <stdint.h>
volatile uint64_t sink;
__attribute__((noinline)) void fleet_marker_spin(void) {
    uint64_t x = 1;
    for (long i = 0; i < 2000000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
    sink += x;
}
int main(void) { for (;;) fleet_marker_spin(); }
"""


@pytest.fixture
def spinner(tmp_path: Path) -> Any:
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev) to build the workload")
    src = tmp_path / "spin.c"
    src.write_text(SPIN_C)
    exe = tmp_path / "fleetspin"
    subprocess.run([str(gcc), "-O1", "-fno-omit-frame-pointer", "-o", str(exe), str(src)], check=True, timeout=60)
    p = subprocess.Popen([str(exe)], start_new_session=True)
    try:
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def go_pprof() -> str:
    go = shutil.which("go")
    need(go is not None, "go (Debian golang-go) for `go tool pprof`")
    assert go is not None
    return go


def run_pprof(go: str, tmp: Path, *args: str, timeout: float = 120) -> str:
    env = dict(os.environ, PPROF_TMPDIR=str(tmp / "pprof"), HOME=str(tmp), PPROF_BINARY_PATH="/nonexistent")
    r = subprocess.run([go, "tool", "pprof", *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_go_tool_pprof_pulls_a_profile_of_the_next_seconds(tmp_path: Path, require_bpf: None, daemon_factory: Any,
                                                          spinner: subprocess.Popen[bytes]) -> None:
    go = go_pprof()
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0}, output={"root_frame": "pid"})
    d.wait_for(lambda: d.status()["windows"] >= 2, 30, "two windows")
    addr = d.status()["metrics"]
    seconds = 4
    out = run_pprof(go, tmp_path, "-top", "-sample_index=samples",
                    f"http://{addr}/debug/pprof/profile?seconds={seconds}")
    saved = sorted((tmp_path / "pprof").glob("*.pb.gz"))
    assert saved, out  # pprof keeps what it fetched: the bytes we check below
    # go tool pprof lists the workload's function, with the count our own reader finds in the bytes
    m = re.search(r"^\s*(\d+)\s+[\d.]+%\s+[\d.]+%\s+(\d+)\s+[\d.]+%\s+fleet_marker_spin$", out, re.M)
    assert m, out
    prof = read_pprof(saved[-1].read_bytes())
    flat, cum = top_functions(prof)["fleet_marker_spin"]
    assert (int(m.group(1)), int(m.group(2))) == (flat, cum), out
    # the samples of those seconds: one thread on a CPU at 99 Hz gives at most 99 a second
    # (+ one drain spacing), and it runs most of the time
    assert prof.start_ns is not None and prof.end_ns is not None
    span = (prof.end_ns - prof.start_ns) / 1e9
    assert seconds - 0.5 <= span <= seconds + 1.5, span
    spin = sum(w for s, w in prof.stacks.items() if s[0] == f"fleetspin-{spinner.pid}")
    assert cum <= spin <= 99 * (span + 0.3), (spin, span)
    assert spin >= 99 * span * 0.3, (spin, span)
    assert re.search(r"Duration: [\d.]+s", out), out
    # labels: a backend filters by them
    tags = run_pprof(go, tmp_path, "-tags", str(saved[-1]))
    for label in ("comm:", "pid:", "thread:", "host:"):
        assert label in tags, tags
    assert re.search(rf"\b{spinner.pid}\b", tags) and "fleetspin" in tags, tags
    assert d.status()["host"] in tags, tags
    only = run_pprof(go, tmp_path, "-top", "-sample_index=samples", "-tagfocus=comm=fleetspin",
                     str(saved[-1]))
    assert "fleet_marker_spin" in only, only
    assert d.metric("flamed_pprof_requests_total", {"result": "ok"}) == 1


def _scrape(addr: str, seconds: int, out: list[Any]) -> None:
    try:
        with urllib.request.urlopen(f"http://{addr}/debug/pprof/profile?seconds={seconds}",
                                    timeout=seconds + 60) as r:
            out.append((r.status, r.read()))
    except Exception as e:  # noqa: BLE001 - reported by the assertion
        out.append(e)


def test_concurrent_and_stuck_scrapers_never_delay_a_drain(tmp_path: Path, require_bpf: None,
                                                           daemon_factory: Any,
                                                           spinner: subprocess.Popen[bytes]) -> None:
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0})
    d.wait_for(lambda: d.status()["windows"] >= 2, 30, "two windows")
    addr = d.status()["metrics"]
    host, port = addr.rsplit(":", 1)
    before = d.metrics_text()
    windows0 = d.status()["windows"]
    stuck: list[socket.socket] = []
    try:
        # two scrapers that ask and never read (a tiny receive buffer), one that never asks
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.connect((host, int(port)))
            s.sendall(f"GET /debug/pprof/profile?seconds=3 HTTP/1.1\r\nHost: {addr}\r\n\r\n".encode())
            stuck.append(s)
        idle = socket.socket()
        idle.connect((host, int(port)))
        stuck.append(idle)
        results: list[Any] = []
        threads = [threading.Thread(target=_scrape, args=(addr, 6, results)) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        after = d.metrics_text()
        windows1 = d.status()["windows"]
    finally:
        for s in stuck:
            s.close()
    assert len(results) == 10 and all(isinstance(r, tuple) and r[0] == 200 for r in results), results
    for _, body in results:
        p = read_pprof(body)
        assert p.total() > 0 and p.start_ns is not None and p.end_ns is not None
        assert 5.5e9 <= p.end_ns - p.start_ns <= 7.5e9
    # the drain kept its 1 s grid: ~6 s passed, and no drain started a whole interval late
    assert windows1 - windows0 >= 5, (windows0, windows1)
    late = (metric_value(after, "flamed_drain_lateness_seconds_count")
            - metric_value(after, "flamed_drain_lateness_seconds_bucket", {"le": "1.0"}))
    late_before = (metric_value(before, "flamed_drain_lateness_seconds_count")
                   - metric_value(before, "flamed_drain_lateness_seconds_bucket", {"le": "1.0"}))
    assert late == late_before, (late_before, late)
    assert metric_value(after, "flamed_drain_errors_total") == 0
    # the daemon still answers and stops cleanly with the stuck connections gone
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_pull_request_checks(tmp_path: Path, daemon_factory: Any) -> None:
    """Bad seconds, too many at once, and off: answered at once, with what to do."""
    d = daemon_factory(sampling={"sampler": "fake", "drain_interval": 1.0},
                       metrics={"address": "127.0.0.1:0", "pprof_max_seconds": 20, "pprof_max_requests": 1})
    addr = d.status()["metrics"]

    def get(q: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://{addr}/debug/pprof/profile{q}", timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        urllib.request.urlopen(f"http://{addr}/debug/pprof/heap", timeout=10)
        raise AssertionError("heap served")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and b"/debug/pprof/profile" in e.read()
    code, body = get("?seconds=21")
    assert code == 400 and b"metrics.pprof_max_seconds" in body
    assert get("?seconds=abc")[0] == 400
    assert get("?seconds=-1")[0] == 400
    # Plain decimals only (float() took "1_0" for 10 s, "+1", " 1", other scripts' digits).
    for q in ("1_0", "%2B1", "%201", "%D9%A1", "1%00", "1e1", "inf", "nan", "0"):
        code, body = get(f"?seconds={q}")
        assert code == 400 and b"metrics.pprof_max_seconds" in body, (q, code, body)
    assert b"\\x00" in get("?seconds=1%00")[1]  # said so that it can be seen
    # HEAD would wait the whole profile for its headers: refused like other methods.
    req = urllib.request.Request(f"http://{addr}/debug/pprof/profile?seconds=1", method="HEAD")
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("HEAD took a profile")
    except urllib.error.HTTPError as e:
        assert e.code == 405
    # The metrics at /metrics (and /), not at any path: a misconfigured scrape gets a 404.
    for path, want in (("/metrics", 200), ("/", 200), ("/METRICS", 404), ("/foo", 404)):
        try:
            with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
                code, body = r.status, r.read()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read()
        assert code == want, (path, code)
        assert (b"flamed_build_info" in body) == (want == 200), path
    held: list[Any] = []
    t = threading.Thread(target=_scrape, args=(addr, 3, held))
    t.start()
    d.wait_for(lambda: _waiting(addr), 10, "a profile request waiting")
    code, body = get("?seconds=1")
    t.join(60)
    assert code == 429 and b"metrics.pprof_max_requests" in body, body
    assert held and held[0][0] == 200 and read_pprof(held[0][1]).total() > 0
    # off by config (and on again) on reload
    d.config["metrics"]["pprof"] = False

    write_config(d.cfg_path, d.config)
    d.signal(signal.SIGHUP)
    d.wait_for(lambda: d.metric("flamed_config_reloads_total", {"result": "ok"}) >= 1, 30, "the reload")
    code, body = get("?seconds=1")
    assert code == 404 and b"metrics.pprof" in body
    assert d.metric("flamed_pprof_requests_total", {"result": "off"}) == 1
    assert d.metric("flamed_pprof_requests_total", {"result": "busy"}) == 1


def _waiting(addr: str) -> bool:
    """A profile request is waiting for its seconds to pass."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return metric_value(r.read().decode(), "flamed_pprof_waiting") == 1
