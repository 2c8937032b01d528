"""A worker process that dies (the OOM killer, a kill -9) during ``--jobs N``.

Pool replaces the worker but not its task, whose result never came: the
parent waited for ever.  Now the command fails promptly, naming the cause,
and writes nothing.  The worker kills itself (SIGKILL) at a chosen task, so
the test needs no timing; each run is a subprocess bounded by a timeout.
"""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import DATA

ROOT = Path(__file__).resolve().parents[2]
#: A run that fails as it should ends in about a second; the old code never ended.
RUN_WITHIN = 60

# In the child, the module function a pool worker runs is replaced by one that
# kills the worker on a task the parent process never runs itself.
PATCHES = {
    # The chunk path (gzip input): every chunk is a worker's task.
    "chunks": """
        import flamed.collapse.driver as d
        real = d._parse_task
        def task(t):
            if t[3] > 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(t)
        d._parse_task = task
        argv = ["collapse", "--jobs", "2", "--chunk-size", "4096", INPUT + ".gz", "-o", OUT]
    """,
    # The range path (a plain file): the parent takes ranges too; a worker dies.
    "ranges": """
        import flamed.collapse.driver as d
        real = d._take_ranges
        parent = os.getpid()
        def take(*a):
            if os.getpid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a)
        d._take_ranges = take
        argv = ["collapse", "--jobs", "2", "--chunk-size", "4096", INPUT, "-o", OUT]
    """,
    # svg --jobs: folded text counted by ranges of lines.
    "svg": """
        import flamed.fastfolded as ff
        real = ff._count_range
        def count(t):
            if t[1] > 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(t)
        ff._count_range = count
        ff.PARALLEL_MIN_BYTES = 0
        argv = ["svg", "--jobs", "2", FOLDED, "-o", OUT]
    """,
}


@pytest.mark.parametrize("path", sorted(PATCHES))
def test_a_dead_worker_fails_the_run_instead_of_hanging_it(tmp_path: Path, path: str) -> None:
    perf = tmp_path / "perf.txt"
    perf.write_bytes(gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes()))
    (tmp_path / "perf.txt.gz").write_bytes(gzip.compress(perf.read_bytes()))
    folded = tmp_path / "in.folded"
    folded.write_text("main;a 1\nmain;b 2\n" * 2000)
    out = tmp_path / "out"
    script = "import os, signal, sys\n" + textwrap.dedent(PATCHES[path]) + textwrap.dedent(
        """
        from flamed.cli import main
        sys.exit(main(argv))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    consts = f"INPUT, FOLDED, OUT = {str(perf)!r}, {str(folded)!r}, {str(out)!r}\n"
    p = subprocess.Popen(
        [sys.executable, "-c", consts + script], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err = p.communicate(timeout=RUN_WITHIN)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"the run still waited for the dead worker's result after {RUN_WITHIN} s")
    assert p.returncode == 1, err.decode()
    assert "a worker process died (killed by SIGKILL" in err.decode()
    assert "Traceback" not in err.decode()
    assert not out.exists()
