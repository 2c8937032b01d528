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
