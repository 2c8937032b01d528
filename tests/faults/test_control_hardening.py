"""What a new user (or a careless member of the socket's group) runs into first.

* Bad requests on the control socket get errors that say what was expected.
* A config file with a byte that is not UTF-8 is one clear error, at start and
  on reload (the running config is kept).
* Two daemons cannot share a state directory; a SIGKILLed one does not block a restart.
* Idle connections do not starve other clients, root's least of all.
* ``make run``'s configuration prints the client commands to copy.

Every daemon here is a real ``flamed daemon`` process (tests/faults/daemonproc.py)
with the synthetic sampler: these are about the socket, the config and the
state directory, not about BPF.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemonproc import ROOT, DaemonProc, check_state_dir, unix_request_raw
from support import write_config
from test_daemon_faults import record_figure

pytestmark = pytest.mark.concurrent

FAKE = {"sampler": "fake", "drain_interval": 0.5}


def _error(d: DaemonProc, data: bytes) -> dict[str, Any]:
    answer = unix_request_raw(d.socket_path, data)
    head = json.loads(answer.split(b"\n", 1)[0])
    assert head["ok"] is False, head
    return head  # type: ignore[no-any-return]


def test_bad_requests_say_what_was_expected(daemon_factory: Any) -> None:
    d = daemon_factory(sampling=FAKE)
    cases = [
        # binary garbage; a leading NUL once made json.loads guess UTF-16
        (b"\xff\xfe\x00\x01garbage\n", ["not UTF-8 text", "byte 0xff at offset 0", '{"request": "status"}']),
        (b"\x00{\x00\"\x00r\n", ["not valid JSON", '{"request": "status"}']),
        (b'{"request": "status", "x": "\xe9"}\n', ["not UTF-8 text", "byte 0xe9 at offset 28"]),
        # Python's int-digits limit must not be what the client reads
        (b'{"request": "snapshot", "pid": ' + b"9" * 5000 + b"}\n",
         ["integer of 5000 digits", "pid, tgid and tid take integers in [0, 2^32)"]),
        (b'{"request": "snapshot", "seconds": NaN}\n', ["NaN", "not a JSON number"]),
        (b"{not json\n", ["not valid JSON", "at offset 1", "docs/protocol.md"]),
    ]
    for data, needles in cases:
        head = _error(d, data)
        assert head["code"] == "bad_request", (data[:40], head)
        msg = head["error"]
        for n in needles:
            assert n in msg, (data[:40], msg)
        for bad in ("codec", "set_int_max_str_digits", "Traceback", "utf-16", "utf-32"):
            assert bad not in msg, (data[:40], msg)
    # The daemon is still fine and counted them as bad requests.
    assert d.status()["pid"] == d.pid
    assert d.metric("flamed_control_requests_total", {"result": "bad_request"}) == len(cases)


# -- a config file that is not UTF-8 ------------------------------------------

LATIN1_CONFIG = b"[sampling]\nsampler = \"fake\"\n# r\xe9sum\xe9 of the settings\n"


def _flamed(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flamed", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(ROOT))


def test_non_utf8_config_is_one_clear_error_and_reload_keeps_running(daemon_factory: Any, tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(LATIN1_CONFIG)
    want = f"{bad}: not UTF-8 text: byte 0xe9 at offset 31 (line 3, column 4)"
    # --check-config and a start: one line naming the file and the byte, exit 2 (no restart loop).
    for extra in (["--check-config"], ["--socket", str(tmp_path / "never.sock"), "--state-dir", str(tmp_path / "s")]):
        r = _flamed("daemon", "--config", str(bad), *extra)
        assert r.returncode == 2, (extra, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "UnicodeDecodeError" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0], r.stderr

    # SIGHUP with such a file: the running config stays and the log says why.
    d = daemon_factory(sampling={**FAKE, "frequency": 49})
    d.config["sampling"]["frequency"] = 7
    write_config(d.cfg_path, d.config)
    good = d.cfg_path.read_bytes()
    d.cfg_path.write_bytes(good + b"# r\xe9sum\xe9\n")
    d.signal(signal.SIGHUP)
    d.wait_for(lambda: d.metric("flamed_config_reloads_total", {"result": "error"}) == 1, 30, "the failed reload")
    assert d.alive()
    st = d.status()
    assert st["frequency"] == 49 and st["pid"] == d.pid, st
    assert "reload: invalid configuration, keeping the running one" in d.log()
    assert "not UTF-8 text: byte 0xe9" in d.log()
    # Fixed file, next reload applies it.
    d.cfg_path.write_bytes(good)
    d.signal(signal.SIGHUP)
    d.wait_for(lambda: d.metric("flamed_config_reloads_total", {"result": "ok"}) == 1, 30, "the good reload")
    assert d.status()["frequency"] == 7
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    record_figure("control_bad_config_reload", {"reloads_error": 1, "daemon_alive_after": True,
                                                "frequency_kept": 49, "exit_code_at_start": 2})


# -- one daemon per state directory -------------------------------------------

def test_second_daemon_on_a_state_dir_is_refused_and_sigkill_leaves_no_stale_lock(
        daemon_factory: Any, tmp_path: Path) -> None:
    first = daemon_factory(sampling=FAKE)
    lock = first.state_dir / ".flamed.lock"
    # Same state directory, its own socket and metrics port: refused, naming the holder.
    second = daemon_factory(name="second", start=False, sampling=FAKE,
                            control={"socket": str(tmp_path / "run2" / "flamed.sock")})
    second.start(wait=False)
    assert second.wait_exit(60) == 2, second.log()
    msg = [ln for ln in second.log().splitlines() if "error" in ln]
    assert msg and f"state directory {first.state_dir} is in use by another flamed daemon (pid {first.pid}" \
        in msg[-1], second.log()
    assert "Traceback" not in second.log()
    assert not Path(second.socket_path).exists()
    assert first.alive() and first.status()["pid"] == first.pid
    assert lock.read_text().strip() == str(first.pid)
    # SIGKILL: the kernel drops the flock with the process; a restart is not blocked by the file left behind.
    first.wait_for(lambda: first.status()["windows"] >= 2, 30, "two windows")
    first.kill9()
    assert lock.exists()
    again = daemon_factory(name="again", sampling=FAKE)
    assert again.status()["state_dir"] == str(first.state_dir)
    assert lock.read_text().strip() == str(again.pid)
    again.signal(signal.SIGTERM)
    assert again.wait_exit(60) == 0
    check_state_dir(again.state_dir, allow_orphans=True)
    record_figure("control_second_daemon", {"exit_code": 2, "names_holder_pid": True,
                                            "restart_after_sigkill": "ready"})


# -- idle connections ------------------------------------------------------------

IDLE_UID = 48433
IDLE_CLIENT = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
conns = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    conns.append(s)
codes = []
for s in conns:  # each gets an answer: busy at once, or timeout when request_timeout runs out
    data = b""
    while b"\n" not in data:
        c = s.recv(4096)
        if not c:
            break
        data += c
    codes.append(json.loads(data.split(b"\n")[0])["code"] if data else "closed")
    s.close()
print(json.dumps(codes))
"""


class IdleHolder:
    """Keeps ``n`` connections open that never send a request; reopens those the daemon closes."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self.socks: list[socket.socket] = []
        self.reopened = 0
        self.answers: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(self.path)
        return s

    def _run(self) -> None:
        self.socks = [self._open() for _ in range(self.n)]
        self.ready.set()
        while not self.stop.is_set():
            readable, _, _ = select.select(self.socks, [], [], 0.05)
            for s in readable:
                data = b""
                with contextlib.suppress(OSError):
                    data = s.recv(4096)
                code = json.loads(data.split(b"\n")[0])["code"] if data.strip() else "closed"
                self.answers[code] = self.answers.get(code, 0) + 1
                s.close()
                self.socks[self.socks.index(s)] = self._open()
                self.reopened += 1

    def __enter__(self) -> IdleHolder:
        self.ready = threading.Event()
        self.thread.start()
        assert self.ready.wait(30), "could not open the idle connections"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        for s in self.socks:
            s.close()


def test_idle_connections_do_not_starve_root_or_other_clients(daemon_factory: Any) -> None:
    import tempfile

    public = Path(tempfile.mkdtemp(prefix="flamed-idle-", dir="/tmp"))
    public.chmod(0o755)  # pytest's tmp_path is 0700: the unprivileged client must reach the socket
    try:
        sock = str(public / "flamed.sock")
        d = daemon_factory(sampling=FAKE, control={"socket": sock, "socket_mode": 0o666,
                                                   "allowed_users": [str(IDLE_UID)], "request_timeout": 3.0})
        d.wait_for(lambda: d.status()["windows"] >= 2, 30, "two windows")
        cli = [sys.executable, "-m", "flamed"]
        latencies: list[float] = []
        with IdleHolder(sock, 100) as idle:
            d.wait_for(lambda: d.status()["pid"] and idle.reopened >= 100, 60,
                       "the daemon to close (and the holder to reopen) 100 idle connections")
            # A non-root uid: 8 connections (max_connections_per_uid) wait for their request, the rest are busy.
            r = subprocess.run(["setpriv", f"--reuid={IDLE_UID}", f"--regid={IDLE_UID}", "--clear-groups",
                                "--inh-caps=-all", "--bounding-set=-all", "--", "/usr/bin/python3", "-c",
                                IDLE_CLIENT, sock, "12"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            codes = json.loads(r.stdout)
            # Root, meanwhile and after: every request served, none busy.
            for i in range(20):
                t = time.monotonic()
                if i % 2:
                    head, payload = d.request({"request": "snapshot", "seconds": 5})
                    assert head["ok"] and len(payload) == head["length"], head
                else:
                    assert d.status()["pid"] == d.pid
                latencies.append(time.monotonic() - t)
            for args in (["status"], ["snapshot", "--seconds", "5", "-o", str(public / "s.folded")]):
                out = subprocess.run([*cli, *args, "--socket", sock], capture_output=True, text=True,
                                     timeout=60, cwd=str(ROOT))
                assert out.returncode == 0, (args, out.stderr)
            assert idle.thread.is_alive()
            answers = dict(idle.answers)
        assert codes.count("busy") == 4 and codes.count("timeout") == 8, codes
        assert set(answers) == {"timeout"}, answers  # idle root connections were timed out, never served "busy"
        assert d.metric("flamed_control_requests_total", {"result": "busy"}) == 4
        assert d.alive()
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
    finally:
        shutil.rmtree(public, ignore_errors=True)
    record_figure("control_idle_connections", {
        "idle_connections_held": 100, "idle_reopened": idle.reopened, "root_requests": len(latencies) + 2,
        "root_served": len(latencies) + 2, "root_busy": 0,
        "latency_median_s": round(statistics.median(latencies), 4),
        "latency_max_s": round(max(latencies), 4),
        "non_root_uid_codes": {"timeout": codes.count("timeout"), "busy": codes.count("busy")},
    })


# -- make run ------------------------------------------------------------------

def test_make_run_config_prints_client_commands_that_work(tmp_path: Path) -> None:
    from flamed.daemon.config import MetricsConfig, load_config, parse_address

    dev = ROOT / "packaging" / "flamed.dev.toml"
    cfg = load_config(str(dev))
    assert parse_address(cfg.metrics.address)[1] != parse_address(MetricsConfig().address)[1], \
        "make run must not take the production metrics port"
    assert "--config packaging/flamed.dev.toml" in (ROOT / "Makefile").read_text()
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/flamed status --socket" in readme and cfg.metrics.address in readme

    # The dev config from another directory (its paths are relative to it), as the console script;
    # the fake sampler and an ephemeral metrics port so it can run beside anything.
    exe = Path(sys.executable).with_name("flamed")
    out_path = tmp_path / "stdout"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([str(exe), "daemon", "--config", str(dev), "--sampler", "fake",
                                 "--metrics-address", "127.0.0.1:0"], cwd=str(tmp_path), stdout=out,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={k: v for k, v in os.environ.items()
                                     if k not in ("NOTIFY_SOCKET", "INVOCATION_ID")})
    try:
        deadline = time.monotonic() + 60
        while "curl" not in out_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, out_path.read_text()
            time.sleep(0.05)
        lines = [ln.strip() for ln in out_path.read_text().splitlines() if ln.startswith("  ")]
        sock = str(tmp_path / "var" / "flamed.sock")
        assert lines[0] == f"{exe} status --socket {sock}", lines
        assert lines[1].startswith(f"{exe} snapshot --socket {sock} "), lines
        # Each command works exactly as printed, from the directory the daemon was started in.
        for cmd in lines[:3]:
            r = subprocess.run(shlex.split(cmd), cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (cmd, r.stderr)
        assert (tmp_path / "now.svg").read_bytes().startswith(b"<?xml")
        url = lines[3].split()[2]
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b"flamed_build_info" in resp.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


SLOW_CLIENT = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
conns = []
for _ in range(n):  # 'next' snapshots hold a serving slot for their whole span
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(path)
    s.sendall(b'{"request": "snapshot", "next": 4}\n')
    conns.append(s)
print("SENT", flush=True)
codes = []
for s in conns:
    data = b""
    while b"\n" not in data:
        c = s.recv(65536)
        if not c:
            break
        data += c
    head = json.loads(data.split(b"\n")[0]) if data else {}
    codes.append("ok" if head.get("ok") else head.get("code", "closed"))
    s.close()
print(json.dumps(codes))
"""


def test_serving_slots_reserved_for_root(daemon_factory: Any) -> None:
    import tempfile

    public = Path(tempfile.mkdtemp(prefix="flamed-rsv-", dir="/tmp"))
    public.chmod(0o755)
    try:
        sock = str(public / "flamed.sock")
        d = daemon_factory(sampling=FAKE, control={"socket": sock, "socket_mode": 0o666, "max_clients": 3,
                                                   "reserved_for_root": 2, "allowed_users": [str(IDLE_UID)]})
        p = subprocess.Popen(["setpriv", f"--reuid={IDLE_UID}", f"--regid={IDLE_UID}", "--clear-groups",
                              "--inh-caps=-all", "--bounding-set=-all", "--", "/usr/bin/python3", "-c",
                              SLOW_CLIENT, sock, "3"], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "SENT"
            # The one slot other users may take is taken: root still has its two.
            d.wait_for(lambda: d.metric("flamed_control_requests_total", {"result": "busy"}) == 2, 30,
                       "the non-root requests beyond the unreserved slot to be refused")
            # counted as the snapshots they were, read before the refusal
            assert d.metric("flamed_control_requests_total", {"request": "snapshot", "result": "busy"}) == 2
            assert d.status()["clients"] >= 2  # root's status is served beside the non-root snapshot
            head, payload = d.request({"request": "snapshot", "seconds": 5})
            assert head["ok"] and len(payload) == head["length"]
            out, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert sorted(json.loads(out)) == ["busy", "busy", "ok"], out
    finally:
        shutil.rmtree(public, ignore_errors=True)
