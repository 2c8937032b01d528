"""``flamed serve``'s JSON API over a real server process: state directory and timestamped trace."""

from __future__ import annotations

import io
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flamed.folded import read_folded
from flamed.outputs.pprof import read_pprof
from servedata import NS, T0, write_state_dir
from serveproc import serve

pytestmark = pytest.mark.concurrent

T0_MS = T0 // 1_000_000


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()  # type: ignore[no-any-return]


def test_state_dir_api(tmp_path: Path) -> None:
    write_state_dir(tmp_path, files=4)
    with serve("--state-dir", str(tmp_path)) as url:
        idx = json.loads(_get(url + "api/index"))
        assert idx["files"] == 4 and idx["start_ms"] == T0_MS and idx["end_ms"] == T0_MS + 240_000
        tl = json.loads(_get(url + f"api/timeline?start={T0_MS}&end={T0_MS + 240_000}&view=histogram"))
        assert tl["view"] == "histogram" and sum(tl["counts"]) == 4 * 60 * 100
        first = read_folded(io.BytesIO(_get(url + f"api/profile?format=folded&start={T0_MS}&end={T0_MS + 120_000}")))
        leaves = {s[3] for s in first.stacks if s[2] == "run"}
        assert leaves == {"func_a"}
        p = read_pprof(_get(url + f"api/profile?format=pprof&comm=^work$&pid=4242&exclude=common&start={T0_MS}&end={T0_MS + 240_000}"))
        assert p.total() == 4 * 60 * 97
        top = json.loads(_get(url + f"api/top?start={T0_MS}&end={T0_MS + 240_000}&kinds=native"))
        assert "sys_read_[k]" not in {r["name"] for r in top["rows"]}
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url + "api/index", data=b"x", method="POST"), timeout=30)
        assert e.value.code == 405
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(url + "api/profile?include=(")
        assert e.value.code == 400 and b"not a valid regex" in e.value.read()


def test_svg_minwidth_is_a_parameter(tmp_path: Path) -> None:
    """The page asks for 0.5 px boxes, a download keeps flamed svg's 0.1 px."""
    # 4,000 leaves of equal weight in each file: ~0.3 px each in a 1200 px graph.
    write_state_dir(tmp_path, files=2, stacks_per_phase=4000, window_s=10)
    with serve("--state-dir", str(tmp_path)) as url:
        rng = f"start={T0_MS}&end={T0_MS + 120_000}"
        full = _get(url + f"api/profile?format=svg&{rng}")
        page = _get(url + f"api/profile?format=svg&{rng}&minwidth=0.5")
        coarse = _get(url + f"api/profile?format=svg&{rng}&minwidth=5")
        assert full.count(b"<g") > page.count(b"<g") >= coarse.count(b"<g"), (
            full.count(b"<g"), page.count(b"<g"), coarse.count(b"<g"))
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(url + f"api/profile?format=svg&{rng}&minwidth=wide")
        assert e.value.code == 400 and b"minwidth" in e.value.read()


def test_heatmap_of_ten_second_windows(tmp_path: Path) -> None:
    """The shipped config drains every 10 s: each window's count covers its ten
    seconds of the heatmap, not the first of them (nine empty rows in ten)."""
    write_state_dir(tmp_path, files=2, window_s=10)
    with serve("--state-dir", str(tmp_path)) as url:
        tl = json.loads(_get(url + f"api/timeline?start={T0_MS}&end={T0_MS + 120_000}&view=heatmap"))
        assert tl["view"] == "heatmap" and tl["cols"] == 2 and tl["rows"] == 60
        for col in tl["cells"]:
            assert col == pytest.approx([10.0] * 60), col  # (97 + 3) per 10 s window, over its 10 rows
        hist = json.loads(_get(url + f"api/timeline?start={T0_MS}&end={T0_MS + 120_000}&view=histogram"))
        assert sum(hist["counts"]) == pytest.approx(2 * 6 * 100)
        # A range starting inside a window counts only that window's seconds in it.
        part = json.loads(_get(url + f"api/timeline?start={T0_MS + 5_000}&end={T0_MS + 60_000}&view=histogram"))
        assert sum(part["counts"]) == pytest.approx(55 * 10)


def test_trace_subsecond_heatmap(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    base = 1_700_000_000
    lines = ["# flamed trace"]
    for s in range(3):
        for ms in range(0, 1000, 10):
            hot = ms < 100  # the first 100 ms of each second run hot()
            lines.append(f"{base + s}.{ms:03d}000000 app-7;main;{'hot' if hot else 'idle'} {5 if hot else 1}")
    trace.write_text("\n".join(lines) + "\n")
    with serve(str(trace)) as url:
        idx = json.loads(_get(url + "api/index"))
        assert idx["timestamped"] and idx["kind"] == "trace"
        tl = json.loads(_get(url + f"api/timeline?start={idx['start_ms']}&end={idx['end_ms']}"))
        assert tl["view"] == "heatmap" and tl["cols"] == 3 and tl["rows"] == 50 and tl["col_ms"] == 1000
        for col in tl["cells"]:
            assert col[:5] == [10, 10, 10, 10, 10] and col[5:] == [2] * 45  # 20 ms rows
        # The first 100 ms of the second second: hot only.
        f = _get(url + f"api/profile?format=folded&start={(base + 1) * 1000}&end={(base + 1) * 1000 + 100}")
        assert f == b"app-7;main;hot 50\n"


def test_untimed_file_among_timestamped_is_left_out(tmp_path: Path) -> None:
    """A folded file (no time) served with a timestamped trace was placed at 1970,
    so the timeline spanned 1970 to the trace; it is left out, and said so."""
    from serveproc import serve_process

    trace = tmp_path / "a.trace"
    base = 1_700_000_000
    trace.write_text("# flamed trace\n" + "".join(f"{base + s}.000000000 app-7;main;work 3\n" for s in range(3)))
    folded = tmp_path / "x.folded"
    folded.write_text("app;main;other 5\n")
    with serve_process(str(trace), str(folded)) as (url, proc):
        idx = json.loads(_get(url + "api/index"))
        assert idx["start_ms"] == base * 1000 and idx["end_ms"] <= (base + 3) * 1000, idx
        assert idx["left_out"] == ["x.folded"] and idx["weight"] == 9
        f = _get(url + f"api/profile?format=folded&start={idx['start_ms']}&end={idx['end_ms']}")
        assert f == b"app-7;main;work 9\n"
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "left out" in err and "x.folded" in err, err
    # on their own, untimed files still make a timeline, one second each
    with serve(str(folded), str(folded)) as url:
        idx = json.loads(_get(url + "api/index"))
        assert idx["left_out"] == [] and idx["start_ms"] == 0 and idx["end_ms"] == 2000 and idx["weight"] == 10


def test_dns_rebinding_is_refused_on_loopback(tmp_path: Path) -> None:
    """A page whose name resolves to 127.0.0.1 still sends its own Host: refused,
    even a name that starts like a loopback address (127.0.0.1.evil.example,
    which its owner can point at 127.0.0.1, was let through)."""
    import http.client
    import urllib.parse

    write_state_dir(tmp_path, files=2)
    with serve("--state-dir", str(tmp_path)) as url:
        port = urllib.parse.urlsplit(url).port
        for host, want in (("evil.example", 403), ("evil.example:80", 403), (f"127.0.0.1:{port}", 200),
                           (f"localhost:{port}", 200), (f"127.0.0.1.evil.example:{port}", 403),
                           ("127.0.0.1.evil.example", 403), (f"127.evil.example:{port}", 403),
                           (f"127.0.0.2:{port}", 200), (f"[::1]:{port}", 200), ("localhost.", 200),
                           (f"[::1.evil.example]:{port}", 403)):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/api/index", headers={"Host": host})
            assert c.getresponse().status == want, host
            c.close()


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_connections_are_closed_and_others_served(tmp_path: Path) -> None:
    """A client that connects and sends nothing, or half a request, held a server
    thread for ever: with --timeout it is closed, its thread ends, and other
    clients are answered meanwhile."""
    import socket
    import time
    import urllib.parse

    from serveproc import serve_process

    write_state_dir(tmp_path, files=2)
    with serve_process("--state-dir", str(tmp_path), "--timeout", "1") as (url, proc):
        port = urllib.parse.urlsplit(url).port
        assert port is not None
        base = _threads(proc.pid)  # no connection yet: the main thread
        assert json.loads(_get(url + "api/index"))["files"] == 2
        stuck = []
        for i in range(6):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i % 2:
                s.sendall(b"GET /api/index HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: half a request
            stuck.append(s)
        try:
            # each holds a thread until its timeout, and the server still answers others
            assert json.loads(_get(url + "api/index"))["files"] == 2
            for s in stuck:  # closed by the server: EOF (or a 408 answer, then EOF), not our 30 s timeout
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
                assert data == b"" or data.startswith(b"HTTP/1.0 408"), data[:100]
        finally:
            for s in stuck:
                s.close()
        deadline = time.monotonic() + 30
        while _threads(proc.pid) > base and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads(proc.pid) <= base
        assert json.loads(_get(url + "api/index"))["files"] == 2


def _read_to_eof(s: "socket.socket") -> bytes:
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def test_a_request_trickled_byte_by_byte_is_cut_at_the_timeout(tmp_path: Path) -> None:
    """--timeout bounded each read, not the request: a client sending a byte of
    its request line now and then (each within the timeout) kept its thread
    for ever.  Now the whole request has --timeout from the connection."""
    import socket
    import time
    import urllib.parse

    from serveproc import serve_process

    write_state_dir(tmp_path, files=1)
    with serve_process("--state-dir", str(tmp_path), "--timeout", "2") as (url, proc):
        port = urllib.parse.urlsplit(url).port
        assert port is not None
        base = _threads(proc.pid)
        request = b"GET /api/index HTTP/1.0\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 200
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        sent = 0
        closed = False
        try:
            # a byte every 0.25 s: each read waits far less than the 2 s timeout;
            # 200+ bytes would take over 50 s, the server must cut it long before
            for i in range(len(request)):
                try:
                    s.sendall(request[i:i + 1])
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                sent += 1
                readable = __import__("select").select([s], [], [], 0.25)[0]
                if readable:
                    closed = True  # an answer (408) or EOF: the server gave up on it
                    break
            assert closed, "the server kept reading a request that never ends"
            assert sent < len(request)
            try:
                data = _read_to_eof(s)
            except ConnectionResetError:
                data = b""
            assert data == b"" or data.startswith(b"HTTP/1.0 408"), data[:100]
        finally:
            s.close()
        deadline = time.monotonic() + 30
        while _threads(proc.pid) > base and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads(proc.pid) <= base
        assert json.loads(_get(url + "api/index"))["files"] == 1


def test_connections_over_the_cap_get_503_at_once(tmp_path: Path) -> None:
    """Every connection took a thread, without bound: 1,000 idle connections were
    1,000 threads.  Now --max-connections are served at once; more get a 503
    from the accepting thread (no thread), and are served again once others end."""
    import socket
    import time
    import urllib.error
    import urllib.parse

    from serveproc import serve_process

    write_state_dir(tmp_path, files=1)
    with serve_process("--state-dir", str(tmp_path), "--timeout", "60", "--max-connections", "3") as (url, proc):
        port = urllib.parse.urlsplit(url).port
        assert port is not None
        base = _threads(proc.pid)
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        try:
            deadline = time.monotonic() + 30  # the three are accepted, each in its thread
            while _threads(proc.pid) < base + 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _threads(proc.pid) == base + 3
            over = []
            for _ in range(20):  # more than the cap: each refused at once, no thread
                c = socket.create_connection(("127.0.0.1", port), timeout=30)
                c.sendall(b"GET /api/index HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                over.append(c)
            for c in over:
                data = _read_to_eof(c)
                c.close()
                assert data.startswith(b"HTTP/1.0 503"), data[:200]
                assert b"too many connections" in data and b"--max-connections" in data, data
            assert _threads(proc.pid) == base + 3
            with pytest.raises(urllib.error.HTTPError) as e:
                _get(url + "api/index")
            assert e.value.code == 503
        finally:
            for c in held:
                c.close()
        deadline = time.monotonic() + 30  # the held ones end (EOF): served again
        while _threads(proc.pid) > base and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(_get(url + "api/index"))["files"] == 1


def _wait_index(url: str, files: int, timeout: float = 30.0) -> dict[str, object]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        idx: dict[str, object] = json.loads(_get(url + "api/index"))
        if idx["files"] == files or time.monotonic() > deadline:
            return idx
        time.sleep(0.2)


def test_state_dir_live_refresh(tmp_path: Path) -> None:
    """Files the daemon rotates after the server started (and files retention removes) show up
    in the index, the timeline and the ranges without a restart."""
    first = write_state_dir(tmp_path, files=4)  # func_a, func_a, func_b, func_b
    with serve("--state-dir", str(tmp_path)) as url:
        assert json.loads(_get(url + "api/index"))["files"] == 4
        # Two more minutes, written by the daemon's store while the server runs: func_a, then func_b.
        write_state_dir(tmp_path, files=2, t0=T0 + 240 * NS)
        idx = _wait_index(url, 6)
        assert idx["files"] == 6 and idx["end_ms"] == T0_MS + 360_000
        tl = json.loads(_get(url + f"api/timeline?start={T0_MS}&end={T0_MS + 360_000}&view=histogram"))
        assert sum(tl["counts"]) == 6 * 60 * 100
        new = read_folded(io.BytesIO(_get(url + f"api/profile?format=folded&start={T0_MS + 240_000}&end={T0_MS + 300_000}")))
        assert {s[3] for s in new.stacks if s[2] == "run"} == {"func_a"}
        # Retention removes the oldest file (after it was read once): it leaves the index and the ranges.
        _get(url + f"api/profile?format=folded&start={T0_MS}&end={T0_MS + 60_000}")
        first[0].unlink()
        first[0].with_name(first[0].name.split(".folded")[0] + ".json").unlink()
        idx = _wait_index(url, 5)
        assert idx["files"] == 5 and idx["start_ms"] == T0_MS + 60_000
        assert _get(url + f"api/profile?format=folded&start={T0_MS}&end={T0_MS + 60_000}") == b""


def test_thread_filter(tmp_path: Path) -> None:
    """tid keeps one thread's stacks in the graph, the top table and the timeline alike."""
    write_state_dir(tmp_path, files=2, root_frame="tid")
    with serve("--state-dir", str(tmp_path)) as url:
        rng = f"start={T0_MS}&end={T0_MS + 120_000}"
        f = read_folded(io.BytesIO(_get(url + f"api/profile?format=folded&tid=4243&{rng}")))
        assert set(f.stacks) == {("work-4242/4243", "main", "loop (app/loop.py:12)", "common")}
        assert f.total() == 2 * 60 * 3
        tl = json.loads(_get(url + f"api/timeline?view=histogram&tid=4243&{rng}"))
        assert sum(tl["counts"]) == 2 * 60 * 3
        top = json.loads(_get(url + f"api/top?tid=4242,4244&{rng}"))
        assert {r["name"] for r in top["rows"]} == {"work-4242/4242", "main", "run", "func_a", "func_b", "sys_read_[k]"}
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(url + f"api/profile?tid=x&{rng}")
        assert e.value.code == 400 and b"tid filter" in e.value.read()


def test_bad_parameters_get_an_answer(tmp_path: Path) -> None:
    """A parameter out of shape is a 400 naming it, never a dropped connection
    (a traceback in the server and nothing for the client); a range reaching
    the year 2262 is drawn in at most 720 bars, not a list of a billion."""
    trace = tmp_path / "t.trace"
    trace.write_text("# flamed trace\n1700000000.000000000 app-7;main;hot 3\n1700000000.500000000 app-7;main;idle 1\n")
    with serve(str(trace)) as url:
        for query, expect in [
            ("api/top?limit=abc", b"limit"),
            ("api/top?limit=-1", b"limit"),
            ("api/top?limit=%C2%B2", b"limit"),  # a Unicode digit int() refuses
            ("api/diff?format=json&limit=x&bstart=1700000000000&bend=1700000000600", b"limit"),
            ("api/profile?width=%C2%B2", b"width"),
            ("api/profile?start=0&end=99999999999999999999", b"end"),
            ("api/profile?start=-5&end=1700000000600", b"start"),
            ("api/timeline?start=0&end=99999999999999999999", b"end"),
        ]:
            with pytest.raises(urllib.error.HTTPError) as e:
                _get(url + query)
            assert e.value.code == 400, (query, e.value.code)
            assert expect in json.loads(e.value.read())["error"].encode(), query
        far = 9_000_000_000_000  # ms: the year 2255
        tl = json.loads(_get(url + f"api/timeline?start=0&end={far}&view=histogram"))
        assert 1 <= len(tl["counts"]) <= 720 and tl["bucket_ms"] % 86_400_000 == 0
        assert sum(tl["counts"]) == 4 and tl["start_ms"] + len(tl["counts"]) * tl["bucket_ms"] >= far
        top = json.loads(_get(url + "api/top?limit=1"))
        assert top["total"] == 4 and [r["name"] for r in top["rows"]] == ["hot"]



def test_address_with_a_non_ascii_digit_port_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flamed.cli import main

    trace = tmp_path / "t.trace"
    trace.write_text("# flamed trace\n1700000000.000000000 app-7;main 1\n")
    assert main(["serve", str(trace), "--address", "127.0.0.1:\u00b2"]) == 2
    assert "--address" in capsys.readouterr().err



@pytest.mark.parametrize("value", ["nan", "inf", "1e309", "-1"])
def test_cache_mb_out_of_range_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    """--cache-mb nan / inf was a traceback (int() of them); every value out of 0..1 TiB is refused by name."""
    from flamed.cli import main

    trace = tmp_path / "t.trace"
    trace.write_text("# flamed trace\n1700000000.000000000 app-7;main 1\n")
    assert main(["serve", str(trace), "--address", "127.0.0.1:0", "--cache-mb", value]) == 2
    assert "--cache-mb" in capsys.readouterr().err
