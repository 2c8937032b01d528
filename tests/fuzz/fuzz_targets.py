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


# ---------------------------------------------------------------------------
# collapse formats (flamed/collapse/): perf script, bcc, py-spy raw, timestamped traces


def _gz_corpus(*globs: str, limit: int = 12, max_bytes: int = 12 << 10) -> list[bytes]:
    import gzip

    out: list[bytes] = []
    for g in globs:
        for p in sorted(DATA.glob(g)):
            if len(out) >= limit:
                break
            raw = p.read_bytes()
            try:
                raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
            except (OSError, EOFError):
                continue
            cut = raw[:max_bytes]
            out.append(cut[: cut.rfind(b"\n\n") + 2] if b"\n\n" in cut else cut)
    return out


COLLAPSE_SEEDS: dict[str, list[bytes]] = {
    "perf": [
        b"python3 1234/1240 [001] 12345.678901:   10101010 cpu-clock:ppp: \n"
        b"\t    7f00deadbeef PyEval_EvalFrameDefault+0x1a (/usr/lib/libpython3.11.so)\n"
        b"\tffffffff81000000 do_syscall_64+0x3b ([kernel.kallsyms])\n\n",
        b"dd 99 [000] 1.000001: 1 cycles: \n\t aaa main (/bin/dd)\n\t bbb [unknown] ([unknown])\n\n",
    ],
    "bcc": [
        b"    read\n    main\n    -                python3 (1234)\n        7\n\n",
        b"python3;main;read_[k] 3\n",
    ],
    "pyspy": [
        b"process 1234:\"python3 app.py\";<module> (app.py:1);work (app.py:5) 12\n",
        b"thread (0x7f00): \"MainThread\";run (t.py:3) 2\n",
    ],
    "trace": [
        b"1700000000000000000 main;foo;bar 1\n1700000000000001000 main;foo 2\n",
        b"1700000000.000001 a;b\n1700000000.5 a;c 3\n",
    ],
    "folded": [b"a;b 1\nc 2\n"],
}
COLLAPSE_TOKENS = (b"\n\n", b"\t", b" [001] ", b": ", b"cpu-clock:", b"cycles:", b"(/usr/lib/x.so)", b"+0x1a",
                   b"[kernel.kallsyms]", b"-- ", b"process ", b"thread (", b"1700000000000000000 ", b"-1 ")


def _collapse_target(name: str, *, strict: bool = False, timed: bool = False) -> Target:
    label = f"collapse-{name}" + ("-strict" if strict else "") + ("-samples" if timed else "")
    try:
        from flamed.collapse import CollapseOptions, get

        c = get(name)
    except Exception as e:  # noqa: BLE001 - not landed or renamed
        return Target(label, lambda b: None, [], missing=f"flamed.collapse {name!r} unavailable ({e})")
    opts = CollapseOptions(strict=strict)

    def parse(data: bytes) -> object:
        if timed:
            return sum(1 for _ in c.samples(io.BytesIO(data), opts, source="<fuzz>"))
        return c.parser(opts).parse(data, source="<fuzz>", first_line=1)

    seeds = COLLAPSE_SEEDS.get(name, []) + _gz_corpus(f"{name}/*")
    return Target(label, parse, seeds, COLLAPSE_TOKENS + FOLDED_TOKENS)


def _collapse_auto(path: str) -> object:
    from flamed.collapse.driver import read_profile

    return read_profile([path])


def _load_profile(path: str) -> object:
    from flamed.inputs import load_profile

    return load_profile([path])


def _count_folded(data: bytes) -> object:
    from flamed.fastfolded import count_folded

    return count_folded(io.BytesIO(data))


def _fast_equals_reference(data: bytes, result: dict[bytes, object]) -> None:
    """The fast folded counter must agree with the reference reader, stack for stack."""
    from flamed.folded import read_folded

    ref = read_folded(io.BytesIO(data))
    fast = {tuple(k.decode("utf-8", "surrogateescape").split(";")): v for k, v in result.items()}
    assert fast == ref.stacks, "fastfolded.count_folded and folded.read_folded disagree"


# ---------------------------------------------------------------------------
# pprof and speedscope readers (flamed/outputs/)


def _writer_seeds(fmt: str) -> list[bytes]:
    try:
        from flamed import outputs

        w = outputs.get(fmt)
    except Exception:  # noqa: BLE001
        return []
    out: list[bytes] = []
    for stacks in ({("main", "foo", "read_[k]"): 3, ("main", "bar (x.py:3)"): 2},
                   {("a",): 1}, {("m", "n", "o", "p"): 7, ("m", "q"): 1.5}):
        prof = Profile(stacks=dict(stacks), start_ns=1_700_000_000_000_000_000, end_ns=1_700_000_001_000_000_000,
                       sample_rate=99.0, labels={"host": "h"})
        buf = io.BytesIO()
        try:
            w.write(prof, buf)
        except Exception:  # noqa: BLE001 - a writer bug is not what this seeds
            continue
        out.append(buf.getvalue())
    return out


def _pprof(data: bytes) -> object:
    from flamed.outputs.pprof import read_pprof

    return read_pprof(data, source="<fuzz>")


def _speedscope(data: bytes) -> object:
    from flamed.outputs.speedscope import read_speedscope

    return read_speedscope(data, source="<fuzz>")


def _pprof_seeds() -> list[bytes]:
    import gzip

    seeds = _writer_seeds("pprof")
    # The raw protobuf as well as the gzipped form: mutations then hit the decoder, not zlib.
    raw = []
    for s in seeds:
        try:
            raw.append(gzip.decompress(s))
        except (OSError, EOFError):
            pass
    return seeds + raw


def _reader_target(label: str, module: str, fn: Callable[[bytes], object], seeds: Callable[[], list[bytes]],
                   tokens: tuple[bytes, ...]) -> Target:
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001
        return Target(label, fn, [], missing=f"{module} not importable ({e})")
    return Target(label, fn, seeds(), tokens)


SPEEDSCOPE_TOKENS = (b'"$schema"', b'"shared"', b'"frames"', b'"profiles"', b'"type"', b'"sampled"', b'"evented"',
                     b'"samples"', b'"weights"', b'"events"', b'"at"', b'"O"', b'"C"', b'"frame"', b'"startValue"',
                     b'"endValue"', b'"unit"', b'-1', b'1e308', b'[[[[[[[[[[', b'99999999999')
PPROF_TOKENS = (b"\x08", b"\x10", b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x32", b"\xff\xff\xff\xff\x0f",
                b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x00")


# ---------------------------------------------------------------------------
# py-spy chrometrace (mixed mode's reader, flamed/pyspy/chrometrace.py)

CHROMETRACE_SEEDS = [
    b'[{"args":{},"cat":"py-spy","name":"work (app.py:5)","ph":"B","pid":1,"tid":7,"ts":1000},'
    b'{"args":{},"cat":"py-spy","name":"work (app.py:5)","ph":"E","pid":1,"tid":7,"ts":2000}]',
    b'{"traceEvents":[{"name":"thread (123): MainThread","ph":"B","pid":1,"tid":7,"ts":0}]}',
]


def _chrometrace(data: bytes) -> object:
    from flamed.pyspy.chrometrace import parse_chrometrace

    return parse_chrometrace(data, source="<fuzz>")


def targets() -> list[Target]:
    ts = [
        Target("folded", _folded, FOLDED_SEEDS + _corpus("**/*.folded"), FOLDED_TOKENS, check=_folded_roundtrip),
        Target("folded-strict", _folded_strict, FOLDED_SEEDS, FOLDED_TOKENS),
        Target("folded-file+gzip", _via_file(_folded_file), FOLDED_SEEDS[:2] + _gz_seeds(), FOLDED_TOKENS),
        _protocol_target(),
    ]
    for name in ("perf", "bcc", "pyspy", "trace", "folded"):
        ts.append(_collapse_target(name))
    ts.append(_collapse_target("perf", strict=True))
    ts.append(_collapse_target("trace", timed=True))
    ts.append(_collapse_target("perf", timed=True))
    auto_seeds = [s for v in COLLAPSE_SEEDS.values() for s in v] + _gz_seeds()
    ts.append(Target("collapse-auto-file", _via_file(_collapse_auto), auto_seeds, COLLAPSE_TOKENS))
    ts.append(_reader_target("fastfolded", "flamed.fastfolded", _count_folded, lambda: FOLDED_SEEDS, FOLDED_TOKENS))
    ts[-1].check = _fast_equals_reference if not ts[-1].missing else None
    ts.append(_reader_target("pprof-reader", "flamed.outputs.pprof", _pprof, _pprof_seeds, PPROF_TOKENS))
    ts.append(_reader_target("speedscope-reader", "flamed.outputs.speedscope", _speedscope,
                             lambda: _writer_seeds("speedscope"), SPEEDSCOPE_TOKENS))
    load_seeds = auto_seeds + _writer_seeds("pprof") + _writer_seeds("speedscope")
    ts.append(_reader_target("load-profile-file", "flamed.inputs", _via_file(_load_profile), lambda: load_seeds,
                             COLLAPSE_TOKENS + SPEEDSCOPE_TOKENS))
    ts.append(_reader_target("pyspy-chrometrace", "flamed.pyspy.chrometrace", _chrometrace, lambda: CHROMETRACE_SEEDS,
                             SPEEDSCOPE_TOKENS + (b'"ph"', b'"B"', b'"E"', b'"ts"', b'"tid"', b'"traceEvents"')))
    return ts


def by_name() -> dict[str, Target]:
    return {t.name: t for t in targets()}
