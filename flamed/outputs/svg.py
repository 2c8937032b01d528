"""Interactive SVG flame graphs, icicle graphs, flame charts and differentials.

The file is self-contained: its stylesheet and script are embedded, nothing is
fetched.  Without script (an ``<img>``, an image viewer) it still shows the
boxes, colors and the labels that fit; with script it adds hover details,
click-to-zoom, reset, and regex search with the matched share.

How it stays small and exact: the boxes sit in a nested ``<svg id="fv">``
whose user units are weights (``viewBox="0 0 TOTAL H"``), so a box is
``<rect x=START y=Y width=WEIGHT ...>`` in samples, integers for integer
profiles, with no rounding to pixels.  Zooming only changes that viewBox.
(Totals past 2^24, e.g. nanosecond weights, are drawn in units of total/2^24,
since browsers clamp larger coordinates; titles keep the exact weights.)
Each box carries one ``<title>`` (``name (N samples, P%)``) that the script
reads the name from -- without the ``_[k]``/``_[j]``/``_[i]``/``_[w]``
annotation, as flamegraph.pl shows names; the ``<g>``'s ``data-a`` keeps the
annotation's letter (the search matches the name with or without it); labels are emitted only for boxes wide enough to show
three characters, and the script recomputes them after a zoom.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import BinaryIO

from flamed.errors import UsageError
from flamed.layout import Box, StackTable, chart_frames, flame_frames, table_from_profile
from flamed.model import Profile, Sample, Stack, Weight, format_weight, normalize_weight, time_kind
from flamed.outputs._svgattrs import XLINK, NameAttr, read_nameattr
from flamed.outputs._timeline import lanes
from flamed.outputs.base import OutputFormat, OutputOptions
from flamed.palette import Colorer, background, diff_color, kind_color
from flamed.progress import counted

FONT_SIZE = 12
#: Average glyph width as a fraction of the font size, used to fit labels.
FONT_WIDTH = 0.59
FRAME_HEIGHT = 16
XPAD = 10
#: Most boxes too narrow to draw that are written for the search to count: past
#: it (profiles of ~100,000 distinct stacks) none are, and the file stays the
#: size of what is drawn.
HIDDEN_LIMIT = 100_000
#: Largest coordinate written into the drawing (see render_boxes).
MAX_UNITS = 1 << 24
#: OutputOptions.extra keys of flamegraph.pl's --total (the weight the width stands
#: for, after --factor), --encoding (of the XML declaration and the bytes) and
#: --nameattr (a file of attributes per function name).
TOTAL, ENCODING, NAMEATTR = "total", "encoding", "nameattr"

# Characters XML 1.0 cannot carry, plus the lone surrogates that
# surrogateescape decoding leaves for invalid UTF-8 bytes.
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def _visible(m: re.Match[str]) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:
        return "\\x%02x" % (c - 0xDC00)  # the original invalid byte, shown as \xNN
    if c < 0x100:
        return "\\x%02x" % c
    return "\\u%04x" % c


def visible_text(s: str) -> str:
    """``s`` with characters XML cannot hold (and invalid UTF-8) shown as ``\\xNN``."""
    return _UNSAFE.sub(_visible, s) if _UNSAFE.search(s) else s


def _css_string(s: str) -> str:
    """``s`` as a quoted CSS string that is also safe in the stylesheet's CDATA
    section: quotes, backslashes, ``<>&]`` (``]]>`` would end the section),
    controls and anything XML or UTF-8 cannot carry (an invalid input byte)
    become CSS escapes (``\\5d ``), which the browser reads back as the
    character."""
    out = []
    for ch in s:
        c = ord(ch)
        if c < 0x20 or c == 0x7F or ch in '"\\<>&];}' or 0xD800 <= c <= 0xDFFF or c in (0xFFFE, 0xFFFF):
            out.append("\\%x " % (c - 0xDC00 if 0xDC80 <= c <= 0xDCFF else c or 0xFFFD))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def xml_escape(s: str) -> str:
    """Text and attribute-safe escaping (``& < > "``) after :func:`visible_text`."""
    s = visible_text(s)
    if "&" in s:
        s = s.replace("&", "&amp;")
    if "<" in s:
        s = s.replace("<", "&lt;")
    if ">" in s:
        s = s.replace(">", "&gt;")
    if '"' in s:
        s = s.replace('"', "&quot;")
    if "\r" in s:
        s = s.replace("\r", "&#13;")  # else XML parsers read it back as a newline
    return s


def format_count(w: Weight) -> str:
    """``1,234`` for counts; decimals kept (at most 3) for weighted profiles."""
    w2 = format_weight(w)
    if "." not in w2:
        return f"{int(w2):,}"
    text = f"{float(w):,.3f}".rstrip("0").rstrip(".")
    return text


@functools.lru_cache(maxsize=None)
def _asset(name: str) -> str:
    text = resources.files("flamed.outputs").joinpath("_svgassets", name).read_text("utf-8")
    if "]]>" in text:  # would end the CDATA section early
        raise RuntimeError(f"asset {name} contains ']]>'")
    return text


def parse_minwidth(text: str, width: int = 1200) -> float:
    """``--minwidth`` as pixels: ``0.1`` is px, ``0.5%`` is a share of the drawing width."""
    t = text.strip()
    try:
        if t.endswith("%"):
            return float(t[:-1]) / 100.0 * (width - 2 * XPAD)
        v = float(t)
    except ValueError:
        raise UsageError(f"--minwidth: expected pixels (0.1) or a percentage (0.5%), got {text!r}") from None
    if v < 0 or math.isnan(v):
        raise UsageError("--minwidth must not be negative")
    return v


def parse_total(text: str) -> Weight | None:
    """``--total``: a positive number of samples (0: none, as flamegraph.pl)."""
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"--total: expected a number of samples, got {text!r}") from None
    if v < 0 or not math.isfinite(v):
        raise UsageError("--total must be a positive number of samples")
    return normalize_weight(v) if v else None


def graph_total(total: Weight, options: OutputOptions) -> Weight:
    """The weight the whole width stands for: ``--total`` when it is at least ``total``
    (flamegraph.pl ignores a smaller one), else ``total``."""
    want = options.extra.get(TOTAL)
    if not want:
        return total
    t = parse_total(want)
    return t if t is not None and t > total else total


def spanning(boxes: list[Box], span: Weight) -> list[Box]:
    # --total: the root stands for the whole span; the stacks fill its left part.
    if boxes and boxes[0].width != span:
        boxes[0] = dataclasses.replace(boxes[0], width=span)
    return boxes


def check_encoding(name: str) -> str:
    """``--encoding``: a name XML and Python both know, of an encoding that writes ASCII as ASCII."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9._-]*", name):
        raise UsageError(f"--encoding: {name!r} is not an encoding name")
    try:
        codecs.lookup(name)
        ascii_safe = "<?xml &#;".encode(name) == b"<?xml &#;"
    except (LookupError, UnicodeError):
        raise UsageError(f"--encoding: unknown encoding {name!r}") from None
    if not ascii_safe:
        raise UsageError(f"--encoding: {name} does not write ASCII as ASCII; use UTF-8 or an 8-bit encoding")
    return name


def min_weight(total: Weight, options: OutputOptions) -> float:
    """``options.minwidth`` (px) in weight units, for a graph of ``total``."""
    dw = options.width - 2 * XPAD
    if dw <= 0:
        raise UsageError(f"--width {options.width} is too small (need more than {2 * XPAD} px)")
    return float(options.minwidth) * float(total) / dw


def _default_title(options: OutputOptions, diff: bool) -> str:
    if options.title is not None:
        return options.title
    if diff:
        return "Differential Flame Graph"
    if options.flamechart:
        return "Flame Chart"
    if options.inverted:
        return "Icicle Graph"
    return "Flame Graph"


def render_boxes(
    boxes: Sequence[Box],
    out: BinaryIO,
    options: OutputOptions | None = None,
    *,
    diff: bool = False,
    notes: Sequence[str] = (),
    hidden: Sequence[Box] = (),
) -> None:
    """Write the SVG for laid-out ``boxes`` (root box first, as the layouts return them).

    ``hidden``: boxes left out for their width (and those under them); their
    names and extents go into the file so that a search counts their samples.
    """
    o = options or OutputOptions()
    fs, fh = o.font_size, o.frame_height
    if fh < 2 or not fs > 0 or not o.font_width > 0:
        raise UsageError("--height must be at least 2 px, --fontsize and --fontwidth positive")
    bg_top, bg_bottom = background(o.bgcolors, o.palette) if not diff else background(o.bgcolors or "#eeeeee", "")
    width = o.width
    dw = width - 2 * XPAD
    if dw <= 0:
        raise UsageError(f"--width {width} is too small (need more than {2 * XPAD} px)")
    total: Weight = boxes[0].width if boxes else 0
    max_depth = max((b.depth for b in boxes), default=0)
    subtitle = o.subtitle
    ypad1 = _num(fs * 3 + (fs * 2 if subtitle else 0))
    ypad2 = _num(fs * 2 + 10)
    height = _num((max_depth + 1) * fh + ypad1 + ypad2)
    if not boxes:
        height = _num(ypad1 + ypad2 + 2 * fh)
    colorer = Colorer(o.palette, hash=o.hash, palette_file=o.palette_file, random=o.random)
    encoding = o.extra.get(ENCODING)
    nameattr_file = o.extra.get(NAMEATTR)
    nameattr = read_nameattr(nameattr_file) if nameattr_file else {}
    countname = xml_escape(o.countname)
    max_delta = 0.0
    if diff:
        max_delta = max((abs(float(b.delta or 0)) for b in boxes[1:]), default=0.0)
    char_px = fs * o.font_width
    inverted = o.inverted

    parts: list[str] = []
    w = parts.append
    declared = f' encoding="{check_encoding(encoding)}"' if encoding else ""
    w(f'<?xml version="1.0"{declared} standalone="no"?>\n')
    w(
        f'<svg version="1.1" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'xmlns="http://www.w3.org/2000/svg"'
        + (f' xmlns:xlink="{XLINK}"' if any(a.tag == "a" for a in nameattr.values()) else "")
        + f' data-fs="{_num(fs)}" data-fw="{o.font_width}" '
        f'data-fh="{fh}" data-inverted="{1 if inverted else 0}" data-unit="{countname}"'
        + (f' data-nametype="{xml_escape(o.nametype)}"' if o.nametype != "Function:" else "")
        + ">\n"
    )
    w("<!-- flamed flame graph; drawn boxes are in #fv, in weight units. -->\n")
    if o.notes:
        # "--" may not appear inside an XML comment.
        w(f"<!-- NOTES: {visible_text(o.notes).replace('--', '- -')} -->\n")
    w(
        f'<defs><linearGradient id="bg" x1="0" x2="0" y1="0" y2="1"><stop stop-color="{bg_top}" offset="5%"/>'
        f'<stop stop-color="{bg_bottom}" offset="95%"/></linearGradient></defs>\n'
    )
    css = _asset("flamegraph.css")
    if o.font_type != "Verdana" or fs != FONT_SIZE:
        # After the stylesheet's rule, so it wins; the title keeps its own size.
        css += f'text{{font-family:{_css_string(o.font_type)},sans-serif;font-size:{_num(fs)}px}}\n'
    w('<style type="text/css"><![CDATA[\n' + css + "]]></style>\n")
    w('<script type="text/ecmascript"><![CDATA[\n' + _asset("flamegraph.js") + "]]></script>\n")
    w(f'<rect x="0" y="0" width="{width}" height="{height}" fill="url(#bg)"/>\n')
    w(f'<text id="title" x="{width / 2:g}" y="24">{xml_escape(_default_title(o, diff))}</text>\n')
    if subtitle:
        w(f'<text id="subtitle" x="{width / 2:g}" y="{_num(24 + fs * 2)}">{xml_escape(subtitle)}</text>\n')
    ybottom = height - ypad2 / 2
    w(f'<text id="details" x="{XPAD}" y="{ybottom:g}"> </text>\n')
    w(f'<text id="unzoom" class="hide" x="{XPAD}" y="24">Reset Zoom</text>\n')
    w(f'<text id="search" x="{width - XPAD - 24}" y="24">Search</text>\n')
    w(f'<text id="ignorecase" x="{width - XPAD}" y="24">ic</text>\n')
    w(f'<text id="matched" class="hide" x="{width - XPAD}" y="{ybottom:g}"> </text>\n')
    if o.palette == "mixed" and not diff:
        w(_legend())
    if not boxes:
        msg = "No stacks to draw" + (": " + "; ".join(notes) if notes else "")
        w(f'<text id="empty" x="{width / 2:g}" y="{_num(ypad1 + fh)}" text-anchor="middle">{xml_escape(msg)}</text>\n')
    # Browsers clamp coordinates beyond ~2^25 (Chromium's layout units), and a
    # profile weighted in nanoseconds easily exceeds that: such profiles are drawn
    # in units of total/2^24, rounded at both edges so neighbours still tile.
    # Exact weights stay in the titles; data-per-unit says how many weights a unit is.
    per_unit = float(total) / MAX_UNITS if float(total) > MAX_UNITS else None
    tot = format_weight(total) if per_unit is None else str(MAX_UNITS)
    scale = dw / float(tot) if total else 0.0
    extra = "" if per_unit is None else f' data-per-unit="{per_unit!r}"'
    w(
        f'<svg id="fv" x="{XPAD}" y="0" width="{dw}" height="{height}" viewBox="0 0 {tot} {height}" '
        f'preserveAspectRatio="none" data-total="{tot}"{extra}>\n'
    )
    labels: list[str] = []
    lab = labels.append
    # name -> (shown name, its escaped text, the box's opening tag, closing tag, --nameattr title)
    names: dict[str, tuple[str, str, str, str, str | None]] = {}
    bottom = height - ypad2
    rh = fh - 1
    for b in counted(boxes, "drawing", len(boxes), "boxes"):
        name = b.name
        known = names.get(name) if b.depth else None
        if known is None:
            known = _box_markup(name, nameattr.get(name) if b.depth else None)
            if b.depth:
                names[name] = known
        label_name, esc, open_tag, close_tag, custom_title = known
        y = _num(ypad1 + b.depth * fh if inverted else bottom - (b.depth + 1) * fh)
        bw = b.width
        pct = 100.0 * float(bw) / float(total)
        if diff:
            delta = float(b.delta or 0)
            fill = diff_color(delta, max_delta if b.depth else max(max_delta, abs(delta)), negate=o.negate)
            change = -delta if o.negate else delta
            title = f"{esc} ({format_count(bw)} {countname}, {pct:.2f}%; {_delta_pct(change, total)}%)"
        else:
            fill = colorer.color(name, b.depth)
            title = f"{esc} ({format_count(bw)} {countname}, {pct:.2f}%)"
        if per_unit is None:
            x0: float = float(b.start)
            wu: float = float(bw)
            xs, ws = format_weight(b.start), format_weight(bw)
        else:
            ix0 = round(float(b.start) / per_unit)
            iwu = round((float(b.start) + float(bw)) / per_unit) - ix0
            if iwu <= 0:
                continue  # under 1/2^24 of the total: nothing to draw at any zoom
            x0, wu, xs, ws = ix0, iwu, str(ix0), str(iwu)
        if custom_title is not None:
            title = custom_title
        w(f'{open_tag}<title>{title}</title><rect x="{xs}" y="{y}" width="{ws}" height="{rh}" fill="{fill}"/>{close_tag}\n')
        chars = int(wu * scale / char_px)
        if chars >= 3:
            label = label_name if len(label_name) <= chars else label_name[: chars - 2] + ".."
            lab(
                f'<text x="{XPAD + x0 * scale + 3:.1f}" y="{_num(y + fh - 5)}">'
                f"{esc if label is label_name else xml_escape(label)}</text>\n"
            )
    w("</svg>\n")
    if hidden and len(hidden) < HIDDEN_LIMIT:
        w(_hidden_block(hidden, per_unit))
    w('<g id="labels">\n')
    parts.extend(labels)
    w("</g>\n")
    # The floating tooltip, last so it is drawn over everything; filled by the script.
    w(
        '<g id="tip" class="hide"><rect x="0" y="0" width="0" height="0" rx="3"/>'
        f'<text><tspan id="tipname" x="6" y="{_num(fs + 2)}"> </tspan>'
        f'<tspan id="tipinfo" x="6" dy="{_num(fs + 3)}"> </tspan></text></g>\n'
    )
    w("</svg>\n")
    # Another encoding (--encoding) writes what it cannot hold as character references.
    out.write("".join(parts).encode(encoding, "xmlcharrefreplace") if encoding else "".join(parts).encode("utf-8"))
    colorer.save()


#: The annotation perf and flamegraph.pl append to a name (kernel, JIT, inlined, waker):
#: it picks the color, and is not shown.
_ANNOTATION = re.compile(r"_\[([kwij])\]$")


def _shown(name: str) -> tuple[str, str, str]:
    """How a frame name is written: the name without its annotation (as flamegraph.pl
    shows it in titles and labels), escaped, and the ``<g>``'s attributes, where
    ``data-a`` keeps the annotation (for the search, and readers of the file)."""
    m = _ANNOTATION.search(name)
    if m is None:
        return name, xml_escape(name), ""
    shown = name[: m.start()]
    return shown, xml_escape(shown), f' data-a="{m.group(1)}"'


def _box_markup(name: str, attr: NameAttr | None) -> tuple[str, str, str, str, str | None]:
    shown, esc, annotation = _shown(name)
    if attr is None:
        return shown, esc, f"<g{annotation}>", "</g>", None
    # A replaced tooltip no longer starts with the name: data-n carries it for the script.
    named = f' data-n="{esc}"' if attr.title is not None else ""
    return shown, esc, f"<{attr.tag}{attr.attrs}{annotation}{named}>", f"</{attr.tag}>", attr.title


def _num(v: float) -> int | float:
    """A coordinate as it is written: an integer when it is one (the default sizes keep their bytes)."""
    return int(v) if float(v).is_integer() else round(float(v), 2)


def _hidden_block(hidden: Sequence[Box], per_unit: float | None) -> str:
    """The boxes too narrow to draw, for the search: one line per name, ``NAME<TAB>X W X W ...``,
    the intervals of one name merged where they touch or nest (recursion)."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    for b in hidden:
        x0, x1 = float(b.start), float(b.start) + float(b.width)
        if per_unit is not None:
            x0, x1 = x0 / per_unit, x1 / per_unit
        by_name.setdefault(b.name, []).append((x0, x1))
    lines = []
    for name in sorted(by_name):
        spans = sorted(by_name[name])
        merged: list[list[float]] = []
        for a, e in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([a, e])
        nums = " ".join(f"{format_weight(_num(a))} {format_weight(_num(e - a))}" for a, e in merged)
        # The script splits a line at its last tab: a tab in a name stays, as the box titles keep it.
        lines.append(f"{xml_escape(name).replace(chr(10), ' ')}\t{nums}\n")
    return '<metadata id="hidden">\n' + "".join(lines) + "</metadata>\n"


def _delta_pct(delta: float, total: Weight) -> str:
    """A change as a signed percentage of the total; one that rounds to nothing is ``0.00``
    (not ``-0.00``, which reads as a loss)."""
    text = f"{100.0 * delta / float(total):+.2f}" if total else "+0.00"
    return "0.00" if text in ("+0.00", "-0.00") else text


def _legend() -> str:
    # A key for the mixed palette: one swatch per kind (its middle shade), in a fixed order.
    x = XPAD + 100
    items = []
    for kind in ("kernel", "native", "python"):
        items.append(
            f'<rect x="{x}" y="14" width="10" height="10" fill="{kind_color(kind)}" data-kind="{kind}"/>'
            f'<text x="{x + 14}" y="24">{kind}</text>'
        )
        x += 80
    return '<g id="legend">' + "".join(items) + "</g>\n"


def render_table(table: StackTable[str] | StackTable[bytes], out: BinaryIO, options: OutputOptions | None = None) -> int:
    """Flame (or icicle) graph of a prepared StackTable; returns the number of boxes drawn."""
    o = options or OutputOptions()
    hidden: list[Box] = []
    span = graph_total(table.total, o)
    boxes = spanning(flame_frames(table, min_weight(span, o), hidden=hidden, hidden_limit=HIDDEN_LIMIT), span) if len(table) else []
    render_boxes(boxes, out, o, diff=table.dcum is not None, hidden=hidden)
    return len(boxes)


def render_chart(items: Sequence[tuple[Stack, Weight]], out: BinaryIO, options: OutputOptions | None = None) -> int:
    """Flame chart: ``items`` in time order, not sorted."""
    o = options or OutputOptions()
    total = sum(w for _, w in items if w > 0)
    span = graph_total(total, o)
    boxes = spanning(chart_frames(items, min_weight(span, o)), span) if total else []
    render_boxes(boxes, out, o)
    return len(boxes)


def render_profile(profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> int:
    o = options or OutputOptions()
    unit = profile.labels.get("unit")
    timed = time_kind(profile)
    if timed is not None and o.countname == "samples":
        # Off-CPU or wall-clock time: the unit in the tooltips and under the title.
        o = dataclasses.replace(o, countname=timed[1], subtitle=o.subtitle or f"{timed[0]} in {timed[1]}")
    if unit and unit != "samples" and o.countname == "samples":
        # The profile says what its weights count (e.g. nanoseconds): say it in the details.
        o = dataclasses.replace(o, countname=unit)
    if o.flamechart:
        # A Profile keeps the order stacks were first seen in: the closest to time order it has.
        return render_chart(list(profile.stacks.items()), out, o)
    return render_table(table_from_profile(profile), out, o)


class SvgFormat(OutputFormat):
    name = "svg"
    extensions = (".svg",)
    description = "interactive SVG flame graph (icicle with inverted, flame chart with flamechart)"

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        render_profile(profile, out, options)

    def write_samples(self, samples: Iterable[Sample], out: BinaryIO, options: OutputOptions | None = None) -> None:
        """A flame chart of the stream in time order, one lane per thread (``flamechart`` is implied)."""
        render_chart(lanes(samples), out, options)
