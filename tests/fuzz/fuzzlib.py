"""The fuzz contract and the input generators shared by tests/fuzz and bench/fuzz.py.

Contract for every parser flamed exposes to untrusted bytes (files given to
the CLI, the daemon's control socket): for ANY input it returns a result or
raises a :class:`flamed.errors.FlamedError`; nothing else escapes, it
finishes within a time bound, and its memory stays within a bound
proportional to the input.

Targets are registered in ``fuzz_targets.py``; this module only knows how to
run one input against one target and how to make inputs:

* :func:`mutate` -- a small deterministic mutational fuzzer over a target's
  seed corpus and token dictionary (what bench/fuzz.py runs 100,000+ times);
* :func:`hypothesis_inputs` -- the same ideas as a Hypothesis strategy, so CI
  shrinks any failure to a minimal input.
"""

from __future__ import annotations

import random
import signal
import time
import traceback
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flamed.errors import FlamedError

#: A parse must finish within this many seconds (any input, including 64 KiB ones).
DEFAULT_TIME_LIMIT = 2.0
#: Peak Python heap allowed for one parse: a fixed allowance plus this factor of the input size.
MEM_FIXED = 48 << 20
MEM_FACTOR = 200


class Hang(BaseException):
    """Raised from SIGALRM when one input exceeds its time bound.

    A BaseException so that a parser's ``except Exception`` cannot swallow it.
    """


@dataclass
class Target:
    """One parser under test.

    ``parse(data)`` feeds the bytes to the parser the way real input reaches
    it.  ``check(data, result)``, when given, asserts a property of a
    successful parse (round trips, invariants).  ``seeds`` are valid inputs
    the mutator starts from; ``tokens`` are format keywords it splices in.
    """

    name: str
    parse: Callable[[bytes], Any]
    seeds: Sequence[bytes]
    tokens: Sequence[bytes] = ()
    check: Callable[[bytes, Any], None] | None = None
    #: Largest input the generators make for this target.
    max_size: int = 16 << 10
    #: Set when the target's module has not landed; tests skip with this reason.
    missing: str | None = None
    #: Exceptions that count as a clean refusal (FlamedError, or the socket's ProtocolError).
    clean: tuple[type[BaseException], ...] = (FlamedError,)


@dataclass
class Outcome:
    ok: bool
    kind: str  # "result", "error" (a FlamedError), "crash", "hang", "memory", "property"
    detail: str = ""
    seconds: float = 0.0
    peak_bytes: int = 0
    exc: BaseException | None = field(default=None, repr=False)


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run_one(
    target: Target,
    data: bytes,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    measure_memory: bool = False,
) -> Outcome:
    """Run ``data`` through ``target`` under the contract; never raises (except Hang escaping a bug of ours)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    traced = False
    if measure_memory:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
            traced = True
        tracemalloc.reset_peak()
    t0 = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        try:
            result = target.parse(data)
            if target.check is not None:
                try:
                    target.check(data, result)
                except AssertionError as e:
                    return Outcome(False, "property", f"property failed: {e}", exc=e)
            kind = "result"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Hang:
        return Outcome(False, "hang", f"no answer within {time_limit:g} s", time.perf_counter() - t0)
    except target.clean:
        kind = "error"
    except MemoryError as e:
        return Outcome(False, "memory", "MemoryError", time.perf_counter() - t0, exc=e)
    except BaseException as e:  # noqa: BLE001 - the point is to catch what escapes
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-4))
        return Outcome(False, "crash", f"{type(e).__name__}: {e}\n{tb}", time.perf_counter() - t0, exc=e)
    finally:
        signal.signal(signal.SIGALRM, old)
        peak = 0
        if measure_memory:
            peak = tracemalloc.get_traced_memory()[1]
            if traced:
                tracemalloc.stop()
    dt = time.perf_counter() - t0
    if measure_memory and peak > MEM_FIXED + MEM_FACTOR * len(data):
        return Outcome(False, "memory", f"peak heap {peak} bytes for a {len(data)}-byte input", dt, peak)
    return Outcome(True, kind, seconds=dt, peak_bytes=peak)


# ---------------------------------------------------------------------------
# Generators

#: Byte strings that break parsers in general: numbers at the edges of their
#: types, separators, encodings, JSON and protobuf edge values.
GENERIC_TOKENS: tuple[bytes, ...] = (
    b"\n", b"\r\n", b"\r", b" ", b"\t", b";", b":", b",", b"#", b"\x00", b"\xff", b"\xc3\x28", b"\xed\xa0\x80",
    b"0", b"-1", b"1.5", b"1.", b".5", b"1e309", b"-0", b"NaN", b"Infinity", b"9" * 30, b"18446744073709551616",
    b"\x1f\x8b", b"{", b"}", b"[", b"]", b'"', b"\\", b"\\u0000", b"null", b"true", b"[k]", b"_[k]", b"\x85",
    b"\xe2\x80\xa8", b"\x0b", b"\x0c", b"\x1c",
)


def mutate(rng: random.Random, target: Target) -> bytes:
    """One input: a seed (or two spliced), mutated 1-8 times, or plain random bytes."""
    roll = rng.random()
    tokens = list(target.tokens) + list(GENERIC_TOKENS)
    if roll < 0.04 or not target.seeds:
        return rng.randbytes(rng.randrange(0, 512))
    if roll < 0.12:
        # A token soup: formats are mostly their keywords in some order.
        return b"".join(rng.choice(tokens) for _ in range(rng.randrange(1, 120)))[: target.max_size]
    data = bytearray(rng.choice(target.seeds))
    for _ in range(rng.randrange(1, 9)):
        op = rng.randrange(10)
        n = len(data)
        pos = rng.randrange(n + 1)
        if op == 0 and n:  # flip a bit
            i = rng.randrange(n)
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # random byte
            data[rng.randrange(n)] = rng.randrange(256)
        elif op == 2:  # insert a token
            data[pos:pos] = rng.choice(tokens)
        elif op == 3 and n:  # delete a range
            end = min(n, pos + rng.randrange(1, 64))
            del data[pos:end]
        elif op == 4 and n:  # duplicate a range
            a = rng.randrange(n)
            b = min(n, a + rng.randrange(1, 256))
            data[pos:pos] = data[a:b] * rng.randrange(1, 4)
        elif op == 5:  # truncate
            del data[pos:]
        elif op == 6:  # splice with another seed
            other = rng.choice(target.seeds)
            cut = rng.randrange(len(other) + 1)
            data[pos:] = other[cut:]
        elif op == 7 and n:  # replace a digit run with an edge number
            i = rng.randrange(n)
            if 48 <= data[i] <= 57:
                j = i
                while j < n and 48 <= data[j] <= 57:
                    j += 1
                data[i:j] = rng.choice((b"0", b"4294967296", b"9" * rng.randrange(1, 5000), b"-1", b"1e400"))
        elif op == 8:  # repeat a token many times (deep nesting, long lines)
            data[pos:pos] = rng.choice(tokens) * rng.randrange(2, 2000)
        else:  # random bytes
            data[pos:pos] = rng.randbytes(rng.randrange(1, 16))
        if len(data) > target.max_size:
            del data[target.max_size :]
    return bytes(data)


def hypothesis_inputs(target: Target) -> Any:
    """A Hypothesis strategy over the same space as :func:`mutate`, shrinkable."""
    from hypothesis import strategies as st

    tokens = list(target.tokens) + list(GENERIC_TOKENS)
    pieces = st.sampled_from(tokens) | st.binary(min_size=1, max_size=8)
    if target.seeds:
        seeds = list(target.seeds)
        # Cut seeds into lines so the strategy can recombine real records.
        lines = sorted({ln for s in seeds for ln in s.splitlines(keepends=True)} - {b""})[:400]
        if lines:
            pieces = pieces | st.sampled_from(lines)
        seeded = st.tuples(st.sampled_from(seeds), st.integers(0, 1 << 16), st.lists(pieces, max_size=6)).map(
            lambda t: t[0][: t[1] % (len(t[0]) + 1)] + b"".join(t[2]) + t[0][t[1] % (len(t[0]) + 1) :]
        )
    else:
        seeded = st.nothing()
    soup = st.lists(pieces, max_size=80).map(b"".join)
    return st.one_of(seeded, soup, st.binary(max_size=2048))
