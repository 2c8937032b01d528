"""``flamed serve``'s memory and request times over a store of many daemon files.

Writes N one-minute files shaped like a busy host's (tests/servedata.py:
about 700 KB of folded text each, stacks up to 905 frames deep), starts
``flamed serve --state-dir`` on them and asks 20 ranges (1 min to 4 h, the
page's three requests each: timeline, graph SVG, top table), then the
largest range again.  Prints the server's RSS (VmRSS now, VmHWM the peak),
the median and largest time of a range, the repeat's time and the files
parsed (from ``/api/status``: a repeat within the cache parses none).

    .venv/bin/python bench/serve_memory.py --files 1440 --cache-mb 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from servedata import T0, write_busy_state_dir  # noqa: E402

T0_MS = T0 // 1_000_000
SPANS_MIN = (1, 5, 15, 60, 240)


def rss_kb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    return out


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=600) as r:
        return r.read()  # type: ignore[no-any-return]


def ranges(files: int, n: int = 20, seed: int = 12) -> list[tuple[int, int]]:
    """n ranges of 1 min .. 4 h (at most the store) at random places, the largest last."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        span = min(files, SPANS_MIN[i % len(SPANS_MIN)])
        first = rng.randint(0, files - span)
        out.append((T0_MS + first * 60_000, T0_MS + (first + span) * 60_000))
    out.sort(key=lambda r: r[1] - r[0])
    return out


def ask_range(base: str, lo: int, hi: int) -> float:
    t = time.monotonic()
    q = f"start={lo}&end={hi}"
    get(f"{base}api/timeline?start={T0_MS}&end={hi}")
    get(f"{base}api/profile?{q}&format=svg&minwidth=0.5")
    get(f"{base}api/top?{q}")
    return time.monotonic() - t


def status(base: str) -> dict[str, int]:
    try:
        return json.loads(get(base + "api/status"))  # type: ignore[no-any-return]
    except urllib.error.HTTPError:
        return {}  # a flamed before the endpoint (to compare)


def run(state: Path, files: int, cache_mb: float | None) -> dict[str, object]:
    extra = [] if cache_mb is None else ["--cache-mb", str(cache_mb)]
    proc = subprocess.Popen([sys.executable, "-m", "flamed", "serve", "--state-dir", str(state), "--address",
                             "127.0.0.1:0", *extra], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        base = proc.stdout.readline().split()[2]
        start_rss = rss_kb(proc.pid)
        times = [ask_range(base, lo, hi) for lo, hi in ranges(files)]
        before = status(base)
        lo, hi = ranges(files)[-1]
        repeat = ask_range(base, lo, hi)
        after = status(base)
        return {"files": files, "cache_mb": cache_mb, "rss_start_mb": start_rss["VmRSS"] / 1024,
                **{k.lower() + "_mb": v / 1024 for k, v in rss_kb(proc.pid).items()},
                "range_median_s": statistics.median(times), "range_max_s": max(times),
                "largest_range_min": (hi - lo) // 60_000, "repeat_s": repeat,
                "parses": before.get("parses"),
                "repeat_parses": after["parses"] - before["parses"] if after else None,
                "cache_files": after.get("cache_files"), "cache_mb_used": after.get("cache_bytes", 0) / 2**20}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=240, help="one-minute files in the store (1440: a day)")
    ap.add_argument("--cache-mb", type=float, help="flamed serve --cache-mb (default: its own)")
    ap.add_argument("--state-dir", type=Path, help="reuse (or write once) the store here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flamed-serve-bench-") as tmp:
        state = args.state_dir or Path(tmp) / "state"
        if not (state.exists() and any(state.glob("*.folded"))):
            t = time.monotonic()
            write_busy_state_dir(state, args.files)
            print(f"wrote {args.files} files in {time.monotonic() - t:.1f}s", file=sys.stderr)
        size = sum(p.stat().st_size for p in state.glob("*.folded"))
        r = run(state, args.files, args.cache_mb)
        r["store_mb"] = size / 2**20
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, indent=1))


if __name__ == "__main__":
    main()
