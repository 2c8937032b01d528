"""``flamed serve`` over a state directory that holds what no daemon wrote:
files and sidecars that cannot be placed, a FIFO, far-off dates, files
without sidecars; and a heatmap of a long range, a name table past the
cache's bound, methods and addresses the server must answer.  Nothing a
file holds may stop the server or its live refresh."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.serve import index as index_mod  # noqa: E402
from flamed.serve.index import Entry, Index, Trace  # noqa: E402
from serveproc import serve_process  # noqa: E402
from servedata import NS, T0, write_state_dir  # noqa: E402


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _hostile_dir(state: Path) -> None:
    write_state_dir(state, 4)
    (state / "testhost-20240231T000000Z.folded").write_text("a;b 1\n")  # February 31
    bad = state / "testhost-20231114T230000Z.folded"
    bad.write_text("a;b 1\n")
    (state / "testhost-20231114T230000Z.json").write_text("[]")  # valid JSON, not an object
    (state / "testhost-99991231T235959Z.folded").write_text("a;b 1\n")  # past what int64 ns holds
    nan = state / "testhost-20231114T231000Z.folded"
    nan.write_text("a;b 1\n")
    (state / "testhost-20231114T231000Z.json").write_text('{"weight": NaN, "start_ns": "x"}')
    os.mkfifo(state / "testhost-20231114T232000Z.folded")  # a reader would wait for ever


def test_a_hostile_state_directory_is_indexed_around(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _hostile_dir(state)
    idx = Index.from_state_dir(str(state))
    names = {e.name for e in idx.entries}
    assert "testhost-20231114T230000Z.folded" in names  # placed by its name: its sidecar says nothing
    assert idx.skipped == {
        "testhost-20240231T000000Z.folded": "its name's time 20240231T000000Z is no date, and no sidecar gives one",
        "testhost-99991231T235959Z.folded": "its time (99991231T235959Z) is outside the times flamed places "
                                            "(1970 to 2262)",
        "testhost-20231114T232000Z.folded": "not a regular file",
    }
    nan_entry = next(e for e in idx.entries if e.name == "testhost-20231114T231000Z.folded")
    assert nan_entry.weight == 0
    summary = idx.summary()
    json.dumps(summary, allow_nan=False)  # what the page reads: NaN is no JSON
    assert summary["end_ms"] <= (2**63 - 1) // 1_000_000
    # every range, the whole one included, answers (the FIFO is not opened)
    p = idx.profile(idx.start_ns, idx.end_ns)
    assert sum(p.stacks.values()) > 0


def test_serve_starts_and_refreshes_past_bad_files(tmp_path: Path) -> None:
    """One bad file stopped the server from starting (a traceback); added while
    serving, it made the refresh fail for good (no later file appeared)."""
    state = tmp_path / "state"
    write_state_dir(state, 4)
    _hostile_dir(tmp_path / "hostile")
    bad = sorted(p for p in (tmp_path / "hostile").iterdir() if "2023111" not in p.name or "T23" in p.name)
    for p in bad:  # the hostile files only
        if p.is_fifo():
            os.mkfifo(state / p.name)
        elif not (state / p.name).exists():
            (state / p.name).write_bytes(p.read_bytes())
    with serve_process("--state-dir", str(state), "--timeout", "5") as (url, proc):
        code, body = _get(url + "api/index")
        assert code == 200
        idx = json.loads(body)
        assert "not a regular file" in idx["skipped"].values()
        code, _ = _get(url + f"api/timeline?start={idx['start_ms']}&end={idx['end_ms']}")
        assert code == 200  # a year-9999 file once made every range past int64 a 400
        for _ in range(2):  # twice: the first look may have seen the directory unchanged
            code, body = _get(url + f"api/profile?start={idx['start_ms']}&end={idx['end_ms']}&format=folded")
            assert code == 200, body
        # added while serving: a bad name, then a good file; the good one appears
        (state / "testhost-20230229T000000Z.folded").write_text("x;y 1\n")
        time.sleep(1.2)
        assert _get(url + "api/index")[0] == 200
        write_state_dir(tmp_path / "later", 1, t0=T0 + 3600 * NS)
        for p in (tmp_path / "later").iterdir():
            os.replace(p, state / p.name)
        deadline = time.monotonic() + 15
        files = idx["files"]
        while time.monotonic() < deadline:
            time.sleep(1.1)
            now = json.loads(_get(url + "api/index")[1])
            if now["files"] > files:
                break
        assert now["files"] == files + 1, now
        assert "testhost-20230229T000000Z.folded" in now["skipped"]
    err = proc.stderr.read() if proc.stderr else ""
    assert "Traceback" not in err
    assert "left out: " in err and "not a regular file" in err


def test_a_file_without_sidecar_weighs_what_it_holds(tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state_dir(state, 3)
    for j in state.glob("*.json"):
        j.unlink()
    idx = Index.from_state_dir(str(state))
    for e in idx.entries:
        assert e.weight == 60 * (97 + 3), e  # its bar has a height (it was 0)


def test_a_heatmap_of_a_long_range_covers_all_of_it() -> None:
    """More columns than a heatmap holds: wider columns, never the range's start only."""
    entries = [Entry(f"f{i}", f"f{i}", T0 + i * 3600 * NS, T0 + i * 3600 * NS + 60 * NS, 10,
                     windows=[(T0 + i * 3600 * NS, T0 + i * 3600 * NS + NS, 10)]) for i in range(24 * 7)]
    idx = Index(entries, Trace(), kind="store", source="x")
    start, end = T0, T0 + 24 * 7 * 3600 * NS  # a week of 1-minute columns is 10,080 > 4,000
    t = idx.timeline(start, end, view="heatmap")
    assert t["cols"] <= index_mod.HEATMAP_COLS
    assert t["start_ms"] + t["cols"] * t["col_ms"] >= end // 1_000_000
    assert sum(sum(col) for col in t["cells"]) == 10 * 24 * 7  # every file's weight is in it
    assert t["col_ms"] % 60_000 == 0  # whole multiples of the layout's minute


def test_a_name_table_past_the_cache_bound_is_not_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state_dir(state, 1)
    f = next(state.glob("*.folded"))
    f.write_text("".join(f"svc;mod{i}.function_number_{i};leaf_{i} 1\n" for i in range(20_000)))
    (state / (f.stem + ".json")).unlink()
    idx = Index.from_state_dir(str(state), cache_bytes=256 << 10)
    p = idx.profile(idx.start_ns, idx.end_ns)
    assert len(p.stacks) == 20_000
    st = idx.status()
    assert st["cache_bytes"] <= st["cache_limit_bytes"], st  # the table alone was 10x over


def _raw(host: str, port: int, request: bytes) -> bytes:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(10)
        s.connect((host, port))
        s.sendall(request)
        return s.recv(4096)


def test_every_other_method_gets_405_and_an_ipv6_loopback_serves(tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state_dir(state, 1)
    with serve_process("--state-dir", str(state)) as (url, _proc):
        port = int(url.rsplit(":", 1)[1].strip("/"))
        for method in (b"OPTIONS", b"TRACE", b"CONNECT", b"FROB", b"POST"):
            reply = _raw("127.0.0.1", port, method + b" / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert reply.startswith(b"HTTP/1.0 405") and b"Allow: GET, HEAD" in reply, (method, reply[:200])
    try:
        socket.socket(socket.AF_INET6).close()
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "flamed", "serve", "--state-dir", str(state), "--address", "[::1]:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("flamed serve: http://[::1]:"), (line, proc.stderr.read() if proc.stderr else "")
        port = int(line.split()[2].rsplit(":", 1)[1].strip("/"))
        reply = _raw("::1", port, b"GET /api/index HTTP/1.1\r\nHost: [::1]\r\n\r\n")
        assert reply.startswith(b"HTTP/1.0 200"), reply[:200]
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_file_retention_removed_since_the_listing_is_left_out_not_an_error(tmp_path: Path) -> None:
    """A range over a file deleted since the last listing was a 400 ('no such
    file') until the next look; now the file adds nothing and the next request
    lists the directory again."""
    state = tmp_path / "state"
    paths = write_state_dir(state, 3)
    idx = Index.from_state_dir(str(state))
    whole = sum(idx.profile(idx.start_ns, idx.end_ns).stacks.values())
    gone = paths[0]
    gone.unlink()
    (state / (gone.stem + ".json")).unlink()
    idx._cache.clear()  # as if the range had not been read before  # noqa: SLF001
    assert sum(idx.profile(idx.start_ns, idx.end_ns).stacks.values()) == whole * 2 // 3
    # the directory changed since the index's listing: the next look lists it again
    assert idx.refresh() and len(idx.entries) == 2
