#!/usr/bin/env python3
"""Seconds headless Chromium takes to open a flamed SVG until its script is ready.

    bench/chromium_open.py graph.svg [runs]

Measured from Page.navigate to the moment the script has indexed every box
(``F.length`` equals the number of boxes), median of ``runs`` (default 3).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cdp import Browser  # noqa: E402


def main() -> int:
    svg = Path(sys.argv[1]).resolve()
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    n_boxes = svg.read_bytes().count(b"<g><title>")
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        b = Browser(Path(tmp) / "profile", timeout=120)
        try:
            for i in range(runs):
                b.navigate("about:blank")
                t0 = time.monotonic()
                b.navigate(svg.as_uri() + f"?run={i}")
                b.wait_for(f"typeof F !== 'undefined' && F.length === {n_boxes}", timeout=120)
                times.append(time.monotonic() - t0)
        finally:
            b.close()
    print(f"{statistics.median(times):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
