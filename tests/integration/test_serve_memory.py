"""``flamed serve``'s memory and its parsed-file cache on a store of many busy files (issue 22 item 12).

The store is written by the daemon's own store code (tests/servedata.py),
files of about 700 KB of folded text each, as a busy host's.  The server is
a real process: its peak RSS is read from /proc after 20 ranges, and the
files it parsed from ``/api/status`` (a count, not a wall time).
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path

import pytest

from servedata import T0, write_busy_state_dir
from serveproc import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]
T0_MS = T0 // 1_000_000
FILES = 150  # past the 96 parsed files the cache used to keep


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=300) as r:
        return r.read()  # type: ignore[no-any-return]


def _status(url: str) -> dict[str, int]:
    return json.loads(_get(url + "api/status"))  # type: ignore[no-any-return]


def _hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def _ask(url: str, lo_min: int, hi_min: int) -> None:
    """The page's requests for a range: graph and top table."""
    q = f"start={T0_MS + lo_min * 60_000}&end={T0_MS + hi_min * 60_000}"
    _get(f"{url}api/profile?{q}&format=svg&minwidth=0.5")
    _get(f"{url}api/top?{q}")


def _twenty_ranges() -> list[tuple[int, int]]:
    rng = random.Random(7)
    spans = [1, 5, 15, 60, FILES] * 4
    out = []
    for span in spans:
        first = rng.randint(0, FILES - span)
        out.append((first, first + span))
    return out


@pytest.fixture(scope="module")
def busy_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("busy") / "state"
    write_busy_state_dir(state, FILES)
    return state


def test_serve_memory_is_bounded_and_a_repeat_parses_nothing(busy_store: Path) -> None:
    with serve_process("--state-dir", str(busy_store)) as (url, proc):
        _get(url + "api/timeline")
        for lo, hi in _twenty_ranges():
            _ask(url, lo, hi)
        st = _status(url)
        hwm = _hwm_mb(proc.pid)
        # Every file read once: the whole store (150 files, 100 MB of text) fits the default cache.
        assert st["parses"] == FILES, st
        assert st["cache_files"] == FILES and st["cache_bytes"] <= st["cache_limit_bytes"], st
        # The whole range again: served from the cache, no file parsed.
        _ask(url, 0, FILES)
        assert _status(url)["parses"] == FILES
        # 96 parsed profiles used to take ~270 MB here; the compact forms take ~25 MB.
        assert hwm <= 150, f"peak RSS {hwm:.0f} MB after 20 ranges over {FILES} files"


def test_serve_cache_bound_is_bytes_and_configurable(busy_store: Path) -> None:
    with serve_process("--state-dir", str(busy_store), "--cache-mb", "4") as (url, proc):
        for lo, hi in _twenty_ranges()[:10]:
            _ask(url, lo, hi)
        st = _status(url)
        assert st["cache_limit_bytes"] == 4 * 2**20
        assert 0 < st["cache_bytes"] <= 4 * 2**20, st
        assert 0 < st["cache_files"] < FILES, st
        # A range within the bound is parsed once however often it is asked for.
        _ask(url, 10, 12)
        n = _status(url)["parses"]
        _ask(url, 10, 12)
        assert _status(url)["parses"] == n
        assert _hwm_mb(proc.pid) <= 150
