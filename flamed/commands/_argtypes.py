"""Argument types of numeric options: a value out of range is a usage error (exit 2)
with the option's name, before any input is read, not a traceback later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

#: Largest value of an int64 nanosecond field (pprof's time_nanos, duration_nanos).
INT64_MAX = 2**63 - 1


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else f"{v:g}"


def number(low: float, high: float, *, what: str = "a number") -> Callable[[str], float]:
    """A finite float in ``[low, high]``."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {_fmt(low)} to {_fmt(high)}, got {text!r}")
        return v

    parse.__name__ = "number"  # what argparse names in its own messages
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
