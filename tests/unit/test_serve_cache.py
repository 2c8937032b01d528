"""The parsed-file cache of ``flamed serve``'s index: bounded in bytes, compact, exact (issue 22 item 12)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.inputs import load_profile  # noqa: E402
from flamed.model import Profile  # noqa: E402
from flamed.serve.index import Compact, FrameTable, Index  # noqa: E402
from servedata import NS, T0, write_busy_state_dir  # noqa: E402

FILES = 12


def _store(tmp_path: Path) -> list[Path]:
    return write_busy_state_dir(tmp_path / "state", FILES, stacks_per_file=120, population=600, tower_depth=50,
                                functions=200)


def _plain(paths: list[Path]) -> dict[tuple[str, ...], float]:
    """The range the simple way: every file parsed and summed."""
    out = Profile()
    for p in paths:
        out.update(load_profile([str(p)]).stacks)
    return out.stacks


def test_compact_form_round_trips_and_is_smaller(tmp_path: Path) -> None:
    table = FrameTable()
    compact = parsed = 0
    for path in _store(tmp_path):
        p = load_profile([str(path)])
        c = Compact.of(p, table)
        assert c.profile().stacks == p.stacks
        compact += c.nbytes
        parsed += sum(sys.getsizeof(st) + sum(sys.getsizeof(f) for f in st) for st in p.stacks)
    # The names are stored once for all files, each file's stacks as 4 bytes a frame.
    assert compact + table.nbytes < parsed / 3, (compact, table.nbytes, parsed)


def test_ranges_are_exact_and_a_repeat_parses_nothing(tmp_path: Path) -> None:
    paths = _store(tmp_path)
    index = Index.from_state_dir(str(tmp_path / "state"))
    whole = index.profile(T0, T0 + FILES * 60 * NS)
    assert whole.stacks == _plain(paths)
    assert index.parses == FILES
    assert index.profile(T0, T0 + FILES * 60 * NS).stacks == whole.stacks
    assert index.parses == FILES
    st = index.status()
    assert st["cache_files"] == FILES and st["parses"] == FILES
    assert 0 < int(str(st["cache_bytes"])) <= int(str(st["cache_limit_bytes"]))


def test_cache_is_bounded_in_bytes(tmp_path: Path) -> None:
    paths = _store(tmp_path)
    full = Index.from_state_dir(str(tmp_path / "state"))
    full.profile(T0, T0 + FILES * 60 * NS)
    st = full.status()
    names = int(str(st["frame_bytes"]))
    per_file = (int(str(st["cache_bytes"])) - names) / FILES
    # Room for the names (under half the bound, or they are started anew) and
    # a few files: the last ones asked for stay, the first go.
    limit = int(2 * names + 3.5 * per_file)
    assert names + 3.5 * per_file < int(str(full.status()["cache_bytes"]))
    index = Index.from_state_dir(str(tmp_path / "state"), cache_bytes=limit)
    for i in range(FILES):
        index.profile(T0 + i * 60 * NS, T0 + (i + 1) * 60 * NS)
    st = index.status()
    assert 3 <= int(str(st["cache_files"])) < FILES, st
    assert int(str(st["cache_bytes"])) <= limit
    n = index.parses
    index.profile(T0 + (FILES - 1) * 60 * NS, T0 + FILES * 60 * NS)
    assert index.parses == n  # the newest is still there
    index.profile(T0, T0 + 60 * NS)
    assert index.parses == n + 1  # the oldest was dropped
    # Results stay exact through evictions and a frame table started anew.
    tiny = Index.from_state_dir(str(tmp_path / "state"), cache_bytes=1000)
    assert tiny.profile(T0, T0 + FILES * 60 * NS).stacks == _plain(paths)
    assert tiny.profile(T0, T0 + 3 * 60 * NS).stacks == _plain(paths[:3])
