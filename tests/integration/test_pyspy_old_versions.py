"""`flamed record` on CPython 2.7, 3.6 and 3.7: versions the BPF walker has no
layout for (it reads 3.8-3.13) but py-spy reads, so their Python frames come
from py-spy, joined to the BPF samples by time (flamed/pyspy/).  Before, the
process watcher turned these versions away and the profile had no Python
frames at all ("no Python process was found").

tests/workloads/py_old.py alternates 100 ms of a pure-Python loop
(old_compute) and of os.urandom (old_kernel: the kernel's random number
generator), so the kernel's RNG frames must sit under old_kernel and the
native frames of os.urandom between them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpython_support import pyenv_python
from flamed.folded import read_folded
from support import ROOT, need

FLAMED = [sys.executable, "-m", "flamed"]
WORKLOAD = str(ROOT / "tests" / "workloads" / "py_old.py")
#: The kernel's RNG: what only old_kernel's os.urandom runs.
RNG = ("get_random_bytes_user_[k]", "chacha_block_generic_[k]", "urandom_read_iter_[k]")

pytestmark = [pytest.mark.bpf, pytest.mark.pyspy]


def record(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(FLAMED + ["record", "--no-daemon", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("run", [1, 2])
@pytest.mark.parametrize("minor", ["2.7", "3.6", "3.7"])
def test_old_cpython_gets_python_frames_from_pyspy(minor: str, run: int, tmp_path: Path, require_bpf: None,
                                                   require_pyspy: str) -> None:
    python = pyenv_python(minor)
    out = tmp_path / "out.folded"
    r = record(["-o", str(out), "--", str(python), WORKLOAD, "2"])
    assert r.returncode == 0, r.stderr
    assert "no Python process was found" not in r.stderr, r.stderr
    assert "by py-spy (unsupported_version)" in r.stderr, r.stderr
    p = read_folded(out.open("rb"))
    total = sum(p.stacks.values())
    named = sum(n for s, n in p.stacks.items() if any(f.startswith(("old_compute (", "old_kernel (")) for f in s))
    rng = {s: n for s, n in p.stacks.items() if any(f in RNG for f in s)}
    rng_n = sum(rng.values())
    under = 0
    for s, n in rng.items():
        py = [i for i, f in enumerate(s) if f.startswith("old_kernel (")]
        k = min(i for i, f in enumerate(s) if f.endswith("_[k]"))
        # old_kernel, then native frames (os.urandom's C code), then the kernel's
        if py and py[-1] < k - 1 and not any(f.endswith("_[k]") or " (" in f for f in s[py[-1] + 1:k]):
            under += n
    summary = f"{minor}: {named}/{total} named, {under}/{rng_n} RNG samples under old_kernel\n{r.stderr}"
    assert total >= 100, summary  # ~2 s at the default 99 Hz
    assert named >= 0.9 * total, summary
    assert rng_n >= 0.2 * total, summary
    # py-spy's first window used to start before the clock's uprobe was
    # attached (the walker refuses these versions first), and the clock fit,
    # anchored on a first hit that was then a later call, put its stacks 5-51 ms
    # late (matched=1): up to 20 % of the RNG samples under old_compute.  Now
    # none or nearly none are; a RNG sample under neither function is one taken
    # before py-spy's first sample (0.35 s of them when the clock's uprobe
    # program is compiled, not loaded from the cache), which `named` bounds.
    compute_rng = sum(n for s, n in rng.items() if any(f.startswith("old_compute (") for f in s))
    assert under >= 0.95 * (under + compute_rng), summary
    assert under >= 0.8 * rng_n, summary


def test_version_nobody_reads_is_named(tmp_path: Path, require_bpf: None, require_pyspy: str) -> None:
    """A Python neither the walker nor py-spy reads (3.2 here: a static interpreter
    renamed, which the watcher knows by its executable's name) is said so."""
    static = Path("/usr/bin/python3.11")
    need(static.exists(), "Debian's static /usr/bin/python3.11")
    fake = tmp_path / "python3.2"
    shutil.copy(static, fake)
    out = tmp_path / "out.folded"
    r = record(["-o", str(out), "--", str(fake), "-c",
                "import time\nt = time.time()\nwhile time.time() - t < 1: pass"])
    assert r.returncode == 0, r.stderr
    assert "Python 3.2 is not supported" in r.stderr, r.stderr
    assert "no Python process was found" not in r.stderr, r.stderr
