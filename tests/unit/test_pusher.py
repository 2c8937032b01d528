"""flamed.daemon.pyroscope.Pusher with its sender replaced: which windows are
kept when the queue is full, what is retried, what the counters say.  (The
real HTTP path against a local ingest server is tests/faults/test_fleet_push.py.)"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from flamed.daemon import pyroscope
from flamed.daemon.config import PyroscopeConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.pyroscope import Pusher, PushError, Target
from flamed.daemon.ring import RingWindow

NS = 1_000_000_000


def window(i: int) -> RingWindow:
    return RingWindow(i * NS, (i + 1) * NS, {(7, 7, "app", ("main", f"f{i}")): 3}, 3, sample_rate=99.0, seq=i)


def start_of(req: urllib.request.Request) -> int:
    return int(urllib.parse.parse_qs(urllib.parse.urlsplit(req.full_url).query)["from"][0])


def counted(m: DaemonMetrics, result: str) -> float:
    v = m.registry.get_sample_value("flamed_push_windows_total", {"result": result})
    return float(v or 0.0)


class Server:
    """A sender that blocks while ``gate`` is closed and answers what ``answer`` says."""

    def __init__(self, answer: Callable[[int], PushError | None] = lambda _n: None) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.answer = answer
        self.calls: list[tuple[float, int]] = []  # (monotonic, from)
        self.delivered: list[int] = []

    def __call__(self, _target: Target, req: urllib.request.Request) -> None:
        self.calls.append((time.monotonic(), start_of(req)))
        self.entered.set()
        assert self.gate.wait(30)
        err = self.answer(len(self.calls))
        if err is not None:
            raise err
        self.delivered.append(start_of(req))


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def pusher(server: Server, **cfg: Any) -> tuple[Pusher, DaemonMetrics]:
    m = DaemonMetrics(process=False)
    c = PyroscopeConfig(server_address="http://127.0.0.1:1", application_name="app", **cfg)
    return Pusher(c, m, host="h", root="pid", sender=server), m


def test_a_full_queue_drops_the_oldest_waiting_window_never_the_one_in_flight() -> None:
    server = Server()
    server.gate.clear()
    p, m = pusher(server, max_queue=3)
    try:
        p.submit(window(0))
        assert server.entered.wait(10)  # window 0 is in flight, the server holds it
        for i in range(1, 8):
            p.submit(window(i))
        # 3 waiting (the newest: 5, 6, 7), 0 in flight; 1..4 dropped.
        assert p.dropped == 4 and counted(m, "dropped") == 4
        assert m.registry.get_sample_value("flamed_push_queue_windows") == 3
        server.gate.set()
        wait_until(lambda: len(server.delivered) == 4, "the queue to empty")
        assert server.delivered == [0, 5, 6, 7]
        assert p.sent == 4 and counted(m, "sent") == 4 and counted(m, "failed") == 0
    finally:
        server.gate.set()
        p.stop(5)


def test_max_queue_one_counts_each_window_once() -> None:
    server = Server()
    server.gate.clear()
    p, m = pusher(server, max_queue=1)
    try:
        p.submit(window(0))
        assert server.entered.wait(10)
        p.submit(window(1))
        p.submit(window(2))  # drops 1 (waiting), not 0 (in flight)
        server.gate.set()
        wait_until(lambda: len(server.delivered) == 2, "both kept windows sent")
        assert server.delivered == [0, 2]
        assert (counted(m, "sent"), counted(m, "dropped")) == (2, 1)
    finally:
        server.gate.set()
        p.stop(5)


def test_a_refused_window_is_counted_failed_and_not_retried() -> None:
    server = Server(lambda n: PushError("answered 400 Bad Request", retry=False) if n == 1 else None)
    p, m = pusher(server)
    try:
        p.submit(window(0))
        p.submit(window(1))
        wait_until(lambda: p.sent == 1, "the second window")
        assert [f for _t, f in server.calls] == [0, 1]
        assert (counted(m, "failed"), counted(m, "sent")) == (1, 1)
        assert m.registry.get_sample_value("flamed_push_retries_total") == 0
        assert "400" in p.last_error
    finally:
        p.stop(5)


def test_retries_back_off_doubling_up_to_the_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyroscope, "FIRST_BACKOFF", 0.05)
    server = Server(lambda n: PushError("answered 503", retry=True) if n <= 5 else None)
    p, m = pusher(server, retry_max_backoff=0.2)
    try:
        p.submit(window(0))
        wait_until(lambda: p.sent == 1, "the window, after five failures")
        times = [t for t, _f in server.calls]
        gaps = [b - a for a, b in zip(times, times[1:])]
        # Waits can only be longer than asked: 0.05, 0.1, 0.2, 0.2, 0.2.
        for gap, want in zip(gaps, [0.05, 0.1, 0.2, 0.2, 0.2]):
            assert gap >= want * 0.95, (gaps, want)
        assert len(gaps) == 5
        assert m.registry.get_sample_value("flamed_push_retries_total") == 5
        assert (counted(m, "sent"), counted(m, "failed"), counted(m, "dropped")) == (1, 0, 0)
        assert server.delivered == [0]
    finally:
        p.stop(5)


def test_a_window_waiting_out_a_backoff_can_be_dropped_for_a_newer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyroscope, "FIRST_BACKOFF", 0.3)
    up = threading.Event()
    server = Server(lambda _n: None if up.is_set() else PushError("connection refused", retry=True))
    p, m = pusher(server, max_queue=2, retry_max_backoff=0.3)
    try:
        p.submit(window(0))
        wait_until(lambda: len(server.calls) >= 1, "the first attempt")
        time.sleep(0.05)  # window 0 is now waiting out its backoff, not in flight
        for i in range(1, 4):
            p.submit(window(i))
        up.set()
        wait_until(lambda: p.sent == 2, "the kept windows")
        assert server.delivered == [2, 3]
        assert counted(m, "dropped") == 2
    finally:
        p.stop(5)
