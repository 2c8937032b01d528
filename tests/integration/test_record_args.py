"""`flamed record` and `flamed snapshot`: what is refused before anything is recorded.

Options are checked as they are parsed (a usage error, exit 2, one line, no
BPF compile); -p names a live process, not a thread of one or a zombie; -o
(and --timeline) must be writable before the recording starts; and an output
that fails at the end anyway leaves the recording saved elsewhere.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.folded import read_folded
from support import ROOT

FLAMED = [sys.executable, "-m", "flamed"]
NO_SOCKET = "/nonexistent/flamed-test.sock"


def flamed(args: list[str], timeout: float = 20, cwd: Path = ROOT,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: this tree's flamed, also when run from another directory (cwd)
    return subprocess.run(FLAMED + args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def assert_usage_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "loading the BPF" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error:" in last, r.stderr
    for n in needles:
        assert n in last, r.stderr


@pytest.mark.parametrize("args, option", [
    (["record", "-p", "1", "--since", "10x"], "--since"),
    (["record", "-p", "1", "--since=-5s"], "--since"),
    (["record", "-p", "1", "--since", "nan"], "--since"),
    (["record", "-p", "1", "--since", "1e9h"], "--since"),
    (["record", "-p", "1", "--since", "8000000s"], "--since"),
    (["record", "--no-daemon", "-p", "1", "-d", "nan"], "-d/--duration"),
    (["record", "--no-daemon", "-p", "1", "-d", "inf"], "-d/--duration"),
    # through a daemon it was accepted (and recorded), standalone refused
    (["record", "--socket", NO_SOCKET, "-p", "1", "-d", "-1"], "-d/--duration"),
    (["record", "--socket", NO_SOCKET, "-p", "1", "-d", "0"], "-d/--duration"),
    (["record", "--no-daemon", "-p", "1", "-r", "0"], "-r/--rate"),
    (["record", "--no-daemon", "-p", "1", "--pyspy-rate", "100000"], "--pyspy-rate"),
    (["record", "--no-daemon", "-p", "1", "--mode", "offcpu", "--min-block-us", "-1"], "--min-block-us"),
    (["record", "--no-daemon", "-p", "1", "--mode", "offcpu", "--offcpu-every", "0"], "--offcpu-every"),
    (["record", "--no-daemon", "-p", "99999999999999999999", "-d", "1"], "-p/--pid"),
    (["snapshot", "--socket", NO_SOCKET, "--next", "inf"], "--next"),
    (["snapshot", "--socket", NO_SOCKET, "--next", "nan"], "--next"),
    (["snapshot", "--socket", NO_SOCKET, "--seconds", "nan"], "--seconds"),
    (["snapshot", "--socket", NO_SOCKET, "--seconds", "0"], "--seconds"),
    (["snapshot", "--socket", NO_SOCKET, "--timeout", "nan"], "--timeout"),
    (["snapshot", "--socket", NO_SOCKET, "--pid", "-3"], "--pid"),
    (["flush", "--socket", NO_SOCKET, "--timeout", "inf"], "--timeout"),
])
def test_numeric_options_are_checked_when_parsed(args: list[str], option: str) -> None:
    t0 = time.monotonic()
    r = flamed(args)
    assert_usage_error(r, f"argument {option}")
    assert time.monotonic() - t0 < 10


def test_since_accepts_durations() -> None:
    # parsed, then refused for want of a daemon: not a usage error
    for since in ("90", "60s", "5m", "1.5h", "500ms"):
        r = flamed(["record", "--socket", NO_SOCKET, "-p", str(os.getpid()), "--since", since, "-o", "-"])
        assert r.returncode == 1 and "no daemon to record through" in r.stderr, (since, r.stderr)


def test_duration_accepts_the_units_since_does() -> None:
    # -d 1m was refused ("expected seconds") while --since took 60s or 5m
    for d in ("90", "2.5", "60s", "5m", "1.5h", "500ms"):
        r = flamed(["record", "--socket", NO_SOCKET, "-p", str(os.getpid()), "-d", d, "-o", "-"])
        assert r.returncode == 1 and "no daemon to record through" in r.stderr, (d, r.stderr)
    assert_usage_error(flamed(["record", "--socket", NO_SOCKET, "-p", "1", "-d", "5x"]), "argument -d/--duration")


def test_unwritable_output_is_refused_before_recording(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for out, why in ((tmp_path / "missing" / "x.svg", "no directory"), (Path("/proc/x.folded"), "cannot create")):
        for mode in (["--no-daemon"], ["--socket", NO_SOCKET]):
            r = flamed(["record", *mode, "-o", str(out), *cmd])
            assert_usage_error(r, "-o/--output", why)
            assert not marker.exists(), "the command ran though the output could not be written"
    r = flamed(["record", "--no-daemon", "--timeline", str(tmp_path / "missing" / "t.txt"),
                "-o", str(tmp_path / "x.folded"), *cmd])
    assert_usage_error(r, "--timeline", "no directory")
    assert not marker.exists()


def test_the_timeline_and_the_profile_must_be_two_files(tmp_path: Path) -> None:
    """Once, -o and --timeline naming one file wrote the profile and then the
    timeline over it (with '-', both into one stream), and said it wrote the profile."""
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    same = tmp_path / "same.txt"
    os.symlink(same, tmp_path / "alias.txt")
    for tl, out in ((same, same), (same, tmp_path / "." / "same.txt"), (tmp_path / "alias.txt", same),
                    ("-", "-"), ("/dev/stdout", "-")):
        r = flamed(["record", "--no-daemon", "--timeline", str(tl), "-o", str(out), *cmd])
        assert_usage_error(r, f"--timeline {tl} is where the profile goes (-o)")
        assert not marker.exists(), "the command ran though its outputs collide"
    assert not same.exists()


def test_neither_a_pid_nor_a_command_is_said_as_such() -> None:
    assert_usage_error(flamed(["record", "--no-daemon", "-o", "/dev/null"]), "nothing to record")
    assert_usage_error(flamed(["record", "--no-daemon", "-p", "1", "--", "true"]), "not both")


def test_a_format_that_cannot_hold_a_profile_is_refused_before_recording(tmp_path: Path) -> None:
    """-f trace (or -o x.trace) needs each sample's time: --mode offcpu and wall
    sum waits per stack in BPF, without one.  Once, the command ran, was
    recorded, and only then did the write fail; it is refused before the
    command runs.  In CPU mode a trace is written (sampling here): through
    the daemon, whose windows are summed, it is refused as well."""
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for fmt_args, needle in ((["-f", "trace", "-o", str(tmp_path / "x.folded")], "-f/--format trace"),
                             (["-o", str(tmp_path / "x.trace")], "(the trace format)")):
        for mode in ("offcpu", "wall"):
            r = flamed(["record", "--no-daemon", "--mode", mode, *fmt_args, *cmd])
            assert_usage_error(r, needle, f"with --mode {mode} record writes waits summed per stack",
                               "cannot hold")
            assert not marker.exists(), "the command ran though its profile could not be written"
        r = flamed(["record", "--socket", NO_SOCKET, *fmt_args, *cmd])
        assert_usage_error(r, "--socket records through the daemon: it cannot go with the trace format")
        assert not marker.exists(), "the command ran though its profile could not be written"
    assert list(tmp_path.iterdir()) == []


def test_output_check_leaves_nothing_and_accepts_descriptors(tmp_path: Path) -> None:
    # Past the output check, the daemon is missing: nothing recorded, nothing left in the directory.
    d = tmp_path / "out"
    d.mkdir()
    for out in (str(d / "x.svg"), "-", "/dev/stdout", "/dev/null"):
        r = flamed(["record", "--socket", NO_SOCKET, "-p", str(os.getpid()), "-o", out])
        assert r.returncode == 1 and "no daemon to record through" in r.stderr, (out, r.stderr)
    assert list(d.iterdir()) == []
    assert Path("/dev/null").is_char_device()


def test_pid_of_a_thread_is_refused_naming_its_process() -> None:
    code = ("import threading, time\n"
            "def spin():\n    end = time.monotonic() + 30\n    while time.monotonic() < end: pass\n"
            "for _ in range(3): threading.Thread(target=spin, daemon=True).start()\n"
            "time.sleep(30)\n")
    pool = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 5
        tids: list[int] = []
        while len(tids) < 3 and time.monotonic() < deadline:
            tids = [int(t) for t in os.listdir(f"/proc/{pool.pid}/task") if int(t) != pool.pid]
            time.sleep(0.05)
        assert tids, "no worker thread started"
        tid = max(tids)
        r = flamed(["record", "--no-daemon", "-p", str(tid), "-d", "2", "-o", "-"])
        assert_usage_error(r, f"{tid} is a thread of process {pool.pid}", f"-p {pool.pid}")
    finally:
        pool.kill()
        pool.wait(10)


def test_pid_of_a_zombie_is_refused_up_front() -> None:
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.02)
        else:
            pytest.fail("the child did not become a zombie")
        r = flamed(["record", "--no-daemon", "-p", str(child.pid), "-d", "2", "-o", "-"])
        assert_usage_error(r, f"process {child.pid} has already exited (a zombie")
    finally:
        child.wait(10)


def test_help_names_the_default_output_of_a_command() -> None:
    r = flamed(["record", "--help"])
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "flamed-PID.<ext of the format> with -p, flamed-record.<ext> with a command" in text, text


@pytest.mark.bpf
def test_default_output_of_a_command_is_flamed_record(tmp_path: Path, require_bpf: None) -> None:
    spin = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
    r = flamed(["record", "--no-daemon", "--", "sh", "-c", spin], timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["flamed-record.folded"]
    assert "wrote flamed-record.folded" in r.stderr


@pytest.mark.bpf
def test_a_command_that_exits_before_it_is_seen_is_said_to_have_exited(tmp_path: Path, require_bpf: None) -> None:
    """Without the daemon, a command gone before a sample of it was taken was said
    to have been "not on a CPU in the 0.5 s sampled (idle, or blocked); record it
    while it works".  Now, as through the daemon, record says it exited and when;
    its exit code is kept.  At 1 Hz a shell that sleeps is almost never sampled;
    the rare run that caught it on a CPU is run again (at most three runs)."""
    out = tmp_path / "w.folded"
    for _ in range(3):
        r = flamed(["record", "--no-daemon", "-r", "1", "-o", str(out), "--", "sh", "-c", "sleep 0.2; exit 7"],
                   timeout=60)
        assert r.returncode == 7, r.stderr
        if out.read_text() == "":
            break
    else:
        pytest.skip("the shell was sampled on a CPU in each of three runs")
    assert re.search(r"nothing was recorded: sh \(pid \d+\) exited [\d.]+ s after sampling began, before it was "
                     r"seen on a CPU", r.stderr), r.stderr
    assert "idle, or blocked" not in r.stderr and "was not on a CPU" not in r.stderr, r.stderr


@pytest.mark.bpf
def test_a_profile_to_stdout_keeps_the_commands_output_out_of_it(require_bpf: None) -> None:
    """Without the daemon, ``-o -`` with a command: what the command printed was
    in the profile's stream, before it; now it goes to standard error."""
    spin = "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done"
    r = flamed(["record", "--no-daemon", "-o", "-", "--", "sh", "-c", f"echo printed-by-the-command; {spin}"],
               timeout=60)
    assert r.returncode == 0, r.stderr
    assert "printed-by-the-command" not in r.stdout and "printed-by-the-command" in r.stderr, (r.stdout, r.stderr)
    prof = read_folded(io.BytesIO(r.stdout.encode()), strict=True)
    assert sum(prof.stacks.values()) > 0, r.stderr


@pytest.mark.bpf
def test_output_failing_at_the_end_saves_the_recording(tmp_path: Path, require_bpf: None) -> None:
    # The directory is there when recording starts; the recorded command removes it.
    d = tmp_path / "gone"
    d.mkdir()
    saved = tmp_path / "tmp"
    saved.mkdir()
    spin = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
    r = flamed(["record", "--no-daemon", "-o", str(d / "x.folded"), "--", "sh", "-c", f"rmdir {d}; {spin}"],
               timeout=60, env={"TMPDIR": str(saved)})
    assert r.returncode == 1, r.stderr
    assert f"cannot write {d / 'x.folded'}" in r.stderr
    files = list(saved.glob("flamed-record-*.folded"))
    assert len(files) == 1, r.stderr
    assert f"the recording was saved as folded text to {files[0]}" in r.stderr
    lines = files[0].read_text().splitlines()
    assert lines and sum(int(ln.rsplit(" ", 1)[1]) for ln in lines) > 0


@pytest.mark.bpf
def test_a_command_that_outlives_the_duration_gets_its_profile_first(tmp_path: Path, require_bpf: None) -> None:
    """``-d 1 -- COMMAND`` of a command that runs on: the profile is written when
    the second ends, record says it waits for the command, and returns its exit
    code once it exits.  The command itself checks that the file is there
    before it exits (5), which it was not before (6): it was written only after."""
    out = tmp_path / "d.folded"
    script = f"sleep 5; test -e {out} && exit 5 || exit 6"
    r = flamed(["record", "--no-daemon", "-r", "49", "-d", "1", "-o", str(out), "--", "sh", "-c", script],
               timeout=60)
    assert r.returncode == 5, r.stderr
    assert "still runs after the -d recorded: waiting for it to exit" in r.stderr, r.stderr
    assert r.stderr.index("wrote ") < r.stderr.index("still runs"), r.stderr


def test_a_user_without_bpf_and_another_users_cache_gets_a_message_not_a_traceback() -> None:
    """A user without BPF whose cache directory is another user's (root's HOME kept
    by ``sudo`` without -H, ``setpriv``, ``su`` without -): looking for the
    compiled program there raised PermissionError out of record.  Now it is
    not cached, BPF is unavailable, and record says what it could not do."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    need_root = os.geteuid() == 0 and shutil.which("setpriv") is not None
    if not need_root:
        pytest.skip("root and setpriv (to run as uid 65534)")
    top = Path(tempfile.mkdtemp(prefix="flamed-test-cache-", dir="/tmp"))
    try:
        top.chmod(0o755)
        cache = top / "cache"
        (cache / "flamed" / "bpf").mkdir(parents=True)
        cache.chmod(0o700)  # root's: uid 65534 cannot look inside
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(cache)}
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        r = subprocess.run(nobody + [*FLAMED, "record", "--no-daemon", "-o", "/dev/null", "--", "true"],
                           capture_output=True, text=True, timeout=120, env=env, cwd="/")
        assert "Traceback" not in r.stderr, r.stderr
        assert r.returncode == 3, r.stderr
        assert "BPF unavailable" in r.stderr or "neither BPF nor py-spy" in r.stderr, r.stderr
        if "py-spy recorded nothing" in r.stderr and "Error:" not in r.stderr:
            # py-spy, stopped when `true` exited, said nothing: record says why.
            assert "true exited (code 0) before py-spy read a Python stack of it: it is not Python" in r.stderr
    finally:
        shutil.rmtree(top)
