"""Developer check: FlameGraph's and inferno's collapse-perf regression corpora through `flamed collapse`.

    FLAMEGRAPH_DIR=~/FlameGraph INFERNO_DIR=~/inferno .venv/bin/python bench/corpus.py [-v]

The corpora stay in their checkouts (FlameGraph: test/*.txt and test/results/;
inferno: tests/data/collapse-perf/ and its results/). For every input and
option set, flamed's folded output is compared with the expected file after
the normalisations listed in CHOICES (differences flamed makes on purpose,
documented in docs/collapse.md). Any other difference is printed and makes
the exit status 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
FLAMED = [str(HERE / ".venv" / "bin" / "python"), "-m", "flamed", "collapse", "--format", "perf", "--jobs", "1"]

#: stackcollapse-perf.pl option -> flamed options.
OPTIONS = {
    "": ["--annotate", "inline"],  # inferno's default marks inlined frames
    "pid": ["--pid", "--annotate", "none"],
    "tid": ["--tid", "--annotate", "none"],
    "kernel": ["--annotate", "kernel"],
    "jit": ["--annotate", "jit"],
    "all": ["--annotate", "kernel,jit,inline"],
    # --addrs (raw addresses for unknown symbols) has no flamed equivalent: not compared.
}

_ARGS = re.compile(r"(?<=[\w>\]])\((?:[^()]|\([^()]*\))*\)(?= const|$|_\[)")


def _normalise(line: str) -> str:
    """Documented choices (docs/collapse.md, "Differences from stackcollapse-perf.pl")."""
    stack, _, count = line.rpartition(" ")
    frames = stack.split(";")
    out = []
    for f in frames:
        # stackcollapse-perf.pl cuts C++ argument lists ("f(int)" -> "f"); flamed keeps them.
        # Both cut at the first "(" (not a leading one, not "(anonymous namespace)"); suffix kept.
        if "(" in f[1:]:
            m = re.search(r"_\[[kjiw]\]$", f)
            suffix = m.group(0) if m else ""
            cut = re.sub(r"(?<=.)\((?!anonymous namespace\)).*", "", f[: len(f) - len(suffix)])
            f = cut + suffix if cut else f
        # Unknown symbols of a bracketed DSO: flamed writes [kernel.kallsyms], Perl [[kernel.kallsyms]].
        if f.startswith("[[") and "]]" in f:
            f = f[1:].replace("]]", "]", 1)
        out.append(f)
    return ";".join(out) + " " + count


#: Per input: flamed options replacing OPTIONS', and why.
OVERRIDES = {
    # inferno marks only perf-map-agent's "A->B" chains inlined; flamed also perf's own "(inlined)" frames.
    "cpp-stacks-std-function": ["--annotate", "none"],
}
#: Inputs whose remaining difference is a documented choice (docs/collapse.md), with the reason.
CHOICES = {
    ("flamegraph", "perf-rust-Yamakaky-dcpu"): "flamed demangles Rust legacy names perf left mangled (inferno's results are compared instead)",
    ("flamegraph", "perf-vertx-stacks-01"): "one frame without a symbol ('IP  (libc-2.15.so)'): Perl writes ' ', flamed [libc-2.15.so]; and the last sample, not ended by a blank line, kept",
    ("inferno", "single-line-stacks"): "two events (cycles:u, cycles): flamed keeps the first and says so; inferno mixes them",
}


def _flamegraph_quirks(line: str) -> str:
    """stackcollapse-perf.pl removes quotes from names and calls [vdso] frames kernel."""
    line = line.replace('"', "").replace("'", "")
    # Perl strips the "L" of Java classes only when the root is exactly "java" (not with --pid/--tid).
    line = re.sub(r"(?<=;)L(?=[A-Za-z_$][\w$]*(?:/[\w$]+)+(?:[:.(;]|$| ))", "", line)
    # A frame without a symbol ("IP  (DSO)"): Perl writes an empty frame, flamed the module.
    line = re.sub(r";\[libc-2\.15\.so\](?=;| )", ";", line)
    return re.sub(r"(__vdso_\w+)_\[k\]", r"\1", line)


def _without_last_record(text: str) -> str:
    """The input without its last sample (stackcollapse-perf.pl drops a sample not ended by a blank line)."""
    body = text.rstrip("\n")
    cut = body.rfind("\n\n")
    return body[: cut + 2] if cut >= 0 else ""


def _parse(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for ln in text.splitlines():
        if not ln.strip():
            continue
        ln = _normalise(ln)
        stack, _, n = ln.rpartition(" ")
        out[stack] = out.get(stack, 0) + int(n)
    return out


def _cases() -> list[tuple[str, Path, Path, str]]:
    cases = []
    fg = os.environ.get("FLAMEGRAPH_DIR")
    if fg:
        for src in sorted(Path(fg, "test").glob("*.txt")):
            for opt in OPTIONS:
                if not opt:
                    continue
                exp = Path(fg, "test", "results", f"{src.stem}-collapsed-{opt}.txt")
                if exp.exists():
                    cases.append(("flamegraph", src, exp, opt))
    inf = os.environ.get("INFERNO_DIR")
    if inf:
        d = Path(inf, "tests", "data", "collapse-perf")
        for exp in sorted((d / "results").glob("*-collapsed*.txt")):
            stem, _, opt = exp.stem.partition("-collapsed")
            opt = opt.lstrip("-")
            src = d / f"{stem}.txt"
            if not src.exists() and fg:
                src = Path(fg, "test", f"{stem}.txt")  # inferno keeps its own results for some upstream inputs
            if src.exists() and opt in OPTIONS:
                cases.append(("inferno", src, exp, opt))
    return cases


def main() -> int:
    verbose = "-v" in sys.argv
    cases = _cases()
    if not cases:
        print("corpus: set FLAMEGRAPH_DIR and/or INFERNO_DIR to checkouts", file=sys.stderr)
        return 2
    bad = 0
    choices = 0
    for corpus, src, exp, opt in cases:
        args = OVERRIDES.get(src.stem, OPTIONS[opt])
        r = subprocess.run([*FLAMED, *args, str(src)], capture_output=True, text=True, errors="replace")
        fix = _flamegraph_quirks if corpus == "flamegraph" else (lambda x: x)
        ours = _parse(fix(r.stdout))
        want = _parse(fix(exp.read_text(errors="replace")))
        text = src.read_text(errors="replace")
        if ours != want and not text.endswith("\n\n") and corpus == "flamegraph":
            # flamed keeps the last sample of a file that lacks the final blank line; Perl drops it.
            r2 = subprocess.run([*FLAMED, *args], input=_without_last_record(text), capture_output=True, text=True,
                                errors="replace")
            if _parse(fix(r2.stdout)) == want:
                print(f"ok   {corpus} {src.name} --{opt or 'default'} (last sample kept: see docs/collapse.md)")
                continue
        reason = CHOICES.get((corpus, src.stem))
        if ours != want and reason:
            choices += 1
            print(f"choice {corpus} {src.name} --{opt or 'default'}: {reason}")
            continue
        if r.returncode != 0 or ours != want:
            bad += 1
            only_w = sorted(set(want.items()) - set(ours.items()))
            only_o = sorted(set(ours.items()) - set(want.items()))
            print(f"DIFF {corpus} {src.name} --{opt or 'default'}: {len(only_w)} expected lines missing, "
                  f"{len(only_o)} extra (rc {r.returncode})")
            if verbose:
                for (s1, n1), (s2, n2) in zip(only_w[:3], only_o[:3]):
                    a, b = s1.split(";"), s2.split(";")
                    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    print(f"   - ...{';'.join(a[i:i + 3])[:200]} {n1}")
                    print(f"   + ...{';'.join(b[i:i + 3])[:200]} {n2}")
                for s2, n2 in only_o[len(only_w):][:2]:
                    print(f"   + {s2[:200]} {n2}")
                for s1, n1 in only_w[len(only_o):][:2]:
                    print(f"   - {s1[:200]} {n1}")
                if r.stderr.strip():
                    print("   stderr: " + r.stderr.strip().splitlines()[0][:300])
        else:
            print(f"ok   {corpus} {src.name} --{opt or 'default'}")
    print(f"corpus: {len(cases) - bad - choices}/{len(cases)} cases equal, {choices} documented choices, {bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
