"""``flamed record`` through a running daemon (flamed/commands/record_daemon.py):
the target starts at once, its Python frames come from the daemon's BPF walker,
the exit code is the target's; --since reaches into the daemon's ring; a user
the daemon does not serve is refused clearly; a daemon that goes away leaves
a valid partial profile."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flamed.folded import read_folded
from support import ctrl_c_deliverable

WORKLOAD = """
import sys, time
def spin_in_here(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(500))
spin_in_here(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""
PY_FRAME = re.compile(r"spin_in_here \(.*:\d+\)")


def _daemon(daemon_factory: Any, tmp_path: Path, **over: Any) -> Any:
    return daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0},
                          processors__python={"enabled": True, "source": "bpf"}, **over)


def _record(argv: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flamed", "record", *argv], capture_output=True, text=True,
                          timeout=timeout, **kw)


def _record_until_the_daemon_is_killed(d: Any, pid: int, out: Path, *, after_s: float) -> tuple[int, str]:
    """``record -p PID -d 60`` through ``d``, which is killed (SIGKILL) ``after_s`` in:
    record's exit code and standard error."""
    rec = subprocess.Popen([sys.executable, "-m", "flamed", "record", "--socket", d.socket_path, "-p",
                            str(pid), "-d", "60", "-o", str(out)], stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    d.kill9()
    _, err = rec.communicate(timeout=60)
    return rec.returncode, err


def test_record_through_the_daemon_gets_python_frames_and_the_exit_code(
        require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    out = tmp_path / "out.folded"
    t0 = time.monotonic()
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", sys.executable, str(script), "3", "7"])
    took = time.monotonic() - t0
    assert r.returncode == 7, r.stderr
    assert "recording through the daemon" in r.stderr, r.stderr
    prof = read_folded(out.open("rb"))
    total = sum(prof.stacks.values())
    named = sum(w for s, w in prof.stacks.items() if any(PY_FRAME.fullmatch(f) for f in s))
    # 3 s at 99 Hz (~297 samples for a target that has a CPU; the windows now
    # begin with the record): over 100 even when the target gets a third of
    # a CPU on a loaded 2-CPU machine, nearly all under the Python function
    assert total >= 100, (total, r.stderr)
    assert named >= 0.8 * total, (named, total)
    assert took < 30, took  # no compile: the daemon's program is already loaded


def test_since_reaches_back_into_the_ring(require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    p = subprocess.Popen([sys.executable, str(script), "60", "0"])
    try:
        time.sleep(4.0)  # busy before the record begins
        out = tmp_path / "since.folded"
        r = _record(["--socket", d.socket_path, "-p", str(p.pid), "--since", "4s", "-d", "0.5", "-o", str(out)])
        assert r.returncode == 0, r.stderr
    finally:
        p.kill()
        p.wait()
    total = sum(read_folded(out.open("rb")).stacks.values())
    # 0.5 s recorded, 4 s before it from the ring: far more than 0.5 s could hold (~50)
    assert total >= 150, (total, r.stderr)


def test_a_user_the_daemon_does_not_serve_is_refused_clearly(
        require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    run = Path(tempfile.mkdtemp(prefix="flamed-test-run-", dir="/tmp"))
    try:
        run.chmod(0o755)
        sock = run / "flamed.sock"
        d = daemon_factory(sampling={"sampler": "fake"}, control={"socket": str(sock)})
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        args = ["-m", "flamed", "record", "--socket", str(sock), "-p", str(d.pid), "-d", "1", "-o", "/dev/null"]
        # The file mode is the first fence ...
        r = subprocess.run(nobody + [sys.executable, *args], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 1, r.stderr
        assert "not open to this user (permission denied)" in r.stderr, r.stderr
        # ... the daemon's own check of the peer (SO_PEERCRED) the second.
        sock.chmod(0o666)
        r = subprocess.run(nobody + [sys.executable, *args], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 1, r.stderr
        assert "does not serve this user" in r.stderr and "allowed_users" in r.stderr, r.stderr
    finally:
        for f in run.iterdir():
            f.unlink()
        run.rmdir()


def test_a_daemon_that_goes_away_leaves_a_partial_profile(
        require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    p = subprocess.Popen([sys.executable, str(script), "60", "0"])
    out = tmp_path / "partial.folded"
    try:
        # Windows of 1 s reach the record (it asks every second) before the daemon dies.
        rc, err = _record_until_the_daemon_is_killed(d, p.pid, out, after_s=4.0)
    finally:
        p.kill()
        p.wait()
    assert rc == 1, err
    assert "went away mid-record" in err and "the profile holds what was received before" in err, err
    prof = read_folded(out.open("rb"), strict=True)  # a valid folded file ...
    assert sum(prof.stacks.values()) >= 50, err  # ... with the windows received (~3 s at 99 Hz)


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_a_daemon_gone_before_any_window_came_back_is_not_said_to_have_seen_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The daemon killed before it drained a window of the target: record said
    "nothing was recorded: the daemon saw python3 (pid N) on no CPU in 1
    window(s)" (and named a child), as if it had looked.  Now it says the daemon
    went away before any sample came back; the empty profile is still written."""
    # No drain before the kill: record's polls do not force one, and the daemon's come every 60 s.
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 60.0},
                       output={"rotate_interval": 60.0})
    p = subprocess.Popen(["sleep", "60"])
    out = tmp_path / "gone.folded"
    try:
        # A poll or two (one a second) answered before the kill.
        rc, err = _record_until_the_daemon_is_killed(d, p.pid, out, after_s=2.5)
    finally:
        p.kill()
        p.wait()
    assert rc == 1, err
    assert "went away mid-record" in err, err
    assert re.search(rf"nothing was recorded: the daemon at {re.escape(d.socket_path)} went away after \d+ "
                     rf"window\(s\), before any sample of sleep \(pid {p.pid}\) came back", err), err
    assert "on no CPU" not in err and "does not follow" not in err, err
    assert out.read_text() == ""


ZOMBIE_PARENT = """
import os, sys, time
pid = os.fork()
if pid == 0:
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        sum(i * i for i in range(500))
    os._exit(0)
print(pid, flush=True)
time.sleep(60)  # never reaps it: the child stays a zombie
"""


def test_a_zombie_target_ends_the_record(require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    parent = subprocess.Popen([sys.executable, "-c", ZOMBIE_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        out = tmp_path / "z.folded"
        t0 = time.monotonic()
        r = _record(["--socket", d.socket_path, "-p", str(child), "-o", str(out)], timeout=20)
        took = time.monotonic() - t0
        assert (Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z"
    finally:
        parent.kill()
        parent.wait()
    assert r.returncode == 0, r.stderr
    assert took < 8, took  # the child ran 1 s, then was a zombie
    assert sum(read_folded(out.open("rb")).stacks.values()) > 0, r.stderr


def test_a_target_the_daemons_filter_leaves_out_is_named_and_fails(
        require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0, "comms": ["nginx"]})
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    out = tmp_path / "flt.folded"
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", sys.executable, str(script), "1", "0"])
    assert r.returncode == 1, r.stderr
    assert 'nothing was recorded: the daemon at' in r.stderr, r.stderr
    assert 'samples only [sampling] comms = ["nginx"]' in r.stderr and "--no-daemon" in r.stderr, r.stderr
    assert "on no CPU" not in r.stderr, r.stderr


def test_the_duration_asked_is_what_is_recorded(require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    # Windows of 5 s: the one open when record begins holds seconds from before it.
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 5.0}, output={"rotate_interval": 10.0},
                       processors__python={"enabled": True, "source": "bpf"})
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    p = subprocess.Popen([sys.executable, str(script), "60", "0"])
    try:
        # 3.5 s into the daemon's 5 s drain grid (it drains at multiples of 5 s of wall time)
        time.sleep(1.0)
        time.sleep((3.5e9 - time.time_ns() % 5_000_000_000) % 5_000_000_000 / 1e9)
        out = tmp_path / "d1.folded"
        r = _record(["--socket", d.socket_path, "-p", str(p.pid), "-d", "1", "-o", str(out)])
        assert r.returncode == 0, r.stderr
    finally:
        p.kill()
        p.wait()
    total = sum(read_folded(out.open("rb")).stacks.values())
    # 1 s of one busy thread at 99 Hz (fewer on a busy machine); not the 3.5 s before the record (~450)
    assert 20 <= total <= 150, (total, r.stderr)


def test_nothing_recorded_fails_as_without_the_daemon(
        require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    out = tmp_path / "n.folded"
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        # Asleep already: on a loaded host its start (exec, the loader) could
        # otherwise run inside the recorded second and be sampled.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{sleeper.pid}/syscall").read_text().split()[0] in ("35", "230"):
                    break  # nanosleep, clock_nanosleep
            time.sleep(0.01)
        # And the window holding its start drained: record takes the windows
        # that end after it begins, the one in progress then included.
        drains = d.metric("flamed_drains_total")
        d.wait_for(lambda: d.metric("flamed_drains_total") >= drains + 2, 30, "two drains after the sleeper slept")
        r = _record(["--socket", d.socket_path, "-p", str(sleeper.pid), "-d", "1", "-o", str(out)])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert r.returncode == 1, (r.stderr, out.read_text() if out.exists() else None)
    assert "nothing was recorded" in r.stderr, r.stderr
    # A command started by record: a real sampler may catch it on a CPU while
    # it starts (a millisecond or so: ~1 chance in 10 at 99 Hz), so a daemon
    # whose fake sampler samples no real process stands in for one that saw nothing.
    # Its own socket and state directory: on the first daemon's, it was refused
    # (the state directory is locked) and record asked the real one.
    fake = daemon_factory(name="fake", sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0},
                          output={"state_dir": str(tmp_path / "fake-state")},
                          control={"socket": str(tmp_path / "fake-run" / "flamed.sock")})
    r = _record(["--socket", fake.socket_path, "-o", str(out), "--", "sleep", "0.5"])
    assert r.returncode == 1, r.stderr
    assert "nothing was recorded" in r.stderr, r.stderr
    # A command that failed: its own exit code, as without the daemon.
    r = _record(["--socket", fake.socket_path, "-o", str(out), "--", "sh", "-c", "sleep 0.5; exit 3"])
    assert r.returncode == 3, r.stderr


def test_an_exec_wrapper_is_checked_against_the_filter_as_what_it_became(
        daemon_factory: Any, tmp_path: Path) -> None:
    """``sh -c 'exec sleep ...'`` is ``sh`` when record starts it and ``sleep`` a
    moment later: the daemon's ``comms = ["sleep"]`` lets it through, so record
    neither warns that the filter leaves it out nor blames the filter when
    nothing comes back (the fake sampler samples no real process)."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0, "comms": ["sleep"]})
    out = tmp_path / "w.folded"
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", "sh", "-c", "exec sleep 1.5"], timeout=60)
    assert r.returncode == 1, r.stderr
    assert "samples only" not in r.stderr and "outside it" not in r.stderr, r.stderr
    assert re.search(r"nothing was recorded: sleep \(pid \d+\) exited [\d.]+ s after the record began, before "
                     r"the daemon saw it on a CPU", r.stderr), r.stderr
    # The filter still names a target it does leave out, by its name after the exec.
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", "sh", "-c", "exec timeout 1.5 tail -f /dev/null"],
                timeout=60)
    assert r.returncode == 124, r.stderr
    assert 'the daemon samples only [sampling] comms = ["sleep"]: timeout (pid' in r.stderr, r.stderr
    assert 'which leaves out timeout (pid' in r.stderr, r.stderr


def test_a_wrapper_that_forks_names_the_child_it_left_the_work_to(daemon_factory: Any, tmp_path: Path) -> None:
    """``timeout 5 sleep 1.5`` runs ``sleep`` as a child, which record does not
    follow: when nothing comes back, the message names that child instead of
    only saying the wrapper was not on a CPU, and says that --subprocesses
    would not follow it either (it is not Python; it said it would, once)."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    out = tmp_path / "w.folded"
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", "timeout", "5", "sleep", "1.5"], timeout=60)
    assert r.returncode == 1, r.stderr
    assert re.search(r"timeout \(pid \d+\) exited [\d.]+ s after the record began, before the daemon saw it on "
                     r"a CPU; it started sleep \(pid \d+\), which record does not follow: --subprocesses also "
                     r"records the processes a command starts, from their fork, with native and kernel stacks "
                     r"\(sampling here, not through the daemon\); none of them was seen running Python",
                     r.stderr), r.stderr
    # Waiting for it with -p: the same child named while the wrapper still runs.
    wrapper = subprocess.Popen(["timeout", "30", "sleep", "20"])
    try:
        # (in speedscope: through the daemon, which --socket asks for, that is the summed profile, said so)
        ss = tmp_path / "w.speedscope.json"
        r = _record(["--socket", d.socket_path, "-p", str(wrapper.pid), "-d", "1.5", "-o", str(ss)], timeout=60)
    finally:
        wrapper.kill()
        wrapper.wait()
    assert r.returncode == 1, r.stderr
    assert re.search(r"the daemon saw timeout \(pid \d+\) on no CPU in \d+ window\(s\); it started sleep "
                     r"\(pid \d+\), which record does not follow", r.stderr), r.stderr
    assert "the speedscope output is the aggregated profile, not a timeline (--no-daemon records one)" in r.stderr
    assert json.loads(ss.read_text())["$schema"].endswith("file-format-schema.json")


def test_a_wrapper_that_forks_python_says_its_profile_has_no_python(require_bpf: None, daemon_factory: Any,
                                                                     tmp_path: Path) -> None:
    """``sh -c 'setup; python3 app.py; cleanup'`` through the daemon: the shell
    forks the interpreter, which record does not follow, and its own setup
    makes a small profile.  Record says that profile has no Python frames and
    names the child and --subprocesses.  Before, it wrote the shell's samples
    without a word; with ``exec`` (the interpreter is the target) nothing is said."""
    d = _daemon(daemon_factory, tmp_path)
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    out = tmp_path / "w.folded"
    # The shell spins first (its own CPU time: samples of it on any load).
    spin = "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", "sh", "-c",
                 f"{spin}; '{sys.executable}' '{script}' 1 0; true"], timeout=60)
    assert r.returncode == 0, r.stderr
    prof = read_folded(out.open("rb"))
    assert prof.stacks and not any(PY_FRAME.fullmatch(f) for s in prof.stacks for f in s), prof.stacks
    assert re.search(r"no Python frames were recorded, only samples of sh \(pid \d+\); it started \S+ \(pid \d+\), "
                     r"which record does not follow \(at least [\d.]+ s of CPU used by the processes it started\): "
                     r"--subprocesses", r.stderr), r.stderr

    r = _record(["--socket", d.socket_path, "-o", str(out), "--", "sh", "-c",
                 f"{spin}; exec '{sys.executable}' '{script}' 1 0"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no Python frames" not in r.stderr and "does not follow" not in r.stderr, r.stderr
    prof = read_folded(out.open("rb"))
    assert any(PY_FRAME.fullmatch(f) for s in prof.stacks for f in s), prof.stacks


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_a_command_that_exits_before_it_is_seen_is_said_to_have_exited(daemon_factory: Any, tmp_path: Path) -> None:
    """A command gone before the daemon sampled it: record says it exited and when,
    not that the daemon saw it "on no CPU in 0 window(s)"; its exit code is kept."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    out = tmp_path / "w.folded"
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", "sh", "-c", "exit 7"], timeout=60)
    assert r.returncode == 7, r.stderr
    assert re.search(r"nothing was recorded: sh \(pid \d+\) exited [\d.]+ s after the record began, before the "
                     r"daemon saw it on a CPU", r.stderr), r.stderr
    assert "0 window(s)" not in r.stderr, r.stderr


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_a_profile_to_stdout_keeps_the_commands_output_out_of_it(daemon_factory: Any, tmp_path: Path) -> None:
    """``record -o - -- COMMAND``: the command's standard output was record's, so
    what it printed came out before the profile, in the same stream (``record -o
    - -- app > app.folded`` made a file that is no profile).  Now the command's
    standard output goes to standard error, and record says so."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    r = _record(["--socket", d.socket_path, "-o", "-", "--", "sh", "-c", "echo printed-by-the-command; exit 3"],
                timeout=60)
    assert r.returncode == 3, r.stderr
    assert "printed-by-the-command" not in r.stdout, r.stdout
    assert "printed-by-the-command" in r.stderr, r.stderr
    assert "the command's standard output goes to standard error" in r.stderr, r.stderr
    read_folded(io.BytesIO(r.stdout.encode()), strict=True)


IGNORES_SIGINT = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def _where(pid: int) -> str:
    """The Python stacks of ``pid`` (py-spy dump), its state and wait channel: for a failure's message."""
    from flamed.procstat import read_stat
    from support import pyspy_path

    state = ""
    with contextlib.suppress(OSError):
        fields = read_stat(f"/proc/{pid}/stat") or [b"gone"]
        state = fields[0].decode() + " wchan " + Path(f"/proc/{pid}/wchan").read_text()
        # Its signals (pending, blocked, ignored, caught) and those of this test's process.
        for who in (pid, os.getpid()):
            state += f"\n{who}: " + " ".join(ln.replace("\t", "") for ln in Path(f"/proc/{who}/status").read_text()
                                             .splitlines() if ln.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    spy = pyspy_path()
    if spy is None:
        return f"pid {pid} state {state} (no py-spy for its stacks)"
    r = subprocess.run([spy, "dump", "--locals", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return f"pid {pid} state {state}\n{r.stdout}{r.stderr}"


def test_ctrl_c_twice_kills_a_command_that_ignores_it_and_writes_the_profile(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Ctrl-C to record, whose command ignores SIGINT: record waited 10 s in
    silence, and a second Ctrl-C then ended record itself ("interrupted"): no
    profile written, and the command left running.  Now record says it waits
    and that Ctrl-C again kills the command; the second one does, and the
    profile is written."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    script = tmp_path / "ign.py"
    script.write_text(IGNORES_SIGINT)
    ready = tmp_path / "pid"
    out = tmp_path / "twice.folded"
    rec = subprocess.Popen([sys.executable, "-m", "flamed", "record", "--socket", d.socket_path, "-o", str(out),
                            "--", sys.executable, str(script), str(ready)], stderr=subprocess.PIPE, text=True,
                           preexec_fn=ctrl_c_deliverable)
    assert rec.stderr is not None
    stderr = rec.stderr
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(stderr.readline, "")), daemon=True)
    reader.start()
    target = 0
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline and rec.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), lines
        target = int(ready.read_text())
        rec.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not any("Ctrl-C again kills it" in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        rec.send_signal(signal.SIGINT)
        try:
            rec.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Where record was, and its signals (a suite started in the background had
            # SIGINT ignored, inherited by record, until ctrl_c_deliverable).
            pytest.fail("record did not end 30 s after a second Ctrl-C:\n" + _where(rec.pid) + "\nits stderr:\n"
                        + "".join(lines) + "\nthe daemon's log:\n" + d.log()[-3000:])
        reader.join(10)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        if target and Path(f"/proc/{target}").exists():
            os.kill(target, signal.SIGKILL)
            pytest.fail(f"the command (pid {target}) was left running; record said:\n" + "".join(lines))
    err = "".join(lines)
    assert f"pid {target} has not exited after SIGINT" in err, err
    assert rec.returncode == 128 + signal.SIGKILL, err  # the command's: killed
    assert out.exists(), err
    read_folded(out.open("rb"), strict=True)


def test_a_command_that_cannot_run_fails_before_anything_is_loaded(tmp_path: Path) -> None:
    """Without a daemon, record compiled the BPF program (seconds) before saying
    the command does not exist; now it says so first, as through the daemon."""
    out = tmp_path / "w.folded"
    r = _record(["--no-daemon", "-o", str(out), "--", "no-such-command-here"], timeout=60)
    # The exit status a shell (or env, timeout) gives a command it cannot run.
    assert r.returncode == 127, r.stderr
    assert "cannot run no-such-command-here: not found in PATH" in r.stderr, r.stderr
    assert "loading the BPF programs" not in r.stderr, r.stderr
    r = _record(["--no-daemon", "-o", str(out), "--", str(tmp_path / "missing")], timeout=60)
    assert r.returncode == 127 and f"cannot run {tmp_path / 'missing'}: No such file or directory" in r.stderr, r.stderr
    text = tmp_path / "not-executable"
    text.write_text("echo hi\n")
    for path in (text, tmp_path):
        r = _record(["--no-daemon", "-o", str(out), "--", str(path)], timeout=60)
        assert r.returncode == 126 and f"cannot run {path}: Permission denied" in r.stderr, r.stderr


def test_a_command_that_outlives_the_duration_gets_its_profile_first(daemon_factory: Any, tmp_path: Path) -> None:
    """Through the daemon, ``-d 1 -- COMMAND`` of a command that runs on: the
    profile is written when the second ends, then record waits for the command
    and returns its exit code.  The command checks that the file is there
    before it exits (5; it was written only after it exited before: 6)."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    out = tmp_path / "d.folded"
    script = f"sleep 4; test -e {out} && exit 5 || exit 6"
    r = _record(["--socket", d.socket_path, "-d", "1", "-o", str(out), "--", "sh", "-c", script], timeout=60)
    assert r.returncode == 5, r.stderr
    assert "still runs after the -d recorded: waiting for it to exit" in r.stderr, r.stderr


def test_old_cpython_through_the_daemon_says_why_its_python_frames_are_missing(
        require_bpf: None, daemon_factory: Any, tmp_path: Path) -> None:
    """A 2 s run of CPython 3.7 through the daemon: the BPF walker does not read
    3.7, and the daemon's py-spy for it starts only once a drained window (10 s
    here, the default) has seen it, so no Python frame came back, and record said
    nothing.  Now it names the version, why, and --no-daemon."""
    from cpython_support import pyenv_python  # noqa: PLC0415

    python = pyenv_python("3.7")
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 10.0}, output={"rotate_interval": 10.0},
                       processors__python={"enabled": True, "source": "auto"})
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    out = tmp_path / "old.folded"
    r = _record(["--socket", d.socket_path, "-o", str(out), "--", str(python), str(script), "2", "0"], timeout=90)
    assert r.returncode == 0, r.stderr
    assert re.search(r"python3\.7 \(pid \d+\) runs CPython 3\.7, which the daemon's BPF walker does not read "
                     r"\(it reads 3\.8-3\.13\).*drain_interval = 10 s.*\d+ of \d+ samples came back with Python "
                     r"frames\. --no-daemon records it here with py-spy from its start", r.stderr), r.stderr


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_a_process_the_command_leaves_running_is_named_through_the_daemon(daemon_factory: Any,
                                                                          tmp_path: Path) -> None:
    """``sh -c 'python3 app.py & exit 0'`` through the daemon: the recording ends
    with sh, and record said nothing of the Python process still running.  Now
    it names it and how to record it."""
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    pid_file = tmp_path / "child.pid"
    out = tmp_path / "bg.folded"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(20)"
    try:
        r = _record(["--socket", d.socket_path, "-o", str(out), "--", "sh", "-c",
                     f"'{sys.executable}' -c \"{code}\" >/dev/null 2>&1 & exit 0"], timeout=60)
        end = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert "sh exited, leaving" in r.stderr and f"(pid {pid}) running" in r.stderr, r.stderr
    assert f"record it with flamed record -p {pid}; --subprocesses follows" in r.stderr, r.stderr
    assert "(sampling here, not through the daemon)" in r.stderr, r.stderr
