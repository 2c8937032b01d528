"""Ctrl-C during ``flamed collapse --jobs N``: a real process group gets SIGINT, as from a terminal.

The parent must exit 130 promptly, print no worker traceback and leave no
output file; the workers ignore SIGINT and are shut down by the parent.  Run
several times per input kind (gzip file, stdin being fed, stdin stalled): a
worker dying of the signal while holding a queue lock hung the parent in some
runs only.
"""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flamed.procstat import read_stat, running
from support import DATA

ROOT = Path(__file__).resolve().parents[2]
JOBS = 3
#: How long a run may take to exit after SIGINT (it takes well under a second).
EXIT_WITHIN = 10.0


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        fields = read_stat(f"/proc/{d}/stat")
        if fields is not None and len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(d))
    return out


def _wait_for_workers(p: subprocess.Popen[bytes], ended: Callable[[], str]) -> None:
    """Until ``p`` has its JOBS workers (30 s at most); ``ended()`` says why when ``p`` ends first."""
    deadline = time.monotonic() + 30
    while len(_children(p.pid)) < JOBS:
        assert p.poll() is None, ended()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.01)


def _reset_sigint() -> None:
    # A shell without job control starts background jobs with SIGINT ignored, and
    # Python keeps an ignored SIGINT ignored: give the command the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def perf_text() -> bytes:
    return gzip.decompress((DATA / "perf" / "system-wide.txt.gz").read_bytes())


@pytest.fixture(scope="module")
def big_gzip(tmp_path_factory: pytest.TempPathFactory, perf_text: bytes) -> Path:
    # Many gzip members of one real capture: hundreds of MB of perf script (more
    # than a run gets through before it is interrupted) from a small file.
    member = gzip.compress(perf_text, compresslevel=6)
    path = tmp_path_factory.mktemp("interrupt") / "big.perf.gz"
    with open(path, "wb") as f:
        for _ in range(400):
            f.write(member)
    return path


def _interrupt(tmp_path: Path, source: str, perf_text: bytes, big_gzip: Path, delay: float) -> None:
    out = tmp_path / "out.folded"
    args = [sys.executable, "-m", "flamed", "collapse", "--jobs", str(JOBS), "--chunk-size", "262144"]
    args += [str(big_gzip)] if source == "gzip" else ["-"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    err_path = tmp_path / "stderr.txt"
    # stderr to a file: a pipe would not reach end of file while a worker outlived the command.
    err_file = open(err_path, "wb")  # noqa: SIM115 - closed in the finally below
    p = subprocess.Popen(
        [*args, "-o", str(out)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE if source != "gzip" else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err_file,
        start_new_session=True,
        preexec_fn=_reset_sigint,
    )
    stop = threading.Event()

    def feed() -> None:
        # "stdin": fed for as long as the command runs; "stalled": a few chunks, then
        # nothing more while the pipe stays open (the workers wait for work).
        assert p.stdin is not None
        try:
            n = 0
            while not stop.is_set() and (source == "stdin" or n < 3):
                p.stdin.write(perf_text)
                p.stdin.flush()
                n += 1
            stop.wait()
        except (BrokenPipeError, OSError):
            pass

    feeder = threading.Thread(target=feed, daemon=True) if source != "gzip" else None
    if feeder is not None:
        feeder.start()
    try:
        _wait_for_workers(p, lambda: f"collapse ended before it was interrupted: {err_path.read_text()!r}")
        time.sleep(delay)
        workers = _children(p.pid)
        assert p.poll() is None, "collapse ended before it was interrupted"
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        try:
            rc = p.wait(timeout=EXIT_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{source}: still running {EXIT_WITHIN:.0f} s after SIGINT")
        took = time.monotonic() - t0
        err = err_path.read_text(errors="replace")
        assert rc == 130, f"{source}: exit {rc}, stderr {err!r}"
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert "flamed collapse: interrupted" in err, err
        assert not out.exists()
        assert took < EXIT_WITHIN
        # No worker outlives the command.
        deadline = time.monotonic() + 5
        while any(running(f"/proc/{w}/stat") for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running(f"/proc/{w}/stat") for w in workers)
    finally:
        stop.set()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever is left of the group (a failing run)
        except ProcessLookupError:
            pass
        p.wait()
        err_file.close()
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
        if feeder is not None:
            feeder.join(5)


@pytest.mark.parametrize("run", range(4))
@pytest.mark.parametrize("source", ["gzip", "stdin", "stalled"])
def test_sigint_to_the_group_exits_130_promptly(
    tmp_path: Path, source: str, run: int, perf_text: bytes, big_gzip: Path
) -> None:
    _interrupt(tmp_path, source, perf_text, big_gzip, delay=0.05 * run)


@pytest.mark.parametrize("source", ["gzip", "stalled"])
def test_workers_go_when_the_parent_is_killed_outright(
        tmp_path: Path, source: str, perf_text: bytes, big_gzip: Path) -> None:
    """SIGKILL to the parent alone (the OOM killer, kill -9), busy or waiting for
    input: the workers, which ignore Ctrl-C, still go (the pool's queues end
    with their parent)."""
    args = [sys.executable, "-m", "flamed", "collapse", "--jobs", str(JOBS), "--chunk-size", "262144",
            str(big_gzip) if source == "gzip" else "-", "-o", str(tmp_path / "out.folded")]
    p = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         stdin=subprocess.DEVNULL if source == "gzip" else subprocess.PIPE,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers: list[int] = []
    try:
        if p.stdin is not None:
            p.stdin.write(perf_text)  # some work, then nothing more while stdin stays open
            p.stdin.flush()
        _wait_for_workers(p, lambda: "collapse ended before its workers started")
        time.sleep(0.3)
        workers = _children(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while any(running(f"/proc/{w}/stat") for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running(f"/proc/{w}/stat") for w in workers), "workers outlived their parent"
        assert not (tmp_path / "out.folded").exists()
    finally:
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
