#!/usr/bin/env python3
"""Compare two flame graph SVGs frame by frame (developer check against flamegraph.pl).

Both are reduced to a multiset of (depth, name, samples): flamegraph.pl's from
its ``<title>name (N samples, P%)</title>`` and rect y, flamed's the same way.
Prints the number of frames of each and any difference; exits 1 on a difference.

    bench/svgcheck.py ours.svg flamegraph.svg
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

_ANNOTATION = re.compile(r"_\[[kjiw]\]$")
_TITLE = re.compile(r"^(?P<name>.*) \((?P<n>[\d,.]+) [^,]*, [\d.]+%(?:; [-+][\d.]+%)?\)$", re.S)


def frames(path: str) -> Counter[tuple[int, str, float]]:
    root = ET.parse(path).getroot()
    rows: list[tuple[float, str, float]] = []
    for g in root.iter("{http://www.w3.org/2000/svg}g"):
        title = g.find("{http://www.w3.org/2000/svg}title")
        rect = g.find("{http://www.w3.org/2000/svg}rect")
        if title is None or rect is None or title.text is None:
            continue
        m = _TITLE.match(title.text)
        if m is None:
            continue
        # flamegraph.pl shows annotated names without their _[k]/_[j]/_[i]/_[w] suffix; flamed keeps it.
        name = _ANNOTATION.sub("", m.group("name"))
        rows.append((float(rect.get("y", "0")), name, float(m.group("n").replace(",", ""))))
    ys = sorted({y for y, _, _ in rows}, reverse=True)  # flame graphs: root at the bottom
    depth = {y: i for i, y in enumerate(ys)}
    return Counter((depth[y], name, n) for y, name, n in rows)


def main() -> int:
    a, b = frames(sys.argv[1]), frames(sys.argv[2])
    print(f"frames: {sys.argv[1]}: {sum(a.values())}, {sys.argv[2]}: {sum(b.values())}")
    only_a, only_b = a - b, b - a
    for k in sorted(only_a)[:10]:
        print("only in first: ", k)
    for k in sorted(only_b)[:10]:
        print("only in second:", k)
    if only_a or only_b:
        print(f"DIFFERENT: {sum(only_a.values())} / {sum(only_b.values())} frames differ")
        return 1
    print("same frames, same widths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
