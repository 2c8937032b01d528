"""The tests' readiness waits: a daemon is ready when it answers, not when its socket file exists."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import wait_daemon_answers


def test_a_bound_socket_that_nobody_listens_on_is_not_ready(tmp_path: Path) -> None:
    # What a starting daemon looks like between bind() and listen(): the path
    # exists, a connect is refused.  (make test once failed here on a fresh machine.)
    path = tmp_path / "flamed.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match="did not answer"):
            wait_daemon_answers(path, alive, timeout=1.0)
    finally:
        alive.kill()
        alive.wait(10)
        s.close()


def test_answers_once_the_daemon_listens(tmp_path: Path) -> None:
    cfg = tmp_path / "flamed.toml"
    sock = tmp_path / "flamed.sock"
    cfg.write_text(f'[sampling]\nsampler = "fake"\n[output]\nstate_dir = "{tmp_path / "p"}"\n'
                   f'[metrics]\naddress = ""\n[control]\nsocket = "{sock}"\n[log]\ntarget = "stderr"\n')
    p = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)],
                         stderr=subprocess.PIPE, text=True)
    try:
        st = wait_daemon_answers(sock, p, timeout=60)
        assert st["pid"] == p.pid
    finally:
        p.terminate()
        p.communicate(timeout=60)
