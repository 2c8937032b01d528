"""Property/fuzz tests: every parser of untrusted input keeps the fuzz contract.

Any bytes -> a result or a FlamedError; no other exception, no hang (each
input is bounded by SIGALRM), bounded memory (tracemalloc peak per input).
The budget is small for CI; ``FLAMED_FUZZ_EXAMPLES=N`` scales it, and
``bench/fuzz.py`` runs >= 100,000 inputs per parser.  Hypothesis is
derandomized so CI explores the same inputs every run; set
``FLAMED_FUZZ_RANDOM=1`` to explore new ones.
"""

from __future__ import annotations

import os
import random

import pytest
from fuzz_targets import targets
from fuzzlib import Outcome, Target, hypothesis_inputs, mutate, run_one
from hypothesis import HealthCheck, given, settings

EXAMPLES = int(os.environ.get("FLAMED_FUZZ_EXAMPLES", "200"))
RANDOM = os.environ.get("FLAMED_FUZZ_RANDOM") == "1"

ALL = targets()


def _explain(target: Target, data: bytes, out: Outcome) -> str:
    return f"{target.name}: {out.kind} on {len(data)}-byte input {data[:200]!r}...\n{out.detail}"


@pytest.mark.parametrize("target", ALL, ids=[t.name for t in ALL])
def test_contract_hypothesis(target: Target) -> None:
    if target.missing:
        pytest.skip(target.missing)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,  # run_one bounds each input itself
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(hypothesis_inputs(target))
    def prop(data: bytes) -> None:
        out = run_one(target, data, measure_memory=True)
        assert out.ok, _explain(target, data, out)

    prop()


@pytest.mark.parametrize("target", ALL, ids=[t.name for t in ALL])
def test_contract_mutations(target: Target) -> None:
    """The bench's mutator at CI scale, seeded: finds what grammar-free mutation finds."""
    if target.missing:
        pytest.skip(target.missing)
    rng = random.Random(0xF1A3ED)
    kinds: dict[str, int] = {}
    for _ in range(EXAMPLES):
        data = mutate(rng, target)
        out = run_one(target, data)
        assert out.ok, _explain(target, data, out)
        kinds[out.kind] = kinds.get(out.kind, 0) + 1
    # The seeds must still parse, or the mutator explores nothing useful.
    assert kinds.get("result", 0) > 0, f"{target.name}: no input parsed at all ({kinds})"


def test_harness_catches_what_it_must() -> None:
    """The contract runner itself: a crash, a hang and a non-FlamedError are failures."""
    import time

    from flamed.errors import InputError

    def crash(b: bytes) -> None:
        raise ValueError("boom")

    def hang(b: bytes) -> None:
        time.sleep(5)

    def clean(b: bytes) -> None:
        raise InputError("bad", source="x")

    assert run_one(Target("c", crash, []), b"").kind == "crash"
    assert run_one(Target("h", hang, []), b"", time_limit=0.2).kind == "hang"
    assert run_one(Target("e", clean, []), b"").kind == "error"
    big = run_one(Target("m", lambda b: b"\0" * (100 << 20), []), b"", measure_memory=True, time_limit=60)
    assert big.kind == "memory"
