"""Argument types of numeric options: a value out of range is a usage error (exit 2)
with the option's name, before any input is read, not a traceback later."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
#: Linux's PID_MAX_LIMIT: no process or thread id is larger.
PID_MAX = 1 << 22
#: The longest span the daemon's protocol takes ('seconds', 'next'): a week.
WEEK_S = 7 * 86400.0
#: The most worker processes a --jobs option takes.
JOBS_MAX = 1024

#: A duration: a number, then ms, s (the default), m or h.
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_SCALE = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else f"{v:g}"


def number(low: float, high: float, *, what: str = "a number", above: bool = False) -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (``(low, high]`` when ``above``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or not (low < v if above else low <= v) or not v <= high:
            raise argparse.ArgumentTypeError(f"expected {what} {_range(low, high, above)}, got {text!r}")
        return v

    parse.__name__ = "number"  # what argparse names in its own messages
    return parse


def _range(low: float, high: float, above: bool) -> str:
    return f"above {_fmt(low)}, up to {_fmt(high)}" if above else f"from {_fmt(low)} to {_fmt(high)}"


def duration(high: float, *, what: str = "a duration such as 90, 60s, 5m or 1.5h") -> Callable[[str], float]:
    """Seconds above 0 and up to ``high``, written ``90`` (seconds), ``500ms``, ``60s``, ``5m`` or ``1.5h``."""

    def parse(text: str) -> float:
        m = _DURATION.match(text)
        if not m:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        v = float(m[1]) * _SCALE[m[2] or "s"]
        if not 0 < v <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, {_range(0, high, True)} s, got {text!r}")
        return v

    parse.__name__ = "duration"
    return parse


def integer(low: int, high: int, *, what: str = "an integer") -> Callable[[str], int]:
    """An int in ``[low, high]`` (decimal, as ``int()`` reads it)."""

    def parse(text: str) -> int:
        t = text.strip()
        if len(t.lstrip("+-").lstrip("0")) > 30:  # int() of thousands of digits is slow, then refused
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {text[:40]!r}...")
        try:
            v = int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {text!r}")
        return v

    parse.__name__ = "integer"
    return parse


def jobs() -> Callable[[str], int]:
    """A ``-j/--jobs`` value: 1 to :data:`JOBS_MAX` worker processes (0 and negative
    numbers were taken, then failed later or meant something else per command)."""
    return integer(1, JOBS_MAX, what="a number of worker processes")
