#!/usr/bin/env python3
"""Rate of impossible Python frames in `flamed record` output.

Run as root from the worktree:

    sudo .venv/bin/python bench/py_wrong_frames.py [-n ROUNDS] [-r HZ] [--secs S] [--python EXE ...] [--daemon]

Short programs written to a temporary directory, each run ROUNDS times per
interpreter under one `flamed record --no-daemon --subprocesses` (one BPF
compile for all): ``heavy`` imports a dozen stdlib packages (module top
levels run once, then freed) before a CPU-bound outer/mid/leaf; ``churn``
makes functions with exec and lambdas with eval in a loop, each calling a
known leaf; ``recur`` recurses 1-60 frames deep through two functions, many
frames pushed and popped per millisecond; ``cpu`` is the plain outer/mid/leaf.

A stack is flagged when its Python frames cannot be real: a caller -> callee
pair between the programs' own functions that their source does not hold,
a program frame under a library frame, a root other than the program's
``<module>``; and, during start-up, a frame other than a module's top level
(or an import) directly under importlib's ``_call_with_frames_removed``,
unless an extension module's init is between them.  ``[unknown python
code ...]`` and ``[stale python code ...]`` frames are honest, never flagged.
Prints samples, flagged samples and the rate per interpreter, and the most
frequent flagged pairs.

``--daemon`` runs the same programs through a daemon instead (``-r`` Hz,
1 s drains, everything under a temporary directory): each interpreter is
started through a symlink named ``fwf<k>``, so the daemon's snapshot of the
whole run (root ``comm``) is filtered to the programs' own samples.
``--load N`` keeps N busy shell loops running meanwhile (a loaded host: the
profiler's own threads get the CPU later).  Interpreters default to python3.11 and what
$(pyenv root)/versions holds of 3.11-3.13.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_LEAVES = '''
def leaf(n):
    s = 0
    for i in range(n):
        s += i * i
    return s
def mid(n):
    return leaf(n) + leaf(n // 2)
def outer(deadline):
    t = 0
    while time.time() < deadline:
        t += mid(2000)
    return t
outer(time.time() + float(sys.argv[1]))
'''
PROGRAMS = {
    "cpu": "import sys, time\n" + _LEAVES,
    "heavy": ("import sys, time\nimport json, email.parser, http.client, argparse, asyncio, xml.dom.minidom, "
              "decimal, logging.handlers, unittest, typing, dataclasses, csv, difflib\n" + _LEAVES),
    "churn": '''import sys, time
def leafa(n):
    s = 0
    for i in range(n):
        s += i
    return s
def leafb(n):
    s = 0
    for i in range(n):
        s -= i
    return s
def leafc(n):
    s = 1
    for i in range(n):
        s ^= i
    return s
SRC = "def fn{k}(n):\\n    return {leaf}(n) + {leaf}(n >> 1)\\n"
def driver(deadline):
    t = 0
    k = 0
    while time.time() < deadline:
        k += 1
        ns = {"leafa": leafa, "leafb": leafb, "leafc": leafc}
        exec(compile(SRC.format(k=k % 3, leaf=("leafa", "leafb", "leafc")[k % 3]), "churn_exec", "exec"), ns)
        t += ns["fn%d" % (k % 3)](300)
        t += eval(compile("lambda n: rec(n)", "churn_eval", "eval"), {"rec": rec})(20)
    return t
def rec(n):
    if n <= 0:
        return tiny(n)
    return rec(n - 1) + 1
def tiny(n):
    return n + 1
driver(time.time() + float(sys.argv[1]))
''',
    "recur": '''import sys, time
def tiny(n):
    return n + 1
def reca(n):
    if n <= 0:
        return tiny(n)
    return recb(n - 1) + 1
def recb(n):
    if n <= 0:
        return tiny(n)
    return reca(n - 1) + 1
def driver(deadline):
    t = 0
    d = 1
    while time.time() < deadline:
        d = d % 60 + 1
        t += reca(d)
    return t
driver(time.time() + float(sys.argv[1]))
''',
}
PROG_FILES = {f"{p}.py" for p in PROGRAMS} | {"churn_exec", "churn_eval"}
ALLOWED = {
    ("<module>", "outer"), ("outer", "mid"), ("mid", "leaf"),
    ("<module>", "driver"), ("driver", "fn0"), ("driver", "fn1"), ("driver", "fn2"),
    ("fn0", "leafa"), ("fn1", "leafb"), ("fn2", "leafc"), ("driver", "<lambda>"), ("driver", "<module>"),
    ("<lambda>", "rec"), ("rec", "rec"), ("rec", "tiny"),
    ("driver", "reca"), ("reca", "recb"), ("recb", "reca"), ("reca", "tiny"), ("recb", "tiny"),
}
PY = re.compile(r"^(.*) \(([^()]*):(\d+)\)$")
HONEST = re.compile(r"^\[(unknown python code|python code|stale python code).*\]$")
EXT_INIT = re.compile(r"PyInit|_imp_create|_imp_exec|exec_builtin|PyImport_Import")


def _python_frames(stack: list[str]) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """The Python frames (name, file) root first, and the native frames between each two."""
    frames: list[tuple[str, str]] = []
    between: list[list[str]] = []
    cur: list[str] = []
    for f in stack:
        m = PY.match(f)
        if m or HONEST.match(f):
            if frames:
                between.append(cur)
            cur = []
            frames.append((m.group(1), m.group(2).rsplit("/", 1)[-1]) if m else ("?", "?"))
        else:
            cur.append(f)
    return frames, between


def impossible(stack: list[str]) -> str | None:
    """Why the stack's Python frames cannot be real, or None."""
    fr, between = _python_frames(stack)
    if not fr:
        return None
    if any(fl in PROG_FILES for _, fl in fr):
        if fr[0][0] != "?" and (fr[0][1] not in PROG_FILES or fr[0][0] != "<module>"):
            return f"root {fr[0][0]} ({fr[0][1]})"
        for (a, fa), (b, fb) in zip(fr, fr[1:]):
            if "?" in (a, b):
                continue
            pa, pb = fa in PROG_FILES, fb in PROG_FILES
            if (pa and pb and (a, b) not in ALLOWED) or (pa and not pb and a != "<module>") or (pb and not pa):
                return f"{a} ({fa}) -> {b} ({fb})"
        return None
    for ((a, _fa), (b, fb)), nat in zip(zip(fr, fr[1:]), between):
        if any(EXT_INIT.search(n) for n in nat):
            continue
        if a == "_call_with_frames_removed" and b not in ("<module>", "?", "_find_and_load", "_gcd_import"):
            return f"{a} -> {b} ({fb})"
    return None


def _default_pythons() -> list[str]:
    out = ["python3.11"]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for minor in ("11", "12", "13"):
        found = sorted(root.glob(f"3.{minor}.*/bin/python3.{minor}")) if root.is_dir() else []
        if found:
            out.append(str(found[-1]))
    return out


def _which(py: str) -> str:
    if os.sep in py:
        return py
    for d in ["/usr/bin"] + os.environ.get("PATH", "").split(os.pathsep):  # Debian's, not a pyenv shim
        if os.access(os.path.join(d, py), os.X_OK):
            return os.path.join(d, py)
    raise SystemExit(f"{py}: not found")


def _through_daemon(d: Path, rate: int, script: str, out: Path, nruns: int) -> bool:
    """Run ``script`` under a daemon of its own; its samples of the run into ``out`` (folded, root comm)."""
    sys.path.insert(0, str(ROOT))
    from flamed.daemon.client import request  # noqa: PLC0415 -- the checkout's own client

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = d / "flamed.sock"
    cfg = d / "flamed.toml"
    cfg.write_text(f"""
[sampling]
frequency = {rate}
drain_interval = 1.0
[output]
state_dir = "{d / 'profiles'}"
rotate_interval = 600.0
[metrics]
address = "127.0.0.1:{port}"
[control]
socket = "{sock}"
[log]
target = "stderr"
""")
    log = open(d / "daemon.log", "w")
    daemon = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)], cwd=ROOT,
                              stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while True:
            if daemon.poll() is not None or time.monotonic() > deadline:
                print((d / "daemon.log").read_text()[-3000:], file=sys.stderr)
                return False
            try:
                request(str(sock), {"request": "status"}, timeout=2.0)
                break
            except Exception:  # noqa: BLE001 -- not listening yet
                time.sleep(0.2)
        time.sleep(2)
        t0 = time.monotonic()
        subprocess.run(["sh", "-c", script], timeout=600 + 10 * nruns, check=False)
        time.sleep(3)  # the last windows drained
        buf = io.BytesIO()
        request(str(sock), {"request": "snapshot", "seconds": int(time.monotonic() - t0) + 5, "root": "comm"},
                buf, timeout=120)
        out.write_bytes(buf.getvalue())
        return True
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--rounds", type=int, default=3, help="runs of each program per interpreter (3)")
    ap.add_argument("-r", "--rate", type=int, default=499, help="samples per second (499)")
    ap.add_argument("--secs", type=float, default=0.3, help="seconds each program runs after start-up (0.3)")
    ap.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated subset of " + ",".join(PROGRAMS))
    ap.add_argument("--python", action="append", help="interpreter (repeatable; default: see above)")
    ap.add_argument("--keep", help="also write the recorded folded stacks to this file")
    ap.add_argument("--daemon", action="store_true", help="through a daemon (see above), not flamed record")
    ap.add_argument("--load", type=int, default=0, help="busy loops running meanwhile (0)")
    a = ap.parse_args()
    pythons = a.python or _default_pythons()
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(a.load)]
    try:
        return _run(a, pythons)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def _run(a: argparse.Namespace, pythons: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="flamed-wrongframes-") as d:
        runs = []
        for name in a.programs.split(","):
            Path(d, f"{name}.py").write_text(PROGRAMS[name])
        for _ in range(a.rounds):
            for name in a.programs.split(","):
                for py in pythons:
                    runs.append(f"{shlex.quote(py)} {shlex.quote(str(Path(d, name + '.py')))} {a.secs}")
        out = Path(a.keep or Path(d, "out.folded"))
        if a.daemon:
            labels = {}
            for k, py in enumerate(pythons):
                link = Path(d, f"fwf{k}")
                os.symlink(os.path.realpath(_which(py)), link)
                labels[link.name] = py
            runs = []
            for _ in range(a.rounds):
                for name in a.programs.split(","):
                    for k in range(len(pythons)):
                        runs.append(f"{shlex.quote(str(Path(d, f'fwf{k}')))} "
                                    f"{shlex.quote(str(Path(d, name + '.py')))} {a.secs}")
            if not _through_daemon(Path(d), a.rate, "; ".join(runs), out, len(runs)):
                return 1
        else:
            r = subprocess.run([sys.executable, "-m", "flamed", "record", "--no-daemon", "--subprocesses", "-r",
                                str(a.rate), "-o", str(out), "--", "sh", "-c", "; ".join(runs)],
                               cwd=ROOT, capture_output=True, text=True, timeout=600 + 10 * len(runs))
            if r.returncode != 0:
                print(r.stderr, file=sys.stderr)
                return 1
        total: collections.Counter[str] = collections.Counter()
        bad: collections.Counter[str] = collections.Counter()
        reasons: collections.Counter[str] = collections.Counter()
        honest = 0
        for line in out.read_text(errors="replace").splitlines():
            stack_text, _, n_text = line.rpartition(" ")
            if not n_text.isdigit():
                continue
            n = int(n_text)
            stack = stack_text.split(";")
            if a.daemon:  # the daemon's root frame is the comm: fwf<k>, or another process
                if stack[0] not in labels:
                    continue
                interp = Path(labels[stack[0]]).name + (f" [{stack[0]}]" if len(pythons) > 1 else "")
            else:
                interp = stack[0].rsplit("-", 1)[0]  # --subprocesses labels each stack with comm-pid
            total[interp] += n
            honest += n * sum(1 for f in stack if f.startswith("[stale python code") or
                              f.startswith("[unknown python code"))
            why = impossible(stack)
            if why:
                bad[interp] += n
                reasons[why] += n
    for interp in sorted(total):
        t = total[interp]
        print(f"{interp:12s} samples {t:7d}  impossible {bad[interp]:6d}  rate {bad[interp] / max(t, 1):.4%}")
    print(f"{'all':12s} samples {sum(total.values()):7d}  impossible {sum(bad.values()):6d}  "
          f"rate {sum(bad.values()) / max(sum(total.values()), 1):.4%}  (unknown/stale frames: {honest})")
    for why, n in reasons.most_common(10):
        print(f"  {n:6d}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
