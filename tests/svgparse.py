"""Reading a flamed SVG back: its boxes with their paths, and the brute-force expectation."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from flamed.model import Profile, Stack, Weight

NS = {"s": "http://www.w3.org/2000/svg"}


@dataclass(frozen=True)
class ParsedBox:
    #: The frame's name, with the ``_[k]``-style annotation the title leaves out (``data-a``).
    name: str
    #: The tooltip as written: the name as shown, then its weight and share.
    title: str
    x: float
    width: float
    y: float
    fill: str
    #: The weight: the rect's width, or (when the drawing is scaled) the title's count.
    weight: float


def parse_svg(data: bytes) -> tuple[ET.Element, list[ParsedBox]]:
    root = ET.fromstring(data)
    fv = root.find(".//s:svg[@id='fv']", NS)
    assert fv is not None, "no #fv group of boxes"
    scaled = fv.get("data-per-unit") is not None
    boxes = []
    # A box is a <g>, or an <a> when --nameattr made it a link.
    for g in (e for e in fv if e.tag in (f"{{{NS['s']}}}g", f"{{{NS['s']}}}a")):
        title = g.find("s:title", NS)
        rect = g.find("s:rect", NS)
        assert title is not None and rect is not None
        text = title.text or ""
        width = float(rect.get("width", "nan"))
        if scaled:
            m = re.search(r" \(([\d,.]+) [^(]*\)$", text)
            assert m is not None, text
            weight = float(m.group(1).replace(",", ""))
        else:
            weight = width
        # data-n: the name, when --nameattr replaced the tooltip text.
        name = g.get("data-n")
        if name is None:
            name = text[: text.rindex(" (")]
        annotation = g.get("data-a")
        if annotation is not None:
            name += f"_[{annotation}]"
        boxes.append(
            ParsedBox(
                name=name,
                title=text,
                x=float(rect.get("x", "nan")),
                width=width,
                y=float(rect.get("y", "nan")),
                fill=rect.get("fill", ""),
                weight=weight,
            )
        )
    return root, boxes


def box_paths(boxes: list[ParsedBox], inverted: bool = False) -> dict[Stack, float]:
    """Each box's path from the root (found by geometry: the parent is one row nearer
    the root and spans it) to its width. Fails if a box has no parent or two boxes
    share a path (a split frame)."""
    ys = sorted({b.y for b in boxes}, reverse=not inverted)
    depth_of = {y: i for i, y in enumerate(ys)}
    rows: dict[int, list[ParsedBox]] = {}
    for b in boxes:
        rows.setdefault(depth_of[b.y], []).append(b)
    paths: dict[int, Stack] = {}
    out: dict[Stack, float] = {}
    for d in sorted(rows):
        for b in sorted(rows[d], key=lambda b: b.x):
            if d == 0:
                path: Stack = (b.name,)
            else:
                parents = [p for p in rows[d - 1] if p.x <= b.x + 1e-9 and b.x + b.width <= p.x + p.width + 1e-6]
                assert len(parents) == 1, f"box {b.name!r} at depth {d} has {len(parents)} parents"
                path = paths[id(parents[0])] + (b.name,)
            assert path not in out, f"frame {path} drawn twice"
            paths[id(b)] = path
            out[path] = b.weight
    return out


def expected_paths(profile: Profile, min_weight: float = 0.0) -> dict[Stack, Weight]:
    """Brute force: every prefix of every stack, with the weight below it."""
    out: dict[Stack, Weight] = {}
    total: Weight = 0
    for stack, w in profile.stacks.items():
        if w <= 0:
            continue
        total += w
        for d in range(1, len(stack) + 1):
            k = ("all",) + stack[:d]
            out[k] = out.get(k, 0) + w
    out[("all",)] = total
    return {k: v for k, v in out.items() if v >= min_weight}
