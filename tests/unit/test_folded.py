from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flamed.errors import FlamedError, InputError
from flamed.folded import ReadStats, read_folded, write_folded
from flamed.model import Profile


def rd(data: bytes, **kw: object) -> Profile:
    return read_folded(io.BytesIO(data), **kw)  # type: ignore[arg-type]


def wr(p: Profile) -> bytes:
    b = io.BytesIO()
    write_folded(p, b)
    return b.getvalue()


def test_hostile_frames_and_counts() -> None:
    data = (
        b"main;std::vector<int, std::allocator<int> >::push_back(int const&) 3\r\n"
        b"\n# a comment\n"
        b"python;handle (app/views.py:12);json.dumps (json/__init__.py:231) 2\n"
        b"rust;core::array::<impl [u8: 32]>::fmt 1.5\n"
        b"a;b 1\n"
        b"a;b 4\n"
        b"bad\xffname;leaf 7\n"
        b"a\tb\t9\n"
    )
    p = rd(data)
    assert p.stacks[("a", "b")] == 5
    assert p.stacks[("rust", "core::array::<impl [u8: 32]>::fmt")] == 1.5
    assert p.stacks[("main", "std::vector<int, std::allocator<int> >::push_back(int const&)")] == 3
    assert p.stacks[("a\tb",)] == 9
    out = wr(p)
    assert b"bad\xffname;leaf 7\n" in out  # invalid UTF-8 kept byte-exact
    assert wr(rd(out)) == out


def test_malformed_lines_counted_or_fatal() -> None:
    stats = ReadStats()
    p = rd(b"a;b 1\nno count here\nc 2\n", source="x.folded", stats=stats)
    assert p.total() == 3
    assert stats.skipped == 1
    assert stats.first_errors[0].startswith("x.folded:2:")
    with pytest.raises(InputError, match="x.folded:2"):
        rd(b"a;b 1\nno count here\n", source="x.folded", strict=True)


def test_gzip_by_magic(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from flamed.fileio import open_input

    f = tmp_path / "p.txt"
    f.write_bytes(gzip.compress(b"a;b 2\n"))
    with open_input(f) as s:
        assert read_folded(s).stacks == {("a", "b"): 2}



def test_closing_a_gzip_input_closes_its_file(tmp_path: Path) -> None:
    """GzipFile closes only a file it opened: the file open_input opened under
    it stayed open after close() (one descriptor per .gz input of a merge or
    a serve parse, until the collector; a ResourceWarning)."""
    import os
    import warnings

    from flamed.fileio import open_input

    f = tmp_path / "p.folded.gz"
    f.write_bytes(gzip.compress(b"a;b 2\n"))

    def open_fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}")}

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        s = open_input(f)
        assert str(f) in open_fds()
        assert read_folded(s).stacks == {("a", "b"): 2}
        s.close()
        assert str(f) not in open_fds()


frames = st.text(
    alphabet=st.characters(blacklist_characters=";\r\n", blacklist_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda s: s.strip() == s and not s.startswith("#"))
stacks = st.lists(frames, min_size=1, max_size=6).map(tuple)
profiles = st.dictionaries(stacks, st.integers(min_value=1, max_value=10**9), max_size=30)


@settings(max_examples=200)
@given(profiles)
def test_read_write_identity(d: dict) -> None:  # type: ignore[type-arg]
    p = Profile(stacks=dict(d))
    assert rd(wr(p)).stacks == p.stacks
    assert wr(rd(wr(p))) == wr(p)


@settings(max_examples=100)
@given(profiles, profiles, profiles)
def test_merge_associative_commutative(a: dict, b: dict, c: dict) -> None:  # type: ignore[type-arg]
    pa, pb, pc = Profile(stacks=a), Profile(stacks=b), Profile(stacks=c)
    assert wr(pa.merged(pb).merged(pc)) == wr(pa.merged(pb.merged(pc)))
    assert wr(pa.merged(pb)) == wr(pb.merged(pa))


def test_summed_counts_past_int64_are_refused_where_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two lines that each fit sum to a count the reader refuses: writing it is an error, not a file
    flamed cannot read back; what is written is read back whole."""
    from flamed.cli import main
    from flamed.folded import MAX_COUNT, folded_line

    src = tmp_path / "big.folded"
    src.write_bytes(b"a;b 9000000000000000000\na;c 9000000000000000000\na;b 9000000000000000000\n")
    for cmd in (["collapse"], ["merge"], ["export", "--format", "folded"]):
        out = tmp_path / "big2.folded"
        assert main([*cmd, str(src), "-o", str(out)]) == 1, cmd
        err = capsys.readouterr().err
        assert "'a;b' weighs 18000000000000000000" in err and str(MAX_COUNT) in err, err
        assert not out.exists()
    # At the limit: written, and read back as written.
    edge = tmp_path / "edge.folded"
    edge.write_bytes(b"a;b 9223372036854775000\na;b 807\na;c 1\n")
    back = tmp_path / "back.folded"
    assert main(["collapse", str(edge), "-o", str(back)]) == 0
    assert back.read_bytes() == b"a;b 9223372036854775807\na;c 1\n"
    assert read_folded(io.BytesIO(back.read_bytes())).stacks == {("a", "b"): MAX_COUNT, ("a", "c"): 1}
    with pytest.raises(FlamedError):
        folded_line(("a",), MAX_COUNT + 1)
    with pytest.raises(FlamedError):
        folded_line(("a",), float(MAX_COUNT) * 2)


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("cmd", [["collapse"], ["merge"], ["top"], ["svg"], ["svg", "-j", "2"], ["tree"]])
def test_bad_counts_say_what_is_wrong_with_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                cmd: list[str], strict: bool) -> None:
    """A negative or too-large count said only "expected 'frame;frame;... COUNT'", and
    input whose counts were all negative "cannot tell the input format": each says
    what is wrong with the count, on which line, in every reader of folded text."""
    from flamed.cli import main

    cases = [
        (b"a;b 3\na;c -5\n", "neg.folded:2: count -5 is negative: a count of samples is 0 or more"),
        (b"a;b -3\na;c -5\n", "allneg.folded:1: count -3 is negative: a count of samples is 0 or more"),
        (b"a;b 3\n\na;c 99999999999999999999\n",
         "big.folded:3: count 99999999999999999999 is over the int64 maximum (9223372036854775807)"),
        (b"a;b 3\na;d 4\na;c 1.5e400\n", "bad.folded:3: expected 'frame;frame;... COUNT'"),  # not a count
    ]
    for (data, want), name in zip(cases, ("neg", "allneg", "big", "bad")):
        src = tmp_path / f"{name}.folded"
        src.write_bytes(data)
        out = tmp_path / "out.data"
        rc = main([*cmd, *(["--strict"] if strict else []), str(src), "-o", str(out)])
        err = capsys.readouterr().err
        assert want in err, (cmd, name, err)
        assert "cannot tell the input format" not in err and "Traceback" not in err
        assert rc == (1 if strict else 0), (cmd, name, err)
        if not strict:
            assert "skipped 1 malformed line" in err or "skipped 2 malformed lines" in err, err
        out.unlink(missing_ok=True)
