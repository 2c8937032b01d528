from __future__ import annotations

import json
import time

import pytest

from flamed.daemon.protocol import (
    MAX_REQUEST_BYTES,
    ProtocolError,
    SnapshotFilter,
    SnapshotRequest,
    check_regex,
    parse_request,
    request_kind,
)

FORMATS = ["folded", "svg"]


def req(obj: object) -> bytes:
    return json.dumps(obj).encode()


def parse(obj: object):
    return parse_request(req(obj), formats=FORMATS, max_next=60)


def test_valid_snapshot() -> None:
    r = parse({"request": "snapshot", "seconds": 30, "pid": [1, 2], "tgid": 3, "tid": 4, "comm": "^py",
               "frame": "ext4_", "frames": "kernel", "format": "svg", "root": "tid"})
    assert r.snapshot == SnapshotRequest(seconds=30.0, pids=frozenset({1, 2, 3}), tids=frozenset({4}), comm="^py",
                                         frame="ext4_", frames="kernel", format="svg", root="tid")
    assert parse({"request": "snapshot"}).snapshot.seconds == 60.0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ([1, 2], "JSON object"),
        ({"request": "dance"}, "'request'"),
        ({"seconds": 3}, "'request'"),
        ({"request": "status", "seconds": 3}, "unknown field"),
        ({"request": "snapshot", "pids": [1]}, "unknown field(s) for 'snapshot': pids"),
        ({"request": "snapshot", "seconds": -1}, "'seconds'"),
        ({"request": "snapshot", "seconds": "10"}, "'seconds'"),
        # beyond a week: the message gives the bound that was passed, not only "> 0"
        ({"request": "snapshot", "seconds": 10**9}, "at most 604800"),
        ({"request": "snapshot", "next": 1e308}, "'next' must be a number of seconds above 0 and at most 604800"),
        ({"request": "snapshot", "seconds": 1, "next": 1}, "give one of"),
        ({"request": "snapshot", "since_ns": 1, "seconds": 1}, "give one of"),
        ({"request": "snapshot", "since_ns": -1}, "nanoseconds since the epoch"),
        ({"request": "snapshot", "since_ns": 1.5}, "nanoseconds since the epoch"),
        # an integer, too large: the message gives the range, not "must be an integer"
        ({"request": "snapshot", "since_ns": 99999999999999999999}, "from 0 to 2**63 - 1"),
        ({"request": "snapshot", "since_ns": 1, "drain": "yes"}, "true or false"),
        ({"request": "snapshot", "seconds": 5, "drain": False}, "goes with 'since_ns' only"),
        ({"request": "snapshot", "next": 61}, "at most 60"),
        ({"request": "snapshot", "pid": "12"}, "'pid'"),
        ({"request": "snapshot", "pid": []}, "'pid'"),
        ({"request": "snapshot", "pid": [True]}, "'pid'"),
        ({"request": "snapshot", "pid": 2**40}, "'pid'"),
        ({"request": "snapshot", "format": "png"}, "'format' must be one of folded, svg"),
        ({"request": "snapshot", "frames": "both"}, "'frames'"),
        ({"request": "snapshot", "root": "x"}, "'root'"),
        ({"request": "snapshot", "comm": 5}, "'comm'"),
        ({"request": "snapshot", "comm": "("}, "invalid regular expression"),
        ({"request": "snapshot", "frame": "(a+)+$"}, "nested repetition"),
        ({"request": "snapshot", "frame": "(a|aa)*$"}, "alternation inside a repetition"),
        ({"request": "snapshot", "frame": r"(a)\1"}, "backreferences"),
        ({"request": "snapshot", "frame": "a" * 300}, "longer than"),
        ({"request": "snapshot", "title": "x" * 300}, "'title'"),
    ],
)
def test_bad_requests(obj: object, needle: str) -> None:
    with pytest.raises(ProtocolError) as e:
        parse(obj)
    assert needle in str(e.value)


def test_not_json_and_too_large() -> None:
    with pytest.raises(ProtocolError, match="not valid JSON"):
        parse_request(b"{nope", formats=FORMATS, max_next=1)
    with pytest.raises(ProtocolError, match="not UTF-8 text"):
        parse_request(b"\xff\xfe", formats=FORMATS, max_next=1)
    with pytest.raises(ProtocolError) as e:
        parse_request(b" " * (MAX_REQUEST_BYTES + 1), formats=FORMATS, max_next=1)
    assert e.value.code == "too_large"
    with pytest.raises(ProtocolError):
        parse_request(b"[" * 100000, formats=FORMATS, max_next=1)


@pytest.mark.parametrize("pattern", ["(a+)+b", "(a*)*b", "(a|a)*b", "(.*a){12}", "((ab)*)+", "(?:a+){2,}c"])
def test_pathological_regexes_are_refused(pattern: str) -> None:
    with pytest.raises(ValueError):
        check_regex(pattern)


@pytest.mark.parametrize("pattern", ["^python", "ext4_.*write", r"do_sys_\w+_\[k\]$", "(foo|bar)baz", "a{2,5}b+"])
def test_ordinary_regexes_pass_and_are_fast(pattern: str) -> None:
    rx = check_regex(pattern)
    t = time.perf_counter()
    rx.search("a" * 5000 + "!")
    assert time.perf_counter() - t < 1.0


def test_filter_tasks_and_frame_kinds() -> None:
    counts = {
        (10, 10, "python3", ("main", "f", "sys_read_[k]")): 3,
        (10, 11, "python3", ("main", "g")): 2,
        (20, 20, "bash", ("main", "sys_write_[k]")): 5,
    }
    out: dict = {}
    SnapshotFilter(SnapshotRequest(pids=frozenset({10}))).apply(counts, out)
    assert sum(out.values()) == 5
    out = {}
    SnapshotFilter(SnapshotRequest(tids=frozenset({11}))).apply(counts, out)
    assert list(out.values()) == [2]
    out = {}
    SnapshotFilter(SnapshotRequest(comm="^ba")).apply(counts, out)
    assert list(out) == [(20, 20, "bash", ("main", "sys_write_[k]"))]
    out = {}
    SnapshotFilter(SnapshotRequest(frames="kernel")).apply(counts, out)
    assert out == {(10, 10, "python3", ("sys_read_[k]",)): 3, (20, 20, "bash", ("sys_write_[k]",)): 5}
    out = {}
    SnapshotFilter(SnapshotRequest(frames="user", frame="^g$")).apply(counts, out)
    assert out == {(10, 11, "python3", ("main", "g")): 2}
    out = {}
    SnapshotFilter(SnapshotRequest(exclude_frame="_\\[k\\]$")).apply(counts, out)
    assert sum(out.values()) == 2


def test_frames_filters_keep_the_off_cpu_reason() -> None:
    """An off-CPU stack's leaf ([off-cpu: blocked], [off-cpu: preempted], [gil
    wait]) says why the thread waited: --frames kernel keeps it, so a blocked
    and a preempted wait in the same kernel frames stay apart, as with --frames user."""
    counts = {
        (10, 10, "py", ("main", "nap", "do_nanosleep_[k]", "schedule_[k]", "[off-cpu: blocked]")): 900,
        (10, 10, "py", ("main", "nap", "do_nanosleep_[k]", "schedule_[k]", "[off-cpu: preempted]")): 50,
        (10, 11, "py", ("main", "spin", "futex_wait_[k]", "schedule_[k]", "[gil wait]")): 70,
    }
    out: dict = {}
    SnapshotFilter(SnapshotRequest(frames="kernel")).apply(counts, out)
    assert out == {
        (10, 10, "py", ("do_nanosleep_[k]", "schedule_[k]", "[off-cpu: blocked]")): 900,
        (10, 10, "py", ("do_nanosleep_[k]", "schedule_[k]", "[off-cpu: preempted]")): 50,
        (10, 11, "py", ("futex_wait_[k]", "schedule_[k]", "[gil wait]")): 70,
    }
    out = {}
    SnapshotFilter(SnapshotRequest(frames="user")).apply(counts, out)
    assert out == {(10, 10, "py", ("main", "nap", "[off-cpu: blocked]")): 900,
                   (10, 10, "py", ("main", "nap", "[off-cpu: preempted]")): 50,
                   (10, 11, "py", ("main", "spin", "[gil wait]")): 70}



@pytest.mark.parametrize("request_lands", ["before the close", "after the close"])
def test_a_refusal_is_read_whichever_side_goes_first(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                     request_lands: str) -> None:
    """The daemon refuses (denied, busy) without waiting for the request.  Closing a Unix
    socket with the request unread resets the connection, and a request sent after the
    close fails with EPIPE: in both orders the refusal sent first is what the client reads."""
    import socket
    import threading

    import flamed.daemon.client as client
    from flamed.daemon.protocol import error_header

    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    closed = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        conn.send(error_header("permission denied for uid 1", "denied"))
        if request_lands == "before the close":
            conn.settimeout(5)
            conn.recv(1, socket.MSG_PEEK)  # the request is queued, unread
        conn.close()
        closed.set()

    if request_lands == "after the close":
        real = client._connect

        def connect_then_wait(p: str, timeout: float) -> socket.socket:
            s = real(p, timeout)
            assert closed.wait(5)
            return s

        monkeypatch.setattr(client, "_connect", connect_then_wait)
    real_read = client._read_header

    def read_after_the_close(f: object, p: str) -> object:
        assert closed.wait(5)  # the reset (or the EPIPE) has happened: the answer must still be there
        return real_read(f, p)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "_read_header", read_after_the_close)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(client.DaemonError) as e:
            client.request(path, {"request": "status"}, timeout=5)
        assert e.value.code == "denied" and "uid 1" in str(e.value)
    finally:
        t.join(5)
        srv.close()


@pytest.mark.parametrize(("line", "kind"), [
    (b'{"request": "snapshot", "next": 4}', "snapshot"),
    (b'\xef\xbb\xbf{"request": "status"}', "status"),
    (b'{"request": "flush", "bogus": 1}', "flush"),  # named, even if parse_request would refuse it
    (b'{"request": "reboot"}', "unknown"),
    (b'{"request": ["status"]}', "unknown"),
    (b'["status"]', "unknown"),
    (b'{"request": "status", "pid": 1' + b"0" * 5000 + b"}", "unknown"),
    (b'{"request": "status", "x": NaN}', "unknown"),
    (b"\xff\xfe", "unknown"),
    (b"[" * 100_000, "unknown"),
    (b'{"request": "status", "x": "' + b"a" * MAX_REQUEST_BYTES + b'"}', "unknown"),
])
def test_request_kind_names_only_known_requests(line: bytes, kind: str) -> None:
    assert request_kind(line) == kind
