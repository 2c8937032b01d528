"""How `flamed record -- COMMAND` ends, sampling here (no daemon): a command that
leaves a process running (a daemon's double fork, ``app &``), Ctrl-C while the
sampler stops, an error in the sampling loop, and a profile that cannot be
written while the command outlives -d.  Each ends with a message, a defined
exit status, the profile written where it can be and no process left behind
by record.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.folded import read_folded
from flamed.procstat import running
from support import ROOT

FLAMED = [sys.executable, "-m", "flamed"]

pytestmark = pytest.mark.bpf

#: A Python daemon: spins (its own samples have Python frames), then forks,
#: the child starts a session and forks again, the grandchild writes its pid
#: to argv[1] and spins for argv[2] seconds, and both parents exit at once.
DOUBLE_FORK = """
import os, sys, time
def spin_in_parent(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(500))
def spin_in_daemon(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(500))
spin_in_parent(0.5)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)  # as a daemon does: record's reader gets its EOF
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        spin_in_daemon(float(sys.argv[2]))
    os._exit(0)
os._exit(0)
"""

#: Runs flamed's CLI with BpfSampler's FAULT method patched (tests only): ``drain``
#: fails from its 3rd call; ``close`` first sends this process SIGINT (Ctrl-C while
#: the sampler stops) and lets it arrive.
FAULTY = """
import os, signal, sys, time
from flamed.sampling import bpf
fault = sys.argv.pop(1)
if fault == "drain":
    orig = bpf.BpfSampler.drain
    calls = [0]
    def drain(self, *a, **k):
        calls[0] += 1
        if calls[0] >= 3:
            raise RuntimeError("injected drain failure")
        return orig(self, *a, **k)
    bpf.BpfSampler.drain = drain
elif fault == "close":
    orig_close = bpf.BpfSampler.close
    def close(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        return orig_close(self)
    bpf.BpfSampler.close = close
from flamed.cli import main
sys.exit(main())
"""

SPIN = """
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: os._exit(3))  # stopped as Ctrl-C does: exit 3
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    sum(i * i for i in range(500))
"""


def record(args: list[str], timeout: float = 60, faulty: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    head = [sys.executable, "-c", FAULTY, faulty] if faulty else FLAMED
    return subprocess.run([*head, "record", "--no-daemon", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _pid_in(path: Path, wait_s: float = 10.0) -> int:
    """The pid a workload wrote to ``path`` (waiting a bounded time for it)."""
    end = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    return int(path.read_text())


def _kill(pid_file: Path) -> None:
    """The test leaves no workload behind, whatever it asserted."""
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _stacks_with(out: Path, frame: str) -> int:
    prof = read_folded(out.open("rb"))
    return int(sum(w for s, w in prof.stacks.items() if any(f.startswith(frame + " (") for f in s)))


def test_a_daemon_the_command_leaves_running_is_named_with_how_to_record_it(
        tmp_path: Path, require_bpf: None) -> None:
    """A Python command that double-forks a daemon and exits: its own samples have
    Python frames (so no "no Python process was found" hint came), and record
    stopped with it saying nothing of the daemon.  Now it names the daemon's pid
    and how to record it (-p, or --subprocesses)."""
    script = tmp_path / "daemonize.py"
    script.write_text(DOUBLE_FORK)
    pid_file = tmp_path / "daemon.pid"
    out = tmp_path / "out.folded"
    try:
        r = record(["-o", str(out), "--", sys.executable, str(script), str(pid_file), "4"])
        pid = _pid_in(pid_file)
    finally:
        _kill(pid_file)
    assert r.returncode == 0, r.stderr
    assert f"exited, leaving python (pid {pid}) running" in r.stderr, r.stderr
    assert f"record it with flamed record -p {pid}" in r.stderr, r.stderr
    assert "--subprocesses follows what the command leaves running" in r.stderr, r.stderr
    assert _stacks_with(out, "spin_in_daemon") == 0  # not recorded: the hint says how


def test_subprocesses_follows_what_the_command_leaves_running(tmp_path: Path, require_bpf: None) -> None:
    """``--subprocesses -- sh -c 'python3 app.py & exit 0'``: the recording ended
    when sh exited, with none of the Python child's samples.  Now the child is
    followed until it exits, and its Python frames are in the profile."""
    spin = tmp_path / "spin.py"
    spin.write_text(SPIN)
    pid_file = tmp_path / "child.pid"
    out = tmp_path / "out.folded"
    try:
        r = record(["--subprocesses", "-d", "30", "-o", str(out), "--", "sh", "-c",
                    f"{sys.executable} {spin} {pid_file} 2.5 & exit 0"])
        pid = _pid_in(pid_file)
    finally:
        _kill(pid_file)
    assert r.returncode == 0, r.stderr
    assert f"(pid {pid}) running" in r.stderr and "following it until it exits or -d ends" in r.stderr, r.stderr
    prof = read_folded(out.open("rb"))
    # 2.5 s of a spinning Python at 99 Hz: well over 20 samples even on a loaded host,
    # nearly all with its module's frames (before: none of them)
    mine = sum(w for s, w in prof.stacks.items() if any(f"{spin.name}:" in f for f in s))
    assert mine >= 20, (mine, r.stderr)
    assert not running(f"/proc/{pid}/stat")  # record returned once it had exited


def test_ctrl_c_while_the_sampler_stops_still_writes_the_profile_and_stops_the_command(
        tmp_path: Path, require_bpf: None) -> None:
    """-d ended with the command running; Ctrl-C came while the sampler stopped.
    record ended "interrupted" (130) without a profile, and the command, not yet
    waited for, was left running.  Now the stop completes, the profile is written
    and the command is stopped (SIGINT), its exit code record's."""
    spin = tmp_path / "spin.py"
    spin.write_text(SPIN)
    pid_file = tmp_path / "cmd.pid"
    out = tmp_path / "out.folded"
    try:
        r = record(["-d", "2", "-o", str(out), "--", sys.executable, str(spin), str(pid_file), "60"],
                   faulty="close")
        pid = _pid_in(pid_file)
    finally:
        _kill(pid_file)
    assert "stopping: the sampler stops and the profile is written first" in r.stderr, r.stderr
    assert "interrupted" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 3, r.stderr  # the command's, stopped by SIGINT
    assert read_folded(out.open("rb")).total() > 0, r.stderr
    assert not running(f"/proc/{pid}/stat"), r.stderr


def test_an_error_while_sampling_stops_the_command_and_writes_what_was_recorded(
        tmp_path: Path, require_bpf: None) -> None:
    """The sampling loop failed while a 60 s command ran: record waited for the
    command to exit by itself, and only then failed.  Now it says so, stops the
    command as Ctrl-C does, writes what was recorded and exits 1."""
    spin = tmp_path / "spin.py"
    spin.write_text(SPIN)
    pid_file = tmp_path / "cmd.pid"
    out = tmp_path / "out.folded"
    try:
        # The command runs 60 s: the old wait made this time out.
        r = record(["-o", str(out), "--", sys.executable, str(spin), str(pid_file), "60"], faulty="drain",
                   timeout=45)
        pid = _pid_in(pid_file)
    finally:
        _kill(pid_file)
    assert r.returncode == 1, r.stderr
    assert "the recording failed (RuntimeError: injected drain failure): stopping the" in r.stderr, r.stderr
    assert "error: the recording failed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert read_folded(out.open("rb"), strict=True).total() > 0, r.stderr  # the drains before the failure
    assert not running(f"/proc/{pid}/stat")


def test_a_failed_write_still_waits_for_a_command_that_outlives_the_duration(
        tmp_path: Path, require_bpf: None) -> None:
    """-d 1 with a command that runs on, and the output directory removed meanwhile:
    record said the write failed (saving the recording elsewhere) and exited 1 at
    once, leaving the command behind.  Now it waits for the command and exits with
    its code; the command itself marks that it ran to its end."""
    d = tmp_path / "gone"
    d.mkdir()
    saved = tmp_path / "tmp"
    saved.mkdir()
    done = tmp_path / "done"
    script = f"rmdir {d}; sleep 3; touch {done}; exit 5"
    env_tmp = {"TMPDIR": str(saved)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_tmp}
    r = subprocess.run([*FLAMED, "record", "--no-daemon", "-r", "49", "-d", "1", "-o", str(d / "x.folded"),
                        "--", "sh", "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 5, r.stderr
    assert done.exists(), r.stderr  # record returned after the command's end
    assert f"cannot write {d / 'x.folded'}" in r.stderr and "the recording was saved as folded text" in r.stderr
    assert "still runs after the -d recorded: waiting for it to exit" in r.stderr, r.stderr
    assert len(list(saved.glob("flamed-record-*.folded"))) == 1, r.stderr
