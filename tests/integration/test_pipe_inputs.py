"""Inputs named by a path that reads only once: ``<(cmd)`` (a pipe), a FIFO,
``/dev/stdin`` on a pipe; and ``-`` given twice.

A command that looks at an input's head before reading it (to tell its
format) opens the path twice; for a pipe the second open goes on where the
first stopped.  Each command must give what it gives for the same bytes in a
regular file, or a clear error, never a profile with its first buffer missing
or a hang.
"""

from __future__ import annotations

import gzip
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support import DATA

pytestmark = pytest.mark.concurrent

FLAMED = [sys.executable, "-m", "flamed"]


def _bash(script: str, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["bash", "-c", script], capture_output=True, timeout=timeout)


def _cmd(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in [*FLAMED, *args])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pipes")
    perf = d / "perf.txt"
    perf.write_bytes(gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes()))
    folded = d / "many.folded"
    # well past one read buffer (8 KiB), so a lost first buffer cannot hide
    folded.write_text("".join(f"main;work;leaf{i} {i % 7 + 1}\n" for i in range(4000)))
    assert perf.stat().st_size > 64 << 10 and folded.stat().st_size > 64 << 10
    return {"perf": perf, "folded": folded}


# (command, its arguments before the input, the output's suffix)
COMMANDS = [
    ("svg", [], ".svg"),
    ("export", ["-f", "folded"], ".folded"),
    ("export", ["-f", "speedscope"], ".json"),
    ("merge", [], ".folded"),
    ("collapse", [], ".folded"),
    ("top", ["--limit", "0"], ".txt"),
    ("tree", [], ".json"),
]


@pytest.mark.parametrize("kind", ["perf", "folded"])
@pytest.mark.parametrize("command,extra,suffix", COMMANDS, ids=[f"{c[0]}{'-' + c[1][-1] if c[1] else ''}" for c in COMMANDS])
def test_a_process_substitution_reads_as_the_file(inputs: dict[str, Path], tmp_path: Path, kind: str,
                                                  command: str, extra: list[str], suffix: str) -> None:
    src = inputs[kind]
    want, got = tmp_path / f"file{suffix}", tmp_path / f"pipe{suffix}"
    r1 = _bash(_cmd(command, *extra, str(src), "-o", str(want)))
    assert r1.returncode == 0, r1.stderr.decode()
    r2 = _bash(f"{_cmd(command, *extra)} <(cat {shlex.quote(str(src))}) -o {shlex.quote(str(got))}")
    assert r2.returncode == 0, r2.stderr.decode()
    a, b = want.read_bytes(), got.read_bytes()
    # the input's name appears in some outputs (merge's header, the svg's title attribute)
    a = a.replace(str(src).encode(), b"INPUT")
    b = b.replace(b"/dev/fd/63", b"INPUT")
    assert a == b, (command, kind, len(a), len(b))


def test_diff_of_pipes_reads_both_whole(inputs: dict[str, Path], tmp_path: Path) -> None:
    src = shlex.quote(str(inputs["perf"]))
    r1 = _bash(_cmd("diff", "--format", "folded", str(inputs["perf"]), str(inputs["perf"])))
    r2 = _bash(f"{_cmd('diff', '--format', 'folded')} <(cat {src}) <(cat {src})")
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    assert r1.stdout == r2.stdout
    lines = r2.stdout.decode().splitlines()
    assert lines and all(ln.rsplit(" ", 2)[1] == ln.rsplit(" ", 2)[2] != "0" for ln in lines)


def _fifo_writer(path: Path, data: bytes) -> threading.Thread:
    def write() -> None:
        # opening blocks until the reader opens; give up if it never does
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
        except BrokenPipeError:
            pass
        finally:
            os.close(fd)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("command,extra", [("svg", []), ("export", ["-f", "folded"]), ("merge", [])])
def test_a_fifo_is_read_whole_and_does_not_hang(inputs: dict[str, Path], tmp_path: Path,
                                                command: str, extra: list[str]) -> None:
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    data = inputs["perf"].read_bytes()
    want = subprocess.run([*FLAMED, command, *extra, str(inputs["perf"])], capture_output=True, timeout=60)
    w = _fifo_writer(fifo, data)
    got = subprocess.run([*FLAMED, command, *extra, str(fifo)], capture_output=True, timeout=60)
    w.join(10)
    assert got.returncode == 0, got.stderr.decode()
    assert got.stdout.replace(str(fifo).encode(), b"INPUT") == want.stdout.replace(str(inputs["perf"]).encode(), b"INPUT")


def test_a_fifo_given_twice(inputs: dict[str, Path], tmp_path: Path) -> None:
    """Given twice, a FIFO reads as its file given twice while what was read of it
    is kept (its first MiB); past that, a clear error and no output file."""
    small = inputs["folded"]
    fifo = tmp_path / "twice.fifo"
    os.mkfifo(fifo)
    w = _fifo_writer(fifo, small.read_bytes())
    got = subprocess.run([*FLAMED, "export", "-f", "folded", str(fifo), str(fifo)], capture_output=True, timeout=60)
    w.join(10)
    want = subprocess.run([*FLAMED, "export", "-f", "folded", str(small), str(small)], capture_output=True, timeout=60)
    assert got.returncode == 0, got.stderr.decode()
    assert got.stdout == want.stdout
    big = tmp_path / "big.folded"
    big.write_text("".join(f"main;work;leaf{i} 1\n" for i in range(150_000)))
    assert big.stat().st_size > 2 << 20
    w = _fifo_writer(fifo, big.read_bytes())
    out = tmp_path / "out.folded"
    out.write_text("earlier\n")
    r = subprocess.run([*FLAMED, "export", "-f", "folded", str(fifo), str(fifo), "-o", str(out)],
                       capture_output=True, timeout=60)
    w.join(10)
    err = r.stderr.decode()
    assert r.returncode != 0 and "Traceback" not in err
    assert "can be read only once" in err and str(fifo) in err, err
    assert out.read_text() == "earlier\n"  # nothing half-made in its place


@pytest.mark.parametrize("command", ["collapse", "top", "tree", "svg", "export", "diff"])
def test_stdin_given_twice_is_a_clear_error(inputs: dict[str, Path], command: str) -> None:
    fmt = ["-f", "folded"] if command == "export" else []
    with open(inputs["folded"], "rb") as f:
        r = subprocess.run([*FLAMED, command, *fmt, "-", "-"], stdin=f, capture_output=True, timeout=60)
    err = r.stderr.decode()
    assert r.returncode != 0 and "Traceback" not in err, err
    assert "'-' can be given once" in err, err


@pytest.mark.parametrize("command", ["collapse", "svg", "merge", "top", "diff"])
def test_a_socket_or_an_unopenable_name_is_a_clear_error(tmp_path: Path, command: str) -> None:
    import socket

    sock_path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(sock_path))
        for bad, why in ((sock_path, "cannot open: No such device or address"),
                         (tmp_path / ("x" * 300), "cannot open: File name too long")):
            args = [str(bad), str(bad)] if command == "diff" else [str(bad)]
            r = subprocess.run([*FLAMED, command, *args], capture_output=True, timeout=60)
            err = r.stderr.decode()
            assert r.returncode != 0 and "Traceback" not in err, err
            assert f"{bad}: {why}" in err, err
    finally:
        s.close()
