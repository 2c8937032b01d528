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

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from daemonproc import ROOT, DaemonProc, check_state_dir, unix_request_raw, write_config
from test_daemon_faults import record_figure

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
