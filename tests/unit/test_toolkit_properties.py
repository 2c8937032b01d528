"""Property tests: read o write is identity, merge is associative and commutative,
parallel collapse equals serial, top/tree invariants."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flamed.collapse.driver import collapse
from flamed.collapse.trace import iter_trace
from flamed.folded import write_folded
from flamed.model import Profile, Sample, merge_streams, sanitize_frame
from flamed.outputs.jsontree import build_tree, write_tree
from flamed.outputs.trace import write_trace
from flamed.top import function_stats

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

frame_text = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"), blacklist_characters=";"), min_size=1, max_size=12
).filter(lambda f: f.strip() == f)
stacks = st.lists(frame_text, min_size=1, max_size=6).map(tuple).filter(lambda s: not s[0].startswith("#"))
profiles = st.dictionaries(stacks, st.integers(min_value=1, max_value=10**12), max_size=25).map(lambda d: Profile(stacks=d))


def read_back(tmp: Path, data: bytes, fmt: str, *, jobs: int = 1, chunk: int = 1 << 22) -> Profile:
    f = tmp / f"in.{fmt}"
    f.write_bytes(data)
    return collapse([str(f)], fmt=fmt, jobs=jobs, chunk_bytes=chunk).profile


@_SETTINGS
@given(p=profiles)
def test_folded_write_then_read_is_identity(tmp_path: Path, p: Profile) -> None:
    buf = io.BytesIO()
    write_folded(p, buf)
    assert read_back(tmp_path, buf.getvalue(), "folded").stacks == p.stacks


samples_st = st.lists(
    st.tuples(st.integers(min_value=0, max_value=2 * 10**18), stacks, st.integers(min_value=1, max_value=1000)),
    max_size=30,
).map(lambda xs: [Sample(time_ns=t, stack=s, weight=w) for t, s, w in sorted(xs, key=lambda x: x[0])])


@_SETTINGS
@given(samples=samples_st, style=st.sampled_from(["ns", "seconds"]))
def test_trace_write_then_read_is_identity(samples: list[Sample], style: str) -> None:
    buf = io.BytesIO()
    write_trace(samples, buf, time_format=style)
    buf.seek(0)
    back = [(s.time_ns, s.stack, s.weight) for s in iter_trace(buf, source="t")]
    assert back == [(s.time_ns, s.stack, s.weight) for s in samples]


@_SETTINGS
@given(a=profiles, b=profiles, c=profiles)
def test_profile_merge_associative_commutative(a: Profile, b: Profile, c: Profile) -> None:
    assert a.merged(b).stacks == b.merged(a).stacks
    assert a.merged(b).merged(c).stacks == a.merged(b.merged(c)).stacks


def _key(s: Sample) -> tuple[object, ...]:
    return (s.time_ns, s.stack, s.weight)


@_SETTINGS
@given(a=samples_st, b=samples_st, c=samples_st)
def test_stream_merge_associative_commutative(a: list[Sample], b: list[Sample], c: list[Sample]) -> None:
    left = list(merge_streams([list(merge_streams([a, b])), c]))
    right = list(merge_streams([a, list(merge_streams([b, c]))]))
    assert [_key(s) for s in left] == [_key(s) for s in right]  # exactly, ties included
    ab = [_key(s) for s in merge_streams([a, b])]
    ba = [_key(s) for s in merge_streams([b, a])]
    assert sorted(ab, key=repr) == sorted(ba, key=repr)
    assert [k[0] for k in ab] == sorted(k[0] for k in ab)


@_SETTINGS
@given(a=profiles, b=profiles)
def test_cli_merge_folded_commutative(tmp_path: Path, a: Profile, b: Profile) -> None:
    from flamed.cli import main

    fa, fb = tmp_path / "a.folded", tmp_path / "b.folded"
    for p, f in ((a, fa), (b, fb)):
        buf = io.BytesIO()
        write_folded(p, buf)
        f.write_bytes(buf.getvalue())
    outs = []
    for order in ((fa, fb), (fb, fa)):
        o = tmp_path / "o.folded"
        assert main(["merge", "--keep-ids", "--jobs", "1", "--format", "folded", *map(str, order), "-o", str(o)], stderr=io.StringIO()) == 0
        outs.append(o.read_bytes())
    assert outs[0] == outs[1]


comm_st = st.text(st.sampled_from("abcxyz_-/ 0123456789"), min_size=1, max_size=14).map(str.strip).filter(
    lambda c: c != "" and not c.startswith("#")
)
sym_st = st.text(st.sampled_from("abf_:<>,()[]; \"'0123456789"), min_size=1, max_size=14).map(str.strip).filter(
    lambda s: s != "" and s != "[unknown]"
)
perf_samples = st.lists(
    st.tuples(comm_st, st.integers(1, 4_000_000), st.lists(sym_st, min_size=0, max_size=5), st.integers(1, 10**7)),
    min_size=1,
    max_size=25,
)


def perf_text(samples: list[tuple[str, int, list[str], int]]) -> tuple[bytes, dict[tuple[str, ...], int]]:
    out: list[str] = []
    want: dict[tuple[str, ...], int] = {}
    for i, (comm, tid, syms, period) in enumerate(samples):
        out.append(f"{comm} {tid:>6} [001] {100 + i}.{i:06d}: {period:>10} cpu-clock:ppp: ")
        for j, sym in enumerate(reversed(syms)):
            out.append(f"\t{0x4000 + j:16x} {sym}+0x{j:x} (/usr/lib/lib dir (x)/libz.so)")
        out.append("")
        key = (sanitize_frame(comm), *(sanitize_frame(s) for s in syms)) if syms else (sanitize_frame(comm), "[no frames]")
        want[key] = want.get(key, 0) + period
    return ("\n".join(out) + "\n").encode(), want


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=perf_samples, chunk=st.sampled_from([64, 300, 4096]))
def test_parallel_collapse_equals_serial_and_truth(tmp_path: Path, samples: list[tuple[str, int, list[str], int]], chunk: int) -> None:
    data, want = perf_text(samples)
    serial = read_back(tmp_path, data, "perf")
    parallel = read_back(tmp_path, data, "perf", jobs=2, chunk=chunk)
    assert serial.stacks == want
    assert parallel.stacks == serial.stacks


@_SETTINGS
@given(p=profiles)
def test_top_and_tree_invariants(p: Profile) -> None:
    total = sum(p.stacks.values())
    stats = function_stats(p)
    assert sum(s.self_weight for s in stats) == total
    assert all(s.self_weight <= s.total_weight <= total for s in stats)
    buf = io.BytesIO()
    write_tree(build_tree(p), buf)
    tree = json.loads(buf.getvalue())
    assert tree["value"] == total
    todo = [tree]
    while todo:
        node = todo.pop()
        assert node["value"] >= sum(c["value"] for c in node["children"])
        names = [c["name"] for c in node["children"]]
        assert names == sorted(names)
        todo.extend(node["children"])


def test_recursion_counted_once_in_total() -> None:
    p = Profile(stacks={("main", "fib", "fib", "fib"): 3, ("main", "fib"): 1, ("main", "other"): 2})
    by = {s.name: s for s in function_stats(p)}
    assert (by["fib"].self_weight, by["fib"].total_weight) == (4, 4)
    assert (by["main"].self_weight, by["main"].total_weight) == (0, 6)

