"""The daemon as a real process: sd_notify over a real NOTIFY_SOCKET, signals, reload, exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.daemon.client import DaemonError, request
from flamed.fileio import open_input
from flamed.folded import read_folded
from support import wait_daemon_answers

FLAMED = [sys.executable, "-m", "flamed"]
ROOT = Path(__file__).resolve().parents[2]


def write_config(path: Path, tmp: Path, extra: str = "") -> None:
    path.write_text(
        f"""
[sampling]
sampler = "fake"
frequency = 100
drain_interval = 0.2
[output]
state_dir = "{tmp / 'profiles'}"
rotate_interval = 1.0
host = "lc"
fsync = false
[metrics]
address = ""
[control]
socket = "{tmp / 'flamed.sock'}"
[log]
target = "stderr"
{extra}
"""
    )


class Notifications:
    """A NOTIFY_SOCKET datagram socket, as systemd opens it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.messages:
                if needle in m.split("\n"):
                    return m
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                break
        raise AssertionError(f"no {needle!r} notification; got {self.messages}")

    def wait_for_prefix(self, prefix: str, timeout: float = 10.0) -> str:
        """The first line of a notification that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            for m in self.messages:
                for line in m.split("\n"):
                    if line.startswith(prefix):
                        return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} notification; got {self.messages}")
            self.sock.settimeout(left)
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                pass

    def close(self) -> None:
        self.sock.close()


def start(cfg: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    e = dict(os.environ)
    e.pop("NOTIFY_SOCKET", None)
    e.pop("INVOCATION_ID", None)
    e.pop("JOURNAL_STREAM", None)
    e.update(env or {})
    return subprocess.Popen([*FLAMED, "daemon", "--config", str(cfg)], stderr=subprocess.PIPE, text=True, env=e)


def stop(p: subprocess.Popen[str], *, signal_it: bool = True) -> str:
    """SIGTERM (unless sent already) and wait.  One signal only: a second one
    arriving while the interpreter finalizes (its handlers are back to the
    default then) ends the process by the signal, after a clean stop."""
    if signal_it and p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        raise
    return err


def wait_socket(path: Path, p: subprocess.Popen[str], timeout: float = 60.0) -> None:
    # The path exists from bind() on, before the daemon listens: wait for an answer.
    wait_daemon_answers(path, p, timeout)


def test_sd_notify_ready_watchdog_stopping_and_sigterm_writes_last_window(tmp_path: Path) -> None:
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    # one file per minute: everything the daemon sampled is only in memory until SIGTERM
    cfg.write_text(cfg.read_text().replace("rotate_interval = 1.0", "rotate_interval = 60.0"))
    n = Notifications(tmp_path / "notify")
    minute0 = time.time() // 60  # periods close on the minute: a run that crosses one writes a file
    p = start(cfg, {"NOTIFY_SOCKET": n.path, "WATCHDOG_USEC": "400000"})
    try:
        ready = n.wait_for("READY=1")
        assert f"MAINPID={p.pid}" in ready.split("\n")
        assert any(line.startswith("STATUS=") for line in ready.split("\n"))
        n.wait_for("WATCHDOG=1")
        count = sum(m == "WATCHDOG=1" for m in n.messages)
        time.sleep(0.5)
        n.wait_for("WATCHDOG=1")
        while True:  # pings keep coming at half the period
            n.sock.settimeout(1.0)
            n.messages.append(n.sock.recv(4096).decode())
            if sum(m == "WATCHDOG=1" for m in n.messages) >= count + 2:
                break
        st = request(str(tmp_path / "flamed.sock"), {"request": "status"})["status"]
        crossed = time.time() // 60 != minute0
        assert st["files"]["count"] <= (1 if crossed else 0), st["files"]
        p.send_signal(signal.SIGTERM)
        n.wait_for("STOPPING=1")
        err = stop(p, signal_it=False)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        n.close()
    assert p.returncode == 0, err
    assert "SIGTERM" in err and "Traceback" not in err
    # One file; two when the run crossed a minute boundary (files start at
    # multiples of the 60 s rotate interval).
    files = sorted((tmp_path / "profiles").glob("lc-*.folded"))
    assert 1 <= len(files) <= 2, files
    metas = [json.loads(f.with_suffix(".json").read_text()) for f in files]
    for f, meta in zip(files, metas):
        with open_input(f) as fh:
            assert read_folded(fh).total() == meta["samples"]
    assert sum(m["samples"] for m in metas) > 0
    # the window ran up to the signal: from start to (at least) the status request
    assert max(m["end_ns"] for m in metas) >= st["last_drain_ns"]
    assert not (tmp_path / "flamed.sock").exists()


def test_sighup_reload_keeps_old_config_on_error_and_applies_good_one(tmp_path: Path) -> None:
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    sock = tmp_path / "flamed.sock"
    p = start(cfg)
    try:
        wait_socket(sock, p)
        before = request(str(sock), {"request": "status"})["status"]
        assert before["frequency"] == 100
        cfg.write_text(cfg.read_text().replace("frequency = 100", "frequency = 100\nfrequncy = 50"))
        p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        mid = before
        while time.monotonic() < deadline:
            # the failed reload is over when a window drained after it is counted
            mid = request(str(sock), {"request": "status"})["status"]
            if mid["windows"] > before["windows"] + 2:
                break
            time.sleep(0.1)
        assert mid["frequency"] == 100 and mid["samples"] > before["samples"]
        cfg.write_text(cfg.read_text().replace("frequency = 100\nfrequncy = 50", "frequency = 50"))
        p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = request(str(sock), {"request": "status"})["status"]
            if after["frequency"] == 50:
                break
            time.sleep(0.1)
        assert after["frequency"] == 50
    finally:
        err = stop(p)
    assert p.returncode == 0, err
    assert "reload: invalid configuration, keeping the running one" in err
    assert "sampling.frequncy: unknown key" in err
    assert "reloaded configuration" in err
    # no sample lost across the sampler swap: every file's weight equals its sidecar's count
    for f in (tmp_path / "profiles").glob("lc-*.folded"):
        meta = json.loads(f.with_suffix(".json").read_text())
        with open_input(f) as fh:
            assert read_folded(fh).total() == meta["samples"]


def test_refuses_to_start_with_actionable_message() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    scratch = Path(tempfile.mkdtemp(prefix="flamed-nopriv-"))
    os.chmod(scratch, 0o777)
    try:
        # no privileges at all: the BPF sampler must say what is missing, exit 3, no traceback
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                            "--bounding-set=-all", *FLAMED, "daemon", "--sampler", "bpf", "--metrics-address", "",
                            "--state-dir", str(scratch / "p"), "--socket", str(scratch / "s.sock")],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert "CAP_BPF" in r.stderr or "root" in r.stderr, r.stderr


def test_bad_config_exit_code_names_key(tmp_path: Path) -> None:
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path, "[retention]\nmax_age = \"forever\"\n")
    r = subprocess.run([*FLAMED, "daemon", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "retention.max_age" in r.stderr and "Traceback" not in r.stderr


def test_systemd_socket_activation(tmp_path: Path) -> None:
    # what flamed.socket does: systemd binds the socket and passes it as fd 3
    # with LISTEN_FDS=1 and LISTEN_PID=<the daemon's pid>
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)  # its control.socket (flamed.sock) must be ignored
    fd = listener.fileno()
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM")}
    p = subprocess.Popen(["bash", "-c", f'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@" 3<&{fd}', "bash", *FLAMED, "daemon",
                          "--config", str(cfg)], pass_fds=(fd,), stderr=subprocess.PIPE, text=True, env=env)
    listener.close()  # the daemon holds it now
    try:
        deadline = time.monotonic() + 90  # generous: a loaded CI machine takes seconds to import
        st = None
        while time.monotonic() < deadline and p.poll() is None:
            try:
                st = request(str(path), {"request": "status"}, timeout=2)["status"]
                break
            except Exception:
                time.sleep(0.1)
        if st is None:
            p.kill()
            raise AssertionError(f"no answer on the activated socket: {p.communicate()[1]}")
        assert st["socket"] == str(path)
        assert not (tmp_path / "flamed.sock").exists()
    finally:
        err = stop(p)
    assert p.returncode == 0, err
    # the socket belongs to systemd: the daemon does not remove it
    assert path.exists()


def test_log_target_journal_under_systemd_else_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from flamed.daemon import logs

    def handlers() -> list[logging.Handler]:
        return [h for h in logging.getLogger("flamed").handlers if getattr(h, "_flamed_daemon_handler", False)]

    try:
        for var in ("INVOCATION_ID", "JOURNAL_STREAM"):
            monkeypatch.delenv(var, raising=False)
        assert logs.setup_logging("info", "auto") == "stderr"
        assert isinstance(handlers()[0], logging.StreamHandler)
        monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
        monkeypatch.setattr(logs.os.path, "exists", lambda p: p == "/run/systemd/journal/socket")
        assert logs.setup_logging("debug", "auto") == "journal"
        (h,) = handlers()  # replaced, not added
        assert type(h).__name__ == "JournalHandler"
        assert logging.getLogger("flamed").level == logging.DEBUG
        assert logs.setup_logging("info", "stderr") == "stderr"
    finally:
        for h in handlers():
            logging.getLogger("flamed").removeHandler(h)


def test_check_config_validates_processor_tables(tmp_path: Path) -> None:
    # What the daemon would refuse (after compiling its BPF program) --check-config refuses too.
    for extra, key in (("[processors.python]\nrate = 1000\n", "processors.python.rate"),
                       ("[processors.python]\ninclude_comm = \"(\"\n", "processors.python.include_comm"),
                       ("[processors.python]\nwindow_s = 0\n", "processors.python.window_s"),
                       ("[processors.python]\nstop_timeout_s = -1.0\n", "processors.python.stop_timeout_s"),
                       ("[processors.nosuch]\n", "processors.nosuch")):
        cfg = tmp_path / "flamed.toml"
        write_config(cfg, tmp_path, extra)
        r = subprocess.run([*FLAMED, "daemon", "--config", str(cfg), "--check-config"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert key in r.stderr and "Traceback" not in r.stderr, r.stderr
    write_config(cfg, tmp_path, "[processors.python]\nrate = 50\n")
    r = subprocess.run([*FLAMED, "daemon", "--config", str(cfg), "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_bad_processor_value_stops_the_daemon_before_it_compiles(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the BPF sampler needs root")
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path, "[processors.python]\nrate = 1000\n")
    cfg.write_text(cfg.read_text().replace('sampler = "fake"', 'sampler = "bpf"'))
    r = subprocess.run([*FLAMED, "daemon", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "processors.python.rate" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # Nothing was loaded: the sampler logs its event and rate once its program runs.
    assert " Hz on CPUs" not in r.stderr, r.stderr


def _unit_final_exit_codes() -> set[int]:
    """The exit codes systemd does not restart the daemon after (the unit's RestartPreventExitStatus=)."""
    codes: set[int] = set()
    for line in (ROOT / "systemd" / "flamed.service").read_text().splitlines():
        if line.startswith("RestartPreventExitStatus="):
            codes |= {int(w) for w in line.split("=", 1)[1].split() if w.isdigit()}
    return codes


def _bad_paths(tmp: Path) -> list[tuple[str, str, str, str]]:
    """(name, key, path, words of the message) of paths a restart cannot make usable."""
    (tmp / "plain").write_text("not a directory\n")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    return [
        ("state_dir is a file", "output.state_dir", str(tmp / "plain"), "is a regular file, not a directory"),
        ("state_dir under a file", "output.state_dir", str(tmp / "plain" / "p"),
         "(in the path of " + str(tmp / "plain" / "p") + ") is a regular file"),
        ("state_dir a dangling link", "output.state_dir", str(tmp / "dangling"), "which does not exist"),
        ("state_dir read-only", "output.state_dir", str(tmp / "ro" / "p"), "Read-only file system"),
        ("socket under a file", "control.socket", str(tmp / "plain" / "flamed.sock"),
         "is a regular file, not a directory"),
        ("socket path too long", "control.socket", str(tmp / ("s" * 120)), "too long for a Unix socket path"),
    ]


def test_unusable_paths_exit_with_a_status_systemd_does_not_restart(tmp_path: Path) -> None:
    """A state directory (or socket directory) that cannot be used exited 1, which
    Restart=on-failure restarts every 5 s for ever, with "File exists" for a
    regular file in the way.  Now: exit 2 (in RestartPreventExitStatus=), one line
    naming the key and what is in the way, and STATUS=failed: ... to systemd."""
    final = _unit_final_exit_codes()
    assert 2 in final, final
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "flamed-test-ro", str(ro)], capture_output=True).returncode == 0
    try:
        for name, key, path, words in _bad_paths(tmp_path):
            if "read-only" in name and not mounted:
                continue
            cfg = tmp_path / "flamed.toml"
            write_config(cfg, tmp_path)
            if key == "output.state_dir":
                cfg.write_text(cfg.read_text().replace(str(tmp_path / "profiles"), path))
            else:
                cfg.write_text(cfg.read_text().replace(str(tmp_path / "flamed.sock"), path))
            n = Notifications(tmp_path / "notify")
            p = start(cfg, {"NOTIFY_SOCKET": n.path})
            try:
                err = stop(p, signal_it=False)
                failed = n.wait_for_prefix("STATUS=failed: ")
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                n.close()
                os.unlink(n.path)
            assert p.returncode in final, (name, p.returncode, err)
            assert "Traceback" not in err and "File exists" not in err, (name, err)
            last = err.strip().splitlines()[-1]
            assert key in last and words in last, (name, last)
            assert key in failed, (name, failed)
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


def test_missing_directories_are_created_and_logged(tmp_path: Path) -> None:
    """output.state_dir and control.socket's directory follow one rule: what is
    missing is created (mode 0755), and each directory created is logged."""
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    state = tmp_path / "a" / "b" / "profiles"
    sock = tmp_path / "run" / "x" / "flamed.sock"
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "profiles"), str(state))
                   .replace(str(tmp_path / "flamed.sock"), str(sock)))
    p = start(cfg)
    try:
        wait_socket(sock, p)
    finally:
        err = stop(p)
    assert p.returncode == 0, err
    assert state.is_dir() and (state.stat().st_mode & 0o777) == 0o755
    assert (tmp_path / "run" / "x").is_dir()
    assert f"output.state_dir: created directory {tmp_path / 'a'}, {tmp_path / 'a' / 'b'}, {state}" in err, err
    assert f"control.socket: created directory {tmp_path / 'run'}, {tmp_path / 'run' / 'x'}" in err, err


def _reload_and_wait(p: subprocess.Popen[str], n: Notifications) -> None:
    """SIGHUP, then wait for the READY=1 that ends the reload (RELOADING=1 first)."""
    readies = sum("READY=1" in m.split("\n") for m in n.messages)
    p.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while sum("READY=1" in m.split("\n") for m in n.messages) <= readies:
        left = deadline - time.monotonic()
        assert left > 0, f"no READY=1 after the reload; got {n.messages}"
        n.sock.settimeout(left)
        with __import__("contextlib").suppress(TimeoutError):
            n.messages.append(n.sock.recv(4096).decode())


def _scrape(bound: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{bound}/metrics", timeout=10) as r:
        return r.read().decode()


class _Ready:
    """A daemon on ``cfg`` under a NOTIFY_SOCKET (``n``), waited for until it is
    ready and answers on ``tmp_path/flamed.sock``; stopped on leaving the ``with``,
    its stderr then in ``err``."""

    def __init__(self, cfg: Path, tmp_path: Path) -> None:
        self.sock = tmp_path / "flamed.sock"
        self.n = Notifications(tmp_path / "notify")
        self.p = start(cfg, {"NOTIFY_SOCKET": self.n.path})
        self.err = ""

    def __enter__(self) -> "_Ready":
        try:
            self.n.wait_for("READY=1")
            wait_socket(self.sock, self.p)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        try:
            self.err = stop(self.p)
        finally:
            self.n.close()

    def reload(self) -> None:
        _reload_and_wait(self.p, self.n)


def test_reload_to_a_socket_path_that_cannot_be_bound_keeps_the_socket(tmp_path: Path) -> None:
    """A reload moving control.socket closed the running socket first, then failed
    to bind the new path: 'keeping the running configuration', and nobody could
    reach the daemon any more.  Now the new path is bound before anything
    changes, so a refused reload leaves the socket answering."""
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    sock = tmp_path / "flamed.sock"
    (tmp_path / "plain").write_text("a file\n")
    n = Notifications(tmp_path / "notify")
    p = start(cfg, {"NOTIFY_SOCKET": n.path})
    try:
        n.wait_for("READY=1")
        wait_socket(sock, p)
        text = cfg.read_text()
        cfg.write_text(text.replace(str(sock), str(tmp_path / "plain" / "moved.sock")).replace(
            "frequency = 100", "frequency = 50"))
        _reload_and_wait(p, n)
        st = request(str(sock), {"request": "status"})["status"]
        assert st["socket"] == str(sock) and st["frequency"] == 100  # nothing of the refused reload applied
        moved = tmp_path / "run2" / "moved.sock"
        cfg.write_text(text.replace(str(sock), str(moved)))
        _reload_and_wait(p, n)
        assert request(str(moved), {"request": "status"})["status"]["socket"] == str(moved)
        assert not sock.exists()
    finally:
        err = stop(p)
        n.close()
    assert p.returncode == 0, err
    assert "reload: control.socket: " in err and "is a regular file, not a directory" in err, err


def test_a_removed_control_socket_is_bound_again_on_reload_and_never_removes_another_daemons(
        tmp_path: Path) -> None:
    """The control socket's file removed under a running daemon (rm -rf /run/flamed,
    a cleaner): the daemon could not be reached until restarted, and when it
    stopped it unlinked whatever socket was at that path by then, another
    daemon's included.  Now a reload binds it again (refused while another
    daemon answers there), and a stop removes only the socket file it bound."""
    sock = tmp_path / "flamed.sock"
    cfg_a = tmp_path / "a.toml"
    write_config(cfg_a, tmp_path)
    cfg_b = tmp_path / "b.toml"
    write_config(cfg_b, tmp_path)
    cfg_b.write_text(cfg_b.read_text().replace(str(tmp_path / "profiles"), str(tmp_path / "profiles-b")))
    n = Notifications(tmp_path / "notify")
    a = start(cfg_a, {"NOTIFY_SOCKET": n.path})
    b: subprocess.Popen[str] | None = None
    try:
        n.wait_for("READY=1")
        wait_socket(sock, a)
        pid_a = request(str(sock), {"request": "status"})["status"]["pid"]
        sock.unlink()
        _reload_and_wait(a, n)  # the same path, its file gone: bound again
        assert request(str(sock), {"request": "status"})["status"]["pid"] == pid_a
        sock.unlink()
        b = start(cfg_b)  # a second daemon takes the free path
        wait_socket(sock, b)
        assert request(str(sock), {"request": "status"})["status"]["pid"] == b.pid
        _reload_and_wait(a, n)  # refused: b answers there
        err_a = stop(a)
        assert a.returncode == 0, err_a
        assert "another daemon is listening on" in err_a, err_a
        # a's stop left b's socket alone
        assert request(str(sock), {"request": "status"})["status"]["pid"] == b.pid
    finally:
        if a.poll() is None:
            stop(a)
        n.close()
        if b is not None:
            err_b = stop(b)
            assert b.returncode == 0, err_b
    assert not sock.exists()


def test_a_state_dir_removed_while_running_is_made_and_locked_again(tmp_path: Path) -> None:
    """rm -rf of the state directory under a running daemon: the next write made it
    again, silently and without the lock file, so a second daemon could start on
    it and each one's retention would delete the other's files.  Now the daemon
    makes it again at its next drain, says so, and locks it again."""
    cfg_a = tmp_path / "a.toml"
    write_config(cfg_a, tmp_path)
    cfg_b = tmp_path / "b.toml"
    write_config(cfg_b, tmp_path)
    cfg_b.write_text(cfg_b.read_text().replace(str(tmp_path / "flamed.sock"), str(tmp_path / "b.sock")))
    state = tmp_path / "profiles"
    a = start(cfg_a)
    b: subprocess.Popen[str] | None = None
    try:
        wait_socket(tmp_path / "flamed.sock", a)
        shutil.rmtree(state)
        deadline = time.monotonic() + 30  # drains every 0.2 s
        while not (state / ".flamed.lock").exists():
            assert time.monotonic() < deadline, "the state directory was not made again with its lock"
            time.sleep(0.05)
        b = start(cfg_b)
        try:
            _, err_b = b.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            err_b = "still running"
        assert b.returncode == 2, err_b
        assert f"in use by another flamed daemon (pid {a.pid}" in err_b, err_b
        # a still writes its files there
        files = request(str(tmp_path / "flamed.sock"), {"request": "flush"})["file"]
        assert files is not None and Path(files).parent == state
    finally:
        if b is not None and b.poll() is None:
            stop(b)
        err_a = stop(a)
    assert a.returncode == 0, err_a
    assert f"state directory {state} was removed while the daemon ran; made it again" in err_a, err_a


def test_a_state_dir_replaced_by_a_file_is_said_and_nothing_stale_is_shown(tmp_path: Path) -> None:
    """The state directory replaced by a regular file under a running daemon: the
    write error read "File exists"; status named a latest file that was gone, and
    the disk gauges kept the files that had been there."""
    cfg = tmp_path / "d.toml"
    write_config(cfg, tmp_path)
    cfg.write_text(cfg.read_text().replace('address = ""', 'address = "127.0.0.1:0"'))
    state = tmp_path / "profiles"
    sock = str(tmp_path / "flamed.sock")
    d = start(cfg)
    try:
        wait_socket(tmp_path / "flamed.sock", d)
        first = request(sock, {"request": "flush"})["file"]
        assert first is not None and Path(first).is_file()
        st = request(sock, {"request": "status"})["status"]
        assert st["files"]["latest"] == first

        def gauge(name: str) -> float:
            text = _scrape(st["metrics"])
            return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))

        assert gauge("flamed_disk_files") >= 1
        shutil.rmtree(state)
        state.write_text("not a directory\n")
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(DaemonError):
                request(sock, {"request": "flush"})
            st = request(sock, {"request": "status"})["status"]
            if st["write_error"]:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.1)
        assert f"the state directory {state} is not a directory" in st["write_error"], st["write_error"]
        assert "File exists" not in st["write_error"]
        assert st["files"]["latest"] is None and st["files"]["count"] == 0, st["files"]
        assert gauge("flamed_disk_files") == 0 and gauge("flamed_disk_bytes") == 0
    finally:
        err = stop(d)
    assert d.returncode == 0, err


def test_status_says_when_the_last_drain_is_far_older_than_the_interval() -> None:
    """The control socket answers from a thread of its own: a main loop stuck for
    minutes showed "drain every 1.0 s (last took 0.0003 s)" and nothing else."""
    from flamed.commands.status import _late

    now = time.time_ns()
    assert _late({"last_drain_ns": now - 1_000_000_000, "drain_interval": 1.0}) == ""
    assert _late({"last_drain_ns": 0, "drain_interval": 1.0}) == ""  # no drain yet
    said = _late({"last_drain_ns": now - 60_000_000_000, "drain_interval": 1.0})
    assert "LATE: the last drain was 60 s ago" in said and "stuck" in said
    assert _late({"last_drain_ns": now - 60_000_000_000, "drain_interval": 30.0}) == ""


def test_a_config_replaced_by_a_fifo_is_a_refused_reload_not_a_hang(tmp_path: Path) -> None:
    """The config file replaced by a FIFO, then SIGHUP: the main loop waited in
    open() for a writer for ever (no drains, no answers, SIGTERM ignored).  Now
    the reload is refused at once and the running configuration stays."""
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    with _Ready(cfg, tmp_path) as d:
        cfg.unlink()
        os.mkfifo(cfg)
        d.reload()
        st = request(str(d.sock), {"request": "status"}, timeout=10)["status"]
        assert st["frequency"] == 100 and st["config"] == str(cfg)
    assert d.p.returncode == 0, d.err
    assert (f"reload: invalid configuration, keeping the running one: {cfg}: a pipe (FIFO), "
            "not a regular file") in d.err, d.err


def test_a_metrics_address_that_cannot_be_bound_refuses_the_reload_and_the_next_one_retries(
        tmp_path: Path) -> None:
    """A reload to a metrics port in use closed the running listener, applied the
    rest and counted result="ok": metrics were off, and a second SIGHUP with the
    same file did not try again (the failed address was the running config's).
    Now the new address is bound first: a refused reload keeps the listener and
    the running config, and the next SIGHUP binds it once it is free."""
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    text = cfg.read_text().replace('address = ""', 'address = "127.0.0.1:0"')
    cfg.write_text(text)
    sock = tmp_path / "flamed.sock"
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port2 = blocker.getsockname()[1]
    with blocker, _Ready(cfg, tmp_path) as d:
        first = request(str(sock), {"request": "status"}, timeout=10)["status"]["metrics"]
        assert first is not None
        cfg.write_text(text.replace("127.0.0.1:0", f"127.0.0.1:{port2}").replace("frequency = 100",
                                                                                  "frequency = 50"))
        d.reload()
        st = request(str(sock), {"request": "status"}, timeout=10)["status"]
        assert st["metrics"] == first and st["frequency"] == 100  # nothing of the refused reload applied
        assert st["last_reload"]["result"] == "error"
        assert f"cannot serve metrics on 127.0.0.1:{port2}" in st["last_reload"]["error"], st["last_reload"]
        scraped = _scrape(first)  # the running listener still serves
        assert 'flamed_config_reloads_total{result="error"} 1.0' in scraped, scraped
        blocker.close()
        d.reload()  # the same file: tried again
        st = request(str(sock), {"request": "status"}, timeout=10)["status"]
        assert st["metrics"] == f"127.0.0.1:{port2}" and st["frequency"] == 50
        scraped = _scrape(st["metrics"])
        assert 'flamed_config_reloads_total{result="ok"} 1.0' in scraped, scraped
    assert d.p.returncode == 0, d.err
    assert (f"reload: cannot serve metrics on 127.0.0.1:{port2}: Address already in use; keeping the running "
            "configuration") in d.err, d.err


def test_status_names_a_refused_last_reload_until_one_succeeds(tmp_path: Path) -> None:
    """After a refused reload `flamed status` showed nothing of it, and its
    'config PATH' named a file whose content was not what ran.  The status answer
    now holds the last reload's outcome, and the text says when it failed."""
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, tmp_path)
    text = cfg.read_text()
    sock = tmp_path / "flamed.sock"

    def status_text() -> str:
        r = subprocess.run([*FLAMED, "status", "--socket", str(sock)], capture_output=True, text=True,
                           timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout

    with _Ready(cfg, tmp_path) as d:
        assert request(str(sock), {"request": "status"}, timeout=10)["status"]["last_reload"] is None
        assert not [line for line in status_text().splitlines() if line.startswith("reload ")]
        t0 = time.time_ns()
        cfg.write_text(text.replace("frequency = 100", "frequency = 100\nfrequncy = 50"))
        d.reload()
        last = request(str(sock), {"request": "status"}, timeout=10)["status"]["last_reload"]
        assert last["result"] == "error" and last["time_ns"] >= t0, last
        assert "sampling.frequncy: unknown key" in last["error"], last
        out = status_text()
        row = next((line for line in out.splitlines() if line.startswith("reload ")), "")
        assert "last reload FAILED" in row and "sampling.frequncy: unknown key" in row, out
        cfg.write_text(text.replace("frequency = 100", "frequency = 50"))
        d.reload()
        st = request(str(sock), {"request": "status"}, timeout=10)["status"]
        assert st["frequency"] == 50
        assert st["last_reload"]["result"] == "ok" and st["last_reload"]["error"] is None, st["last_reload"]
        assert "last reload" not in status_text()  # an ok reload: no row
    assert d.p.returncode == 0, d.err
