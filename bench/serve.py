"""flamed serve on 24 h of daemon files: time to the timeline, to a 1 h range, server RSS.

1,440 one-minute files (60 windows of 1 s each) are written with the daemon's
own store writer; each holds STACKS distinct stacks ~20 frames deep (a mix of
native, kernel and Python frames over 40 tasks).  Times are wall clock over
HTTP on loopback: server start until it listens (the index), the 24 h
timeline JSON, then a 1 h range as SVG cold (files parsed) and warm (cached),
and the 1 h top table.  Then, on a fresh server, the page in headless Chromium
(tests/cdp.py): time from navigation until the 24 h timeline is painted, and
until the opening 1 h range's flame graph is drawn in the page, cold and warm,
and another hour picked in the page.

  .venv/bin/python bench/serve.py [--files 1440] [--stacks 400] [--no-browser]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.daemon.config import OutputConfig, RetentionConfig  # noqa: E402
from flamed.daemon.metrics import DaemonMetrics  # noqa: E402
from flamed.daemon.store import ProfileStore  # noqa: E402

NS = 1_000_000_000


def generate(path: Path, files: int, stacks: int) -> None:
    rnd = random.Random(1)
    funcs = [f"lib{i % 7}::module{i % 13}::function_{i}" for i in range(600)]
    pyf = [f"handler_{i} (app/service/mod{i % 9}.py:{10 + i})" for i in range(200)]
    pool = []
    for i in range(stacks * 3):
        depth = rnd.randint(8, 28)
        st = ["_start", "__libc_start_main", "main"] + [rnd.choice(funcs if rnd.random() < 0.6 else pyf) for _ in range(depth)]
        if rnd.random() < 0.3:
            st += ["entry_SYSCALL_64_[k]", "do_syscall_64_[k]", rnd.choice(["ksys_read_[k]", "do_futex_[k]", "tcp_sendmsg_[k]"])]
        pool.append((1000 + i % 40, 1000 + i % 40, f"svc{i % 40}", tuple(st)))
    t0 = 1_700_000_000 * NS // (60 * NS) * (60 * NS)
    store = ProfileStore(OutputConfig(state_dir=str(path), fsync=False, host="bench"),
                         RetentionConfig(max_files=0, max_bytes=0, max_age=0), DaemonMetrics(process=False),
                         clock_ns=lambda: t0)
    for i in range(files):
        base = rnd.randrange(0, len(pool) - stacks)
        keys = pool[base:base + stacks]
        for j in range(60):
            start = t0 + (i * 60 + j) * NS
            counts = {k: rnd.randint(1, 6) for k in rnd.sample(keys, min(len(keys), 60))}
            store.add(start, start + NS, counts, sum(counts.values()), {}, 99.0)
        store.rotate()


def get(url: str) -> tuple[float, int]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as r:
        n = len(r.read())
    return time.perf_counter() - t, n


def rss_kb(pid: int) -> tuple[int, int]:
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            vals[k] = int(v.split()[0])
    return vals["VmRSS"], vals["VmHWM"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=1440)
    ap.add_argument("--stacks", type=int, default=400)
    ap.add_argument("--no-browser", action="store_true", help="server-side figures only")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        generate(Path(d), a.files, a.stacks)
        size = sum(p.stat().st_size for p in Path(d).iterdir() if p.is_file() and not p.is_symlink())
        print(f"generated {a.files} files, {size / 1e6:.1f} MB, in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "flamed", "serve", "--state-dir", d, "--address", "127.0.0.1:0"],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().split()[2]
            listen = time.perf_counter() - t
            import json

            idx = json.loads(urllib.request.urlopen(url + "api/index", timeout=60).read())
            s, e = idx["start_ms"], idx["end_ms"]
            page, _ = get(url)
            tl, tl_n = get(url + f"api/timeline?start={s}&end={e}")
            print(f"server listening (index of {idx['files']} sidecars): {listen:.2f} s")
            print(f"page {page * 1000:.0f} ms; 24 h timeline {tl * 1000:.0f} ms ({tl_n} bytes); "
                  f"start to timeline {listen + page + tl:.2f} s")
            h0 = e - 3600_000
            cold, n = get(url + f"api/profile?format=svg&start={h0}&end={e}")
            warm, _ = get(url + f"api/profile?format=svg&start={h0}&end={e}")
            top, _ = get(url + f"api/top?start={h0}&end={e}")
            print(f"1 h range SVG: cold {cold:.2f} s, warm {warm:.2f} s ({n / 1e6:.1f} MB); top table {top:.2f} s")
            rss, hwm = rss_kb(proc.pid)
            print(f"server RSS {rss / 1024:.0f} MiB, peak {hwm / 1024:.0f} MiB")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        if not a.no_browser:
            browser_figures(d, Path(d) / ".chromium")
    return 0


def browser_figures(state_dir: str, profile_dir: Path) -> None:
    """The page in headless Chromium (tests/cdp.py) on a fresh server: time from navigation
    to the timeline drawn on screen, and to the 1 h range's graph drawn (the page opens on
    the most recent hour), cold then warm; then a 1 h range picked in the page."""
    sys.path.insert(0, str(ROOT / "tests"))
    from cdp import Browser, chromium_path

    if chromium_path() is None:
        print("chromium not installed: no browser figures")
        return
    proc = subprocess.Popen([sys.executable, "-m", "flamed", "serve", "--state-dir", state_dir, "--address", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    b = None
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[2]
        b = Browser(profile_dir, width=1400, height=1000, timeout=120)
        for run in ("cold", "warm"):
            b.navigate("about:blank")
            t = time.perf_counter()
            b.send("Page.navigate", {"url": url}, session=True)
            b.wait_for("window.flamed && window.flamed.loads >= 1 && window.flamed.firstPaintMs !== null", timeout=120)
            wall = time.perf_counter() - t
            paint, rng, err = b.eval("[flamed.firstPaintMs, flamed.rangeMs, flamed.error]")
            assert err is None, err
            print(f"browser ({run}): timeline painted {paint / 1000:.2f} s after navigation; "
                  f"1 h range drawn in the page {rng / 1000:.2f} s; all done {wall:.2f} s")
        # Another hour, picked in the page (the time boxes): the render alone.
        idx = b.eval("[IDX.start_ms, IDX.end_ms]")
        s, e = idx[1] - 3 * 3600_000, idx[1] - 2 * 3600_000
        b.eval(f"document.getElementById('from').value = new Date({s}).toISOString();"
               f"document.getElementById('to').value = new Date({e}).toISOString();"
               "document.getElementById('setrange').click()")
        b.wait_for("flamed.loads >= 2", timeout=120)
        print(f"browser: another 1 h range (cold files) drawn in the page {b.eval('flamed.rangeMs') / 1000:.2f} s")
    finally:
        if b is not None:
            b.close()
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    raise SystemExit(main())
