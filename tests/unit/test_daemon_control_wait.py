"""Control-socket requests that wait: clients that hang up, spans the ring cannot
hold or the daemon's stop cuts short, and how each is counted and reported.

In-process daemons with the fake sampler (flamed.daemon.testing), and the
``flamed snapshot`` command run in-process (flamed.cli.main).
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from flamed.cli import main
from flamed.daemon.client import DaemonError, request
from flamed.daemon.config import ControlConfig
from flamed.daemon.control import ControlServer
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.testing import fast_config, running_daemon

if TYPE_CHECKING:
    from flamed.daemon.control import Client


def _wait(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _count(metrics: DaemonMetrics, request_kind: str, result: str) -> float:
    v = metrics.registry.get_sample_value("flamed_control_requests_total",
                                          {"request": request_kind, "result": result})
    return v or 0.0


def _cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    code = main(["snapshot", *argv], stdout=io.StringIO(), stderr=err)
    return code, err.getvalue()


def test_a_waiting_next_request_whose_client_hung_up_frees_its_slot(tmp_path: Path) -> None:
    cfg = fast_config(tmp_path, control={"socket": str(tmp_path / "flamed.sock"), "max_clients": 3,
                                         "client_timeout": 2.0})
    with running_daemon(cfg) as d:
        sock = str(tmp_path / "flamed.sock")
        # Every slot taken by a 'next' request whose client is already gone.
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock)
            s.sendall(b'{"request": "snapshot", "next": 30}\n')
            s.close()
        # Given back within a step of the wait, not after the 30 s span.
        _wait(lambda: _count(d.metrics, "snapshot", "gone") == 3, 10, "the three requests to be counted gone")
        _wait(lambda: d.control.active == 0, 5, "the slots to be free")
        assert request(sock, {"request": "status"})["ok"]
        # A client that only shut down its writing side (after its line) still reads: it is not gone.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(20)
        s.connect(sock)
        try:
            s.sendall(b'{"request": "snapshot", "next": 0.6}\n')
            s.shutdown(socket.SHUT_WR)
            f = s.makefile("rb")
            head = json.loads(f.readline())
            assert head["ok"], head
            assert len(f.read(head["length"])) == head["length"]
            f.close()
        finally:
            s.close()
        _wait(lambda: _count(d.metrics, "snapshot", "ok") == 1, 5, "the half-closed client's answer to count")
        assert _count(d.metrics, "snapshot", "gone") == 3


def test_an_answer_not_all_sent_is_counted_gone(tmp_path: Path) -> None:
    """A client that hangs up mid-payload, or stops reading for client_timeout, is not 'ok'."""
    sent = threading.Event()

    def handler(line: bytes, client: Client) -> Iterator[bytes]:  # noqa: F821 - a type only
        client.request = "snapshot"
        yield b'{"ok": true, "length": 67108864}\n'
        for _ in range(64):  # far more than the socket buffers hold
            yield b"x" * (1 << 20)
        sent.set()

    metrics = DaemonMetrics(process=False)
    server = ControlServer(ControlConfig(socket=str(tmp_path / "c.sock"), client_timeout=0.3), handler, metrics)
    server.start()
    try:
        for how in ("hang up", "stop reading"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(tmp_path / "c.sock"))
            try:
                s.sendall(b'{"request": "snapshot"}\n')
                assert s.recv(1)  # the answer has begun
                if how == "hang up":
                    s.close()
                _wait(lambda: server.active == 0, 10, f"the client that {how}s to be let go")
            finally:
                s.close()
        assert _count(metrics, "snapshot", "gone") == 2
        assert _count(metrics, "snapshot", "ok") == 0
        assert not sent.is_set()
    finally:
        server.stop()


def test_a_bad_field_is_counted_under_its_request(tmp_path: Path) -> None:
    with running_daemon(fast_config(tmp_path)) as d:
        sock = str(tmp_path / "flamed.sock")
        for bad in ({"request": "snapshot", "seconds": 0}, {"request": "snapshot", "colour": "red"}):
            with pytest.raises(DaemonError) as e:
                request(sock, bad, timeout=5)
            assert e.value.code == "bad_request"
        with pytest.raises(DaemonError):
            request(sock, {"request": "nothing"}, timeout=5)
        assert _count(d.metrics, "snapshot", "bad_request") == 2
        assert _count(d.metrics, "unknown", "bad_request") == 1


def test_next_longer_than_the_ring_is_refused(tmp_path: Path) -> None:
    with running_daemon(fast_config(tmp_path, snapshot={"ring_seconds": 1.0})) as d:
        with pytest.raises(DaemonError) as e:
            request(str(tmp_path / "flamed.sock"), {"request": "snapshot", "next": 1.5}, io.BytesIO(), timeout=5)
        assert e.value.code == "bad_request"
        assert "snapshot.ring_seconds" in str(e.value) and "at most 1 s" in str(e.value), e.value
        assert _count(d.metrics, "snapshot", "bad_request") == 1


def test_seconds_beyond_the_ring_says_the_profile_is_shorter(tmp_path: Path) -> None:
    cfg = fast_config(tmp_path, snapshot={"ring_seconds": 0.5})
    with running_daemon(cfg) as d:
        sock = str(tmp_path / "flamed.sock")
        _wait(lambda: (d.ring.oldest_start_ns() or time.time_ns()) < time.time_ns() - 600_000_000, 10,
              "the ring to drop its first windows")
        head = request(sock, {"request": "snapshot", "seconds": 5}, io.BytesIO())
        assert head["partial"] is True and head["partial_reason"] == "ring", head
        assert head["end_ns"] - head["start_ns"] < 2e9
        out = tmp_path / "s.folded"
        code, err = _cli("--socket", sock, "--seconds", "5", "-o", str(out))
        assert code == 0, err
        assert "of the 5 s asked" in err and "snapshot.ring_seconds" in err, err
        assert out.stat().st_size > 0
        # Within the ring: nothing to say.
        head = request(sock, {"request": "snapshot", "seconds": 0.2}, io.BytesIO())
        assert head["partial"] is False and head["partial_reason"] is None, head
        code, err = _cli("--socket", sock, "--seconds", "0.2", "-o", str(out))
        assert code == 0 and err == "", err


def test_a_next_span_cut_short_by_the_stop_is_marked_partial(tmp_path: Path) -> None:
    cfg = fast_config(tmp_path)
    sock = str(tmp_path / "flamed.sock")
    out = tmp_path / "next.folded"
    result: dict[str, Any] = {}

    def cli() -> None:
        result["cli"] = _cli("--socket", sock, "--next", "8", "-o", str(out), "--timeout", "20")

    with running_daemon(cfg) as d:
        t = threading.Thread(target=cli)
        t.start()
        try:
            _wait(lambda: d.control.active == 1, 10, "the 'next' request to wait")
            time.sleep(0.3)  # some of the span recorded
            d.request_stop()
        finally:
            t.join(30)
        assert not t.is_alive()
    code, err = result["cli"]
    assert code == 1, err
    assert "the daemon stopped before the span ended" in err and "of the 8 s asked" in err, err
    assert out.stat().st_size > 0  # what was recorded is written


def test_flush_refuses_profile_options() -> None:
    code, err = _cli("--socket", "/nonexistent/flamed.sock", "--flush", "--seconds", "5", "--pid", "1",
                     "-o", "x.svg")
    assert code == 2, err
    assert "--seconds, --pid, --output cannot go with it" in err, err
