"""Inputs the fuzzers found, kept so each bug stays fixed (one minimal input each)."""

from __future__ import annotations

import gzip

import pytest
from fuzz_targets import by_name
from fuzzlib import run_one

T = by_name()

CASES = [
    # int() refuses > 4300 digits with ValueError: a count that long is a malformed line.
    ("folded", b"a;b " + b"9" * 5000 + b"\n"),
    ("folded-strict", b"a;b " + b"9" * 5000 + b"\n"),
    # A 400-digit decimal became inf, written back as 'inf' (unreadable).
    ("folded", b"a;b " + b"1" * 400 + b".5\n"),
    # gzip reports corruption lazily, as BadGzipFile / EOFError / zlib.error.
    ("folded-file+gzip", b"\x1f\x8b;" + gzip.compress(b"a 1\n")[3:]),
    ("folded-file+gzip", gzip.compress(b"a;b 1\n" * 100)[:30]),
    ("folded-file+gzip", gzip.compress(b"a;b 1\n")[:12] + b"\xff" * 20),
    # json.loads turns a 5000-digit number into ValueError, not JSONDecodeError.
    ("socket-request", b'{"request":"snapshot","seconds":' + b"1" * 5000 + b"}"),
]


@pytest.mark.parametrize("name,data", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_found_input(name: str, data: bytes) -> None:
    target = T[name]
    if target.missing:
        pytest.skip(target.missing)
    out = run_one(target, data, measure_memory=True)
    assert out.ok, f"{name}: {out.kind}: {out.detail}"


LATER = [
    # zlib.error from a corrupt deflate stream inside a gzip header.
    ("pprof-reader", lambda: __import__("gzip").compress(b"\x08\x01" * 50)[:12] + b"\xff" * 40),
    # json.loads: RecursionError on deep nesting.
    ("speedscope-reader", lambda: b"[" * 100_000),
    ("pyspy-chrometrace", lambda: b"[" * 100_000),
    # int(1e999): OverflowError (bench/fuzz.py, 11 of 100,000 inputs).
    ("pyspy-chrometrace", lambda: b'[{"ph":"B","ts":1e999,"tid":1,"name":"f","pid":1}]'),
    # Format guessing: pyspy's unanchored frame regex was quadratic in the line length (~25 s on 64 KB).
    ("collapse-auto-file", lambda: b"(thread " * 8000),
    # bcc multi-line output: a count of >4300 digits.
    ("collapse-bcc", lambda: b"    main\n    -                python3 (1234)\n        " + b"7" * 5000 + b"\n\n"),
    # perf script header: a period of >4300 digits (flamed/collapse/perf.py, int() of a digit run).
    ("collapse-perf", lambda: b"python3 1234 [001] 1.5: " + b"9" * 5000 + b" cpu-clock: \n\t abc main (/bin/x)\n\n"),
]


@pytest.mark.parametrize("name,make", LATER, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LATER)])
def test_found_input_later(name: str, make: object) -> None:
    target = T[name]
    if target.missing:
        pytest.skip(target.missing)
    data = make()  # type: ignore[operator]
    out = run_one(target, data, time_limit=5.0)
    assert out.ok, f"{name}: {out.kind}: {out.detail}"
