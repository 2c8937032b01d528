"""``flamed serve`` as a real process on a free loopback port, always ended."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from support import ROOT


@contextmanager
def serve(*args: str, timeout: float = 60.0) -> Iterator[str]:
    with serve_process(*args, timeout=timeout) as (url, _proc):
        yield url


@contextmanager
def serve_process(*args: str, timeout: float = 60.0) -> Iterator[tuple[str, "subprocess.Popen[str]"]]:
    """:func:`serve` that also gives the process (its pid, for its memory)."""
    proc = subprocess.Popen([sys.executable, "-m", "flamed", "serve", *args, "--address", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = proc.stdout.readline()  # the server prints its URL once it listens
        assert line.startswith("flamed serve: http://"), (line, proc.stderr.read() if proc.poll() is not None else "")
        assert time.monotonic() < deadline
        yield line.split()[2], proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
