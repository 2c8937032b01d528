"""Every parser of untrusted input in flamed, as a fuzz :class:`~fuzzlib.Target`.

A target whose module has not landed (or whose entry point moved) is listed
with ``missing`` set, so the CI test skips it visibly instead of silently
dropping it.  bench/fuzz.py and tests/fuzz/test_fuzz_parsers.py both read
:func:`targets`.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from fuzzlib import Target

from flamed.model import Profile

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def _corpus(*globs: str, limit: int = 24, max_bytes: int = 16 << 10) -> list[bytes]:
    """Real captured inputs from tests/data (first ``max_bytes`` of each)."""
    out: list[bytes] = []
    for g in globs:
        for p in sorted(DATA.glob(g)):
            if p.is_file() and len(out) < limit:
                out.append(p.read_bytes()[:max_bytes])
    return out


# ---------------------------------------------------------------------------
# folded

FOLDED_SEEDS = [
    b"main;foo;bar 3\nmain;foo 1\n",
    b"python3;_start;main;PyEval_EvalFrameDefault;handle (app/views.py:12);read_[k] 7\r\n",
    b"# comment\n\nrust;core::array::<impl [u8: 32]>::fmt 1.5\n",
    b"java;Lfoo/Bar;::run;[unknown] (libc.so.6) 12\nno count here\n",
    b"a b c;d e 4\n a 1\n\t 2\n",
    b"std::vector<int, std::allocator<int> >::push_back(int const&) 3\n",
]
FOLDED_TOKENS = (b";", b" 1\n", b" 0\n", b" 1.25\n", b"[unknown]", b"_[k]", b"(a.py:1)", b"# x\n")


def _folded_roundtrip(data: bytes, result: Profile) -> None:
    from flamed.folded import read_folded, write_folded

    out = io.BytesIO()
    write_folded(result, out)
    again = read_folded(io.BytesIO(out.getvalue()), strict=True)
    assert again.stacks == result.stacks, "write(read(x)) does not read back as the same profile"
    for w in result.stacks.values():
        assert w == w and w >= 0 and w != float("inf"), f"weight {w!r} is not a finite count"


def _folded(data: bytes) -> Profile:
    from flamed.folded import read_folded

    return read_folded(io.BytesIO(data))


def _folded_strict(data: bytes) -> Profile:
    from flamed.folded import read_folded

    return read_folded(io.BytesIO(data), strict=True)


_SCRATCH = Path(os.environ.get("FLAMED_FUZZ_TMP", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))


def _via_file(fn: Callable[[str], object]) -> Callable[[bytes], object]:
    """Feed the bytes as a file path, the way the CLI gets them (gzip by magic included)."""

    def run(data: bytes) -> object:
        fd, path = tempfile.mkstemp(prefix="flamed-fuzz-", dir=_SCRATCH)
        try:
            os.write(fd, data)
            os.close(fd)
            fd = -1
            return fn(path)
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(path)

    return run


def _folded_file(path: str) -> Profile:
    from flamed.fileio import open_input
    from flamed.folded import read_folded

    with open_input(path) as f:
        return read_folded(f, source=path)


def _gz_seeds() -> list[bytes]:
    import gzip

    return [gzip.compress(s, mtime=0) for s in FOLDED_SEEDS[:3]]


# ---------------------------------------------------------------------------
# the control socket's request line (flamed/daemon/protocol.py)

PROTOCOL_SEEDS = [
    b'{"request": "status"}\n',
    b'{"request": "flush"}',
    b'{"request": "snapshot", "seconds": 30, "pid": 1234, "format": "folded"}',
    b'{"request": "snapshot", "next": 2.5, "tgid": [1, 2, 3], "tid": 7, "comm": "^python", "frames": "kernel"}',
    b'{"request": "snapshot", "frame": "read_\\[k\\]$", "exclude_frame": "idle", "root": "tid", "title": "t"}',
]
PROTOCOL_TOKENS = (
    b'"request"', b'"snapshot"', b'"status"', b'"seconds"', b'"next"', b'"pid"', b'"comm"', b'"frame"',
    b'"exclude_frame"', b'"frames"', b'"root"', b'"format"', b'"title"', b":", b",", b"1e999", b"-0.0",
    b'".*.*.*.*x"', b'"(a+)+$"', b'"(a|aa)*b"', b'"\\1"', b'"[a-z]*[a-y]*q"', b'"a{99999999999}"',
    b"[" * 50, b"NaN", b"true", b'"\\ud800"',
)
#: Frames a filter is matched against after acceptance: a long one, so an
#: accepted regex with exponential or high-degree polynomial cost shows as a hang.
_ADVERSARIAL_FRAMES = ("a" * 400 + "!", "x" * 200, "python3-1234/5678", "read_[k]")


def _protocol(data: bytes) -> object:
    from flamed.daemon.protocol import SnapshotFilter, parse_request

    req = parse_request(data, formats=["folded", "svg", "json"], max_next=60.0)
    if req.snapshot is not None:
        # Acceptance promises bounded cost: exercise the filter the daemon builds.
        f = SnapshotFilter(req.snapshot)
        for fr in _ADVERSARIAL_FRAMES:
            f.keep_task(1, 1, fr)
            f.stack((fr, "b", fr + "_[k]"))
    return req


def _protocol_target() -> Target:
    try:
        from flamed.daemon.protocol import ProtocolError
    except ImportError as e:
        return Target("socket-request", _protocol, [], missing=f"flamed.daemon.protocol not importable ({e})")
    return Target("socket-request", _protocol, PROTOCOL_SEEDS, PROTOCOL_TOKENS, clean=(ProtocolError,),
                  max_size=70 << 10)


def targets() -> list[Target]:
    ts = [
        Target("folded", _folded, FOLDED_SEEDS + _corpus("**/*.folded"), FOLDED_TOKENS, check=_folded_roundtrip),
        Target("folded-strict", _folded_strict, FOLDED_SEEDS, FOLDED_TOKENS),
        Target("folded-file+gzip", _via_file(_folded_file), FOLDED_SEEDS[:2] + _gz_seeds(), FOLDED_TOKENS),
        _protocol_target(),
    ]
    return ts


def by_name() -> dict[str, Target]:
    return {t.name: t for t in targets()}
