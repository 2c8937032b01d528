#!/usr/bin/env python3
"""Fuzz every parser of untrusted input with >= 100,000 inputs each and print a table.

    .venv/bin/python bench/fuzz.py                     # 100,000 inputs per parser, mutational engine
    .venv/bin/python bench/fuzz.py -n 20000 -j 2 folded
    .venv/bin/python bench/fuzz.py --engine atheris    # coverage-guided (libFuzzer), if atheris imports

Each parser runs in its own child process (so a segfault, a hang in C code or
runaway memory is caught and attributed) under an address-space limit, with
every input bounded by SIGALRM (tests/fuzz/fuzzlib.py: the same contract as
the CI tests).  Failing inputs are saved under var/fuzz/<parser>/ with their
traceback, for replay with ``--replay FILE --only PARSER``.

The mutational engine is deterministic for a given ``--seed``; atheris is not.
Timings are wall-clock on a shared 2-core machine: treat them as rough.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
sys.path.insert(0, str(ROOT))

OUT = Path(os.environ.get("FLAMED_FUZZ_OUT", ROOT / "var" / "fuzz"))
#: Address-space cap of a child: a parser that wants more has unbounded memory.
AS_LIMIT = 4 << 30


def _save(name: str, data: bytes, kind: str, detail: str) -> str:
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha1(data).hexdigest()[:16]
    (d / f"{kind}-{h}.bin").write_bytes(data)
    (d / f"{kind}-{h}.txt").write_text(detail)
    return str(d / f"{kind}-{h}.bin")


def child_mutational(name: str, n: int, seed: int, time_limit: float) -> dict[str, object]:
    from fuzz_targets import by_name
    from fuzzlib import run_one

    target = by_name()[name]
    if target.missing:
        return {"name": name, "missing": target.missing}
    rng = random.Random(f"{seed}:{name}")
    kinds: dict[str, int] = {}
    failures: list[str] = []
    slowest = 0.0
    total_bytes = 0
    t0 = time.perf_counter()
    for _ in range(n):
        data = target_input = __import__("fuzzlib").mutate(rng, target)
        total_bytes += len(data)
        out = run_one(target, target_input, time_limit=time_limit)
        if out.kind == "hang":
            # On a loaded machine a time-out may be starvation: retry alone with 5x the bound.
            again = run_one(target, target_input, time_limit=time_limit * 5)
            if again.ok:
                out = again
                kinds["slow"] = kinds.get("slow", 0) + 1
                slowest = max(slowest, again.seconds)
        kinds[out.kind] = kinds.get(out.kind, 0) + 1
        slowest = max(slowest, out.seconds)
        if not out.ok and len(failures) < 20:
            failures.append(_save(name, data, out.kind, out.detail))
    dt = time.perf_counter() - t0
    return {
        "name": name, "inputs": n, "kinds": kinds, "failures": failures, "seconds": dt,
        "slowest": slowest, "mean_bytes": total_bytes / max(n, 1),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child_atheris(name: str, n: int, time_limit: float) -> dict[str, object]:
    import atheris  # noqa: PLC0415 - optional

    with atheris.instrument_imports():
        import flamed  # noqa: F401
        from fuzz_targets import by_name
        from fuzzlib import run_one

        target = by_name()[name]
        if target.missing:
            return {"name": name, "missing": target.missing}
        # Parsers import their modules lazily: do it here so they get instrumented.
        for s in target.seeds:
            run_one(target, s, time_limit=time_limit)
    kinds: dict[str, int] = {}
    state = {"n": 0, "slowest": 0.0, "bytes": 0}
    failures: list[str] = []
    t0 = time.perf_counter()
    corpus = OUT / "corpus" / name
    corpus.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(target.seeds):
        (corpus / f"seed-{i}").write_bytes(s)

    def one(data: bytes) -> None:
        out = run_one(target, data, time_limit=time_limit)
        state["n"] += 1
        state["bytes"] += len(data)
        state["slowest"] = max(state["slowest"], out.seconds)
        kinds[out.kind] = kinds.get(out.kind, 0) + 1
        if not out.ok and len(failures) < 20:
            failures.append(_save(name, data, out.kind, out.detail))
        if state["n"] == n:  # libFuzzer leaves with _exit(): report before it does
            report()

    def report() -> None:
        res = {
            "name": name, "inputs": state["n"], "kinds": kinds, "failures": failures,
            "seconds": time.perf_counter() - t0, "slowest": state["slowest"],
            "mean_bytes": state["bytes"] / max(state["n"], 1),
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        print("RESULT " + json.dumps(res), flush=True)

    atheris.Setup(
        [sys.argv[0], f"-runs={n}", f"-max_len={target.max_size}", "-rss_limit_mb=4096", str(corpus)],
        one,
    )
    atheris.Fuzz()
    return {}


def run_child(name: str, args: argparse.Namespace) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--child", name, "-n", str(args.n), "--seed", str(args.seed),
           "--engine", args.engine, "--time-limit", str(args.time_limit)]

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    # Generous wall-clock bound for the whole child: no parser may hang the bench.
    budget = max(900.0, args.n * 0.05)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, preexec_fn=limits)
    except subprocess.TimeoutExpired:
        return {"name": name, "inputs": 0, "kinds": {"hang": 1}, "failures": ["child timed out"],
                "seconds": time.perf_counter() - t0}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    return {"name": name, "inputs": 0, "kinds": {"crash": 1},
            "failures": [f"child died rc={p.returncode}: {p.stderr[-2000:]}"], "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("only", nargs="*", help="parser names (default: all)")
    ap.add_argument("-n", type=int, default=int(os.environ.get("FLAMED_FUZZ_BENCH_INPUTS", "100000")),
                    help="inputs per parser (default 100000)")
    ap.add_argument("-j", type=int, default=1, help="parsers fuzzed at once (default 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engine", choices=("mutational", "atheris"), default="mutational")
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds allowed per input (default 2)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help="run one saved input against the parsers named and print the outcome")
    ap.add_argument("--list", action="store_true", help="list parsers and exit")
    args = ap.parse_args()

    if args.child:
        if args.engine == "atheris":
            child_atheris(args.child, args.n, args.time_limit)
        else:
            print("RESULT " + json.dumps(child_mutational(args.child, args.n, args.seed, args.time_limit)))
        return 0

    from fuzz_targets import targets
    from fuzzlib import run_one

    all_targets = targets()
    if args.list:
        for t in all_targets:
            print(f"{t.name:28} {'MISSING: ' + t.missing if t.missing else 'ok'}")
        return 0
    chosen = [t for t in all_targets if not args.only or t.name in args.only]
    if args.replay:
        data = Path(args.replay).read_bytes()
        for t in chosen:
            out = run_one(t, data, time_limit=args.time_limit)
            print(f"{t.name}: {out.kind} {out.detail}")
        return 0

    from concurrent.futures import ThreadPoolExecutor

    live = [t for t in chosen if not t.missing]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.j)) as ex:
        results = list(ex.map(lambda t: run_child(t.name, args), live))
    wall = time.perf_counter() - t0

    print(f"# bench/fuzz.py engine={args.engine} inputs/parser={args.n} seed={args.seed} "
          f"time-limit={args.time_limit:g}s python={sys.version.split()[0]} cpus={os.cpu_count()}")
    hdr = (f"{'parser':26} {'inputs':>8} {'parsed':>8} {'rejected':>8} {'failures':>8} {'slow':>5} {'time s':>8} "
           f"{'inputs/s':>9} {'slowest ms':>10} {'maxrss MB':>9}")
    print(hdr)
    print("-" * len(hdr))
    bad = 0
    for r in results:
        kinds: dict[str, int] = r.get("kinds", {})  # type: ignore[assignment]
        fails = sum(v for k, v in kinds.items() if k not in ("result", "error", "slow"))
        bad += fails
        n = int(r.get("inputs", 0))  # type: ignore[call-overload]
        secs = float(r.get("seconds", 0.0))  # type: ignore[arg-type]
        print(f"{r['name']:26} {n:8d} {kinds.get('result', 0):8d} {kinds.get('error', 0):8d} {fails:8d} "
              f"{kinds.get('slow', 0):5d} "
              f"{secs:8.1f} {n / secs if secs else 0:9.0f} {1000 * float(r.get('slowest', 0.0)):10.1f} "  # type: ignore[arg-type]
              f"{float(r.get('maxrss_mb', 0.0)):9.0f}")  # type: ignore[arg-type]
    for t in chosen:
        if t.missing:
            print(f"{t.name:26} {'not fuzzed: ' + t.missing}")
    print(f"# total wall {wall:.0f} s; 'rejected' = clean FlamedError; 'failures' = crash/hang/memory/property; "
          f"'slow' = over {args.time_limit:g} s once, but within {5 * args.time_limit:g} s when retried alone")
    for r in results:
        for f in r.get("failures", [])[:5]:  # type: ignore[index]
            print(f"FAIL {r['name']}: {f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
