"""The progress line of the long offline jobs, seen on a real terminal (a pseudo-terminal as stderr).

Every long command (svg, top, tree, export, merge, as collapse did) draws it
when stderr is a terminal and the input is large, and never otherwise; the
output is the same bytes either way.  Ctrl-C while it is drawn clears it, exits
130 with one line and leaves no output file, half-written or other.
"""

from __future__ import annotations

import os
import pty
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.concurrent

FLAMED = [sys.executable, "-m", "flamed"]
#: Every wait of these tests ends by this many seconds (the runs take one or two).
WAIT = 60.0


def _stacks(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        depth = rng.randrange(3, 25)
        frames = [f"worker-{1000 + i % 4}/{2000 + i % 7}"] + [f"func_{rng.randrange(300)}" for _ in range(depth)]
        out.append(";".join(frames))
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folded file and two traces just over the size that gets a progress line (4 MB)."""
    d = tmp_path_factory.mktemp("progress")
    stacks = _stacks(20_000, 1)
    rng = random.Random(2)
    folded = d / "big.folded"
    bad = False
    with folded.open("w") as f:
        while f.tell() < 5_000_000:
            f.write(f"{rng.choice(stacks)} {rng.randrange(1, 50)}\n")
            if f.tell() > 2_500_000 and not bad:
                # A malformed line: its message comes while the progress line is drawn.
                f.write("no count here\n")
                bad = True
    out = {"folded": folded}
    for name in ("a", "b"):
        t = 1_700_000_000_000_000_000
        path = d / f"{name}.trace"
        with path.open("w") as f:
            while f.tell() < 4_500_000:
                t += rng.randrange(1_000, 2_000_000)
                f.write(f"{t} {rng.choice(stacks)} 1\n")
        out[name] = path
    return out


def _drain(master: int, until: float, stop: bytes | None = None) -> bytes:
    """What the terminal shows until its writers have all closed it (or ``stop`` appears), ``until`` at the latest."""
    seen = b""
    while time.monotonic() < until:
        r, _, _ = select.select([master], [], [], 0.5)
        if not r:
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: no writer is left
            break
        if not chunk:
            break
        seen += chunk
        if stop is not None and stop in seen:
            break
    return seen


def _run_on_terminal(args: list[str]) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([*FLAMED, *args], stderr=slave, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        os.close(slave)
        slave = -1
        seen = _drain(master, time.monotonic() + WAIT)
        return p.wait(timeout=WAIT), seen
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)


CASES = {
    "svg": (["svg", "{folded}"], "svg"),
    "svg-flamechart": (["svg", "--flamechart", "{folded}"], "svg"),
    "top": (["top", "--jobs", "1", "{folded}"], "txt"),
    "tree": (["tree", "--jobs", "1", "{folded}"], "json"),
    "export-pprof": (["export", "--format", "pprof", "{folded}"], "pb"),
    "export-chrometrace": (["export", "--format", "chrometrace", "{a}"], "json"),
    "merge": (["merge", "{a}", "{b}"], "trace"),
    "merge-sort": (["merge", "--sort", "{a}", "{b}"], "trace"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_progress_line_on_a_terminal_only_and_the_same_output(case: str, inputs: dict[str, Path], tmp_path: Path) -> None:
    words, ext = CASES[case]
    args = [w.format(**{k: str(v) for k, v in inputs.items()}) for w in words]
    cmd = args[0]
    on_tty = tmp_path / f"tty.{ext}"
    rc, shown = _run_on_terminal([*args, "-o", str(on_tty)])
    assert rc == 0, shown[-500:]
    # The bar of the reading: bytes read of the inputs, against their total size.
    assert f"{cmd}: [".encode() in shown and b" MB " in shown and b"%" in shown, shown[-500:]
    assert b"Traceback" not in shown
    # The line is cleared at the end, and before each message of the command
    # (the malformed line's, merge's remapped ids): every message on a line of its own.
    last_draw = shown.rindex(f"\r{cmd}: ".encode())
    assert b"\r\x1b[K" in shown[last_draw + 1 :], shown[-300:]
    messages = [i for i in range(len(shown)) if shown.startswith(f"flamed {cmd}: ".encode(), i)]
    for i in messages:
        assert i == 0 or shown[:i].endswith((b"\n", b"\r\x1b[K")), shown[max(0, i - 120) : i + 80]
    if "{folded}" in words:
        assert f"flamed {cmd}: skipped 1 malformed line".encode() in shown, shown[-300:]

    piped = tmp_path / f"pipe.{ext}"
    r = subprocess.run([*FLAMED, *args, "-o", str(piped)], capture_output=True, timeout=WAIT, check=False)
    assert r.returncode == 0, r.stderr[-500:]
    assert b"\r" not in r.stderr and b"MB" not in r.stderr and b"\x1b" not in r.stderr, r.stderr[-300:]
    assert on_tty.read_bytes() == piped.read_bytes()


def test_ctrl_c_while_the_line_is_drawn_leaves_no_output_file(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A streaming merge writes its output as it reads; one of its inputs is a pipe
    this test feeds, so the run is still reading (and its output half written to a
    temporary file) when the progress line shows and SIGINT comes."""
    out = tmp_path / "merged.trace"
    out.write_bytes(b"the previous output\n")
    stacks = _stacks(2_000, 3)
    rng = random.Random(4)
    t = 1_800_000_000_000_000_000
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [*FLAMED, "merge", str(inputs["a"]), "-", "-o", str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        # A shell without job control starts background jobs with SIGINT ignored,
        # and Python keeps it so: give the command the default, as a terminal's has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(slave)
    assert p.stdin is not None
    shown = b""
    try:
        os.set_blocking(p.stdin.fileno(), False)
        deadline = time.monotonic() + WAIT
        pending = b""
        # Feed the pipe until the line shows (stdin's size is unknown: it is drawn
        # once the reading has gone on for a moment).
        while b"merge: " not in shown:
            assert time.monotonic() < deadline, shown[-300:]
            assert p.poll() is None, shown[-500:]
            if not pending:
                lines = []
                for _ in range(2_000):
                    t += rng.randrange(1_000, 2_000_000)
                    lines.append(f"{t} {rng.choice(stacks)} 1\n")
                pending = "".join(lines).encode()
            _, w, _ = select.select([], [p.stdin], [], 0.05)
            if w:
                try:
                    pending = pending[os.write(p.stdin.fileno(), pending) :]
                except BlockingIOError:
                    pass
            r, _, _ = select.select([master], [], [], 0)
            if r:
                shown += os.read(master, 65536)
        # The output is being written: its temporary file is there beside it.
        assert any(f.name.startswith(".merged.trace.") for f in tmp_path.iterdir())
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=WAIT)
        shown += _drain(master, time.monotonic() + WAIT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=WAIT)
        p.stdin.close()
        os.close(master)
    assert rc == 130, shown[-500:]
    text = shown.decode("utf-8", "replace")
    assert "Traceback" not in text, text[-1000:]
    # The line is cleared, then the one message: on a line of its own.
    assert "\r\x1b[Kflamed merge: interrupted" in text, text[-300:]
    # No output file: the previous one untouched, no temporary file left.
    assert out.read_bytes() == b"the previous output\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["merged.trace"]


def test_a_second_ctrl_c_never_prints_a_traceback(inputs: dict[str, Path], tmp_path: Path) -> None:
    """Ctrl-C twice, 10 ms apart: the second came as a KeyboardInterrupt while
    the first was being handled (the output's last flush, the interpreter's
    shutdown) and printed a 15-line traceback, 2 runs in 6 here.  Once the first
    is handled, another one ends the process by the signal, as a shell expects.
    Its timing is the user's: several runs, each of which must end cleanly."""
    out = tmp_path / "merged.trace"
    for _ in range(6):
        # the two traces three times over: a run of a few seconds
        p = subprocess.Popen([*FLAMED, "merge", "--sort", *[str(inputs[k]) for k in "ababab"], "-o", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            time.sleep(0.6)  # the sort is under way
            p.send_signal(signal.SIGINT)
            time.sleep(0.01)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            rc = p.wait(timeout=WAIT)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=WAIT)
        err = p.stderr.read().decode("utf-8", "replace") if p.stderr else ""
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert rc in (130, -signal.SIGINT), (rc, err)
        assert not out.exists()  # interrupted: no output
        assert not [f for f in tmp_path.iterdir() if f.name.startswith(".merged")]
