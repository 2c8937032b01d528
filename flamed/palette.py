"""Frame colors: palettes, the stable per-name choice, palette files, differential scale.

Colors do not come from a random generator (unless ``random=True``, the
``--random`` of flamegraph.pl): a frame's color is a function of its name
(and the palette), so the same file always renders the same bytes and the
same function has the same color in every graph.

The language palettes (``java``, ``js``, ``perl``) and ``wakeup``/``chain``
pick one of the flat schemes per frame by its name and annotation (``_[k]``
kernel, ``_[j]`` JIT, ``_[i]`` inlined, ``_[w]`` waker), with the rules of
flamegraph.pl's palettes of the same names.  Two ways to turn a
name into the palette's free parameters:

* default: a checksum of the whole name -- neighbouring functions get
  unrelated colors, which separates adjacent boxes well;
* ``hash=True``: flamegraph.pl's ``--hash``: a weighted sum over the first three
  characters of the name (after any ``module``` prefix) and of the name reversed,
  so names that start alike get similar colors -- computed as flamegraph.pl
  computes it, so a name gets the very rgb flamegraph.pl ``--hash`` gives it.

A palette file (``--palette-file``) pins colors across graphs: names found
in it keep their color, new names get their computed color and are appended
when the file is saved.  Its lines are ``NAME->rgb(R,G,B)`` (the format of
flamegraph.pl's ``palette.map``, so the two can share one).
"""

from __future__ import annotations

import os
import random as _random
import re
import zlib
from collections.abc import Callable

from flamed.errors import FlamedError, InputError, UsageError
from flamed.fileio import atomic_write
from flamed.model import encode_frame, frame_kind, is_task, parse_task_frame

RGB = tuple[int, int, int]

#: Fill of boxes matched by a search (the script uses the same value).
SEARCH_COLOR = "#e600e6"

_RGB_LINE = re.compile(r"^rgb\((\d{1,3}),\s*(\d{1,3}),\s*(\d{1,3})\)$")
_HEX = re.compile(r"^#([0-9a-fA-F]{6})$")


def _scalars_checksum(name: str) -> tuple[float, float, float]:
    h = zlib.crc32(encode_frame(name))
    # Spread the 32 bits over three independent 10-bit parameters.
    return ((h & 0x3FF) / 1023.0, ((h >> 10) & 0x3FF) / 1023.0, ((h >> 20) & 0x3FF) / 1023.0)


#: flamegraph.pl drops everything up to the first backtick past the first character
#: ("module`function" hashes as "function").
_HASH_MODULE = re.compile(r".(.*?)`")


def _namehash(name: str) -> float:
    """flamegraph.pl's ``namehash``: its first three characters, the first weighing most,
    in (0, 1] -- so names that start alike land close together."""
    name = _HASH_MODULE.sub("", name, count=1)
    vector = 0.0
    weight = 1.0
    total = 1.0
    mod = 10
    for ch in name:
        # Same operations in the same order as the Perl, so the doubles (and the
        # colors truncated from them) are the same to the last bit.
        vector += ((ord(ch) % mod) / (mod - 1)) * weight
        mod += 1
        total += weight
        weight *= 0.70
        if mod > 12:
            break
    return 1 - vector / total


def _scalars_similar(name: str) -> tuple[float, float, float]:
    v2 = _namehash(name[::-1])
    return _namehash(name), v2, v2


def _clamp(v: float) -> int:
    return max(0, min(255, int(v)))


def _shade(base: int, span: int, v: float) -> int:
    # flamegraph.pl's base + int(span * v): the fraction truncated before the base is added.
    return _clamp(base + int(span * v))


def _hot(v1: float, v2: float, v3: float) -> RGB:
    return _shade(205, 50, v3), _shade(0, 230, v1), _shade(0, 55, v2)


def _mem(v1: float, v2: float, v3: float) -> RGB:
    return 0, _shade(190, 50, v2), _shade(0, 210, v1)


def _io(v1: float, v2: float, v3: float) -> RGB:
    return _shade(80, 60, v1), _shade(80, 60, v1), _shade(190, 55, v2)


def _red(v1: float, v2: float, v3: float) -> RGB:
    return _shade(200, 55, v1), _shade(50, 80, v1), _shade(50, 80, v1)


def _green(v1: float, v2: float, v3: float) -> RGB:
    return _shade(50, 60, v1), _shade(200, 55, v1), _shade(50, 60, v1)


def _blue(v1: float, v2: float, v3: float) -> RGB:
    return _shade(80, 60, v1), _shade(80, 60, v1), _shade(205, 50, v1)


def _aqua(v1: float, v2: float, v3: float) -> RGB:
    return _shade(50, 60, v1), _shade(165, 55, v1), _shade(165, 55, v1)


def _yellow(v1: float, v2: float, v3: float) -> RGB:
    return _shade(175, 55, v1), _shade(175, 55, v1), _shade(50, 20, v1)


def _purple(v1: float, v2: float, v3: float) -> RGB:
    return _shade(190, 65, v1), _shade(80, 60, v1), _shade(190, 65, v1)


def _orange(v1: float, v2: float, v3: float) -> RGB:
    return _shade(190, 65, v1), _shade(90, 65, v1), 0


def _grey(v1: float, v2: float, v3: float) -> RGB:
    g = _clamp(170 + 40 * v1)
    return g, g, _clamp(g + 10)


_SCHEMES: dict[str, Callable[[float, float, float], RGB]] = {
    "hot": _hot,
    "mem": _mem,
    "io": _io,
    "red": _red,
    "green": _green,
    "blue": _blue,
    "aqua": _aqua,
    "yellow": _yellow,
    "purple": _purple,
    "orange": _orange,
    "grey": _grey,
}

#: Kinds of frame told apart by the "mixed" palette, and the scheme of each.
MIXED_KINDS: dict[str, str] = {"kernel": "orange", "native": "red", "python": "green", "other": "grey"}

_JAVA_PKG = re.compile(r"^L?(java|javax|jdk|net|org|com|io|sun)/")


def _java(name: str) -> str:
    if name.endswith("_[j]"):
        return "green"
    if name.endswith("_[i]"):
        return "aqua"
    if _JAVA_PKG.match(name) or ":::" in name:
        return "green"
    if "::" in name:
        return "yellow"  # C++
    if name.endswith("_[k]"):
        return "orange"
    return "red"


def _js(name: str) -> str:
    if name.endswith("_[j]"):
        return "green" if "/" in name else "aqua"  # source, else a builtin
    if "::" in name:
        return "yellow"
    if re.search(r"/.*\.js", name):
        return "green"
    if ":" in name:
        return "aqua"
    if name == " ":
        return "green"  # a missing symbol
    if "_[k]" in name:
        return "orange"
    return "red"


def _perl(name: str) -> str:
    if "::" in name:
        return "yellow"
    if "Perl" in name or ".pl" in name:
        return "green"
    if name.endswith("_[k]"):
        return "orange"
    return "red"


#: Palettes that pick a flat scheme per frame name.
_BY_NAME: dict[str, Callable[[str], str]] = {
    "java": _java,
    "js": _js,
    "perl": _perl,
    "wakeup": lambda name: "aqua",
    "chain": lambda name: "aqua" if "_[w]" in name else "blue",
}

PALETTES: tuple[str, ...] = tuple(sorted([*_SCHEMES, *_BY_NAME, "mixed"]))

#: Background gradients (top, bottom), by --bgcolors name.
BACKGROUNDS: dict[str, tuple[str, str]] = {
    "yellow": ("#eeeeee", "#eeeeb0"),
    "blue": ("#eeeeee", "#e0e0ff"),
    "green": ("#eef2ee", "#e0ffe0"),
    "grey": ("#f8f8f8", "#e8e8e8"),
}
_FLAT_BG = re.compile(r"^#[0-9a-fA-F]{6}$")


def background(bgcolors: str | None, palette: str) -> tuple[str, str]:
    """The background gradient's two stops, for ``--bgcolors`` (default: by palette, as flamegraph.pl)."""
    if bgcolors is None or bgcolors == "":
        if palette == "mem":
            bgcolors = "green"
        elif palette in ("io", "wakeup", "chain"):
            bgcolors = "blue"
        elif palette in ("red", "green", "blue", "aqua", "yellow", "purple", "orange"):
            bgcolors = "grey"
        else:
            bgcolors = "yellow"
    if bgcolors in BACKGROUNDS:
        return BACKGROUNDS[bgcolors]
    if _FLAT_BG.match(bgcolors):
        return bgcolors, bgcolors
    raise UsageError(f"--bgcolors: expected one of {', '.join(BACKGROUNDS)} or #rrggbb, got {bgcolors!r}")

_SPECIAL = re.compile(r"^\[.*\]$")


def mixed_kind(name: str, depth: int | None = None) -> str:
    """Kind of a frame for the mixed palette: kernel, python, native, or other.

    ``other`` is the root, task frames (``comm-PID/TID`` at depth 1) and
    placeholders such as ``[unknown]``: they are not code and are drawn grey.
    """
    if depth == 0 or _SPECIAL.match(name):
        return "other"
    if depth == 1 and is_task(parse_task_frame(name)):
        return "other"
    return frame_kind(name)


def kind_color(kind: str) -> str:
    """The middle shade of a kind's scheme in the mixed palette (for legends)."""
    return hex_color(_SCHEMES[MIXED_KINDS[kind]](0.5, 0.5, 0.5))


def hex_color(rgb: RGB) -> str:
    return "#%02x%02x%02x" % rgb


class Colorer:
    """Chooses and remembers the fill of every frame name."""

    def __init__(
        self, palette: str = "hot", *, hash: bool = False, palette_file: str | None = None, random: bool = False
    ) -> None:
        if palette not in PALETTES:
            raise UsageError(f"unknown palette {palette!r}; known palettes: {', '.join(PALETTES)}")
        self.palette = palette
        self.hash = hash
        self.palette_file = palette_file
        self.random = random
        self._rng = _random.Random()
        self.pinned: dict[str, str] = {}
        self.new: dict[str, str] = {}
        self._cache: dict[tuple[str, int], str] = {}
        if palette_file is not None and os.path.exists(palette_file):
            self.pinned = read_palette_file(palette_file)

    def color(self, name: str, depth: int | None = None) -> str:
        key = (name, 0 if depth is None else min(depth, 2))
        c = self._cache.get(key)
        if c is not None:
            return c
        c = self.pinned.get(name)
        if c is None:
            c = self._compute(name, depth)
            if self.palette_file is not None and name not in self.new:
                self.new[name] = c
        self._cache[key] = c
        return c

    def _compute(self, name: str, depth: int | None) -> str:
        if self.random:
            r = self._rng.random
            v = (r(), r(), r())
        else:
            v = _scalars_similar(name) if self.hash else _scalars_checksum(name)
        if self.palette == "mixed":
            scheme = _SCHEMES[MIXED_KINDS[mixed_kind(name, depth)]]
        elif depth == 0:
            scheme = _grey
        elif self.palette in _BY_NAME:
            scheme = _SCHEMES[_BY_NAME[self.palette](name)]
        else:
            scheme = _SCHEMES[self.palette]
        return hex_color(scheme(*v))

    def save(self) -> None:
        """Write the palette file back with the names first seen in this run."""
        if self.palette_file is None or not self.new:
            return
        merged = dict(self.pinned)
        for k, v in self.new.items():
            merged.setdefault(k, v)
        write_palette_file(self.palette_file, merged)


def read_palette_file(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"cannot read palette file: {e.strerror or e}", source=path) from None
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        text = raw.decode("utf-8", "surrogateescape").rstrip("\r")
        if not text.strip():
            continue
        name, sep, color = text.rpartition("->")
        m = _RGB_LINE.match(color.strip()) if sep else None
        if m is not None:
            out[name] = hex_color((_clamp(int(m.group(1))), _clamp(int(m.group(2))), _clamp(int(m.group(3)))))
            continue
        h = _HEX.match(color.strip()) if sep else None
        if h is not None:
            out[name] = "#" + h.group(1).lower()
            continue
        raise InputError("expected 'NAME->rgb(R,G,B)'", source=path, line=lineno)
    return out


def write_palette_file(path: str, colors: dict[str, str]) -> None:
    lines = []
    for name in sorted(colors):
        c = colors[name]
        r, g, b = int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)
        lines.append(encode_frame(name) + b"->rgb(%d,%d,%d)\n" % (r, g, b))
    try:
        with atomic_write(path) as f:
            f.write(b"".join(lines))
    except OSError as e:
        raise FlamedError(f"cannot write palette file {path}: {e.strerror or e}") from None


def diff_color(delta: float, max_delta: float, *, negate: bool = False) -> str:
    """Differential fill: red for growth, blue for shrinkage, paler when the change is small
    (``negate``: the other way round)."""
    if negate:
        delta = -delta
    if max_delta <= 0 or delta == 0:
        return "#ffffff"
    frac = min(1.0, abs(delta) / max_delta)
    pale = int(210 * (1.0 - frac))
    if delta > 0:
        return hex_color((255, pale, pale))
    return hex_color((pale, pale, 255))
