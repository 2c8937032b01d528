"""`flamed push` against a local HTTP server that answers a script: what is
retried, what is given up, and when the later files are not tried."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from flamed.cli import main

NS = 1_000_000_000


class Scripted:
    """Answers each POST with the next status of ``statuses`` (200 once they run out)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.seen: list[tuple[int, int]] = []  # (from= of the request, in s; status answered)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status = outer.statuses.pop(0) if outer.statuses else 200
                outer.seen.append((int(parse_qs(urlsplit(self.path).query)["from"][0]), status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waited: list[float] = []
    monkeypatch.setattr("flamed.commands.push.time.sleep", waited.append)
    return waited


@pytest.fixture
def server() -> Iterator[Scripted]:
    s = Scripted([])
    try:
        yield s
    finally:
        s.close()


def rotated(tmp_path: Path, n: int) -> list[str]:
    """``n`` rotated files with their sidecars, one second apart, oldest first."""
    paths = []
    for i in range(n):
        stem = tmp_path / f"host-2026120{i}T000000Z"
        (stem.parent / (stem.name + ".folded")).write_text(f"app-1/1;main;f{i} 3\n")
        (stem.parent / (stem.name + ".json")).write_text(json.dumps(
            {"start_ns": (i + 1) * NS, "end_ns": (i + 2) * NS, "sample_rate": 99, "host": "h"}))
        paths.append(str(stem) + ".folded")
    return paths


def push(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    config = tmp_path / "flamed.toml"  # no [pyroscope] table: the command line and the defaults
    config.touch()
    out, err = io.StringIO(), io.StringIO()
    rc = main(["push", "--config", str(config), *args], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_a_5xx_is_retried_a_4xx_is_not_and_the_later_files_still_go(tmp_path: Path, server: Scripted,
                                                                   sleeps: list[float]) -> None:
    paths = rotated(tmp_path, 3)
    server.statuses = [503, 503, 200, 400]  # file 0: two retries; file 1: refused for good
    rc, out, err = push(tmp_path, "--server", server.url, "--retries", "2", *paths)
    assert rc == 1, err
    assert server.seen == [(1, 503), (1, 503), (1, 200), (2, 400), (3, 200)]  # from= in seconds
    assert sleeps == [1.0, 2.0]
    assert f"{paths[0]}: sent" in out and f"{paths[2]}: sent" in out and paths[1] not in out
    assert f"{paths[1]}: {server.url}/ingest answered 400" in err and "1 of 3 files not sent" in err
    assert "not tried" not in err  # the server answered: the files after it were tried


def test_retries_zero_and_the_retry_budget(tmp_path: Path, server: Scripted, sleeps: list[float]) -> None:
    paths = rotated(tmp_path, 1)
    server.statuses = [500, 500, 500, 500, 500]
    rc, _out, err = push(tmp_path, "--server", server.url, "--retries", "0", *paths)
    assert rc == 1 and len(server.seen) == 1 and sleeps == [], err
    rc, _out, err = push(tmp_path, "--server", server.url, *paths)  # default: 3 retries, 1, 2, 4 s apart
    assert rc == 1 and len(server.seen) == 1 + 4 and sleeps == [1.0, 2.0, 4.0], err


def test_no_answer_leaves_the_later_files_untried_and_says_how_many(tmp_path: Path, server: Scripted,
                                                                    sleeps: list[float]) -> None:
    paths = rotated(tmp_path, 4)
    url = server.url
    server.close()  # nobody listens there any more: connection refused
    rc, out, err = push(tmp_path, "--server", url, "--retries", "1", *reversed(paths))
    assert rc == 1 and out == "", err
    assert sleeps == [1.0]  # the oldest file's retry, then nothing more
    assert f"{paths[0]}: cannot send to {url}/ingest" in err, err
    assert f"the server did not answer: 3 later file(s) not tried (from {paths[1]})" in err, err
    assert "4 of 4 files not sent" in err, err


@pytest.mark.parametrize("bad", ["-1", "11", "two", "1.5"])
def test_retries_out_of_range_is_a_usage_error(tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = push(tmp_path, "--server", "http://127.0.0.1:9", "--retries", bad, *rotated(tmp_path, 1))
    assert rc == 2
    assert "argument --retries: expected a number of retries" in err + capsys.readouterr().err
