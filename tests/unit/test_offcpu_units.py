"""Off-CPU and wall-clock profiles without BPF: the units each output states,
the folded microseconds of ``flamed record --mode``, and the drain's keeping
of stacks for waits that span a drain."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
from typing import Any

from flamed.commands.record import RecordCommand
from flamed.model import Profile, Stack, time_kind
from flamed.outputs import profile_pb2 as pb
from flamed.outputs.pprof import read_pprof, to_proto, write_pprof
from flamed.outputs.speedscope import to_document
from flamed.outputs.svg import render_profile
from flamed.sampling.drain import (
    OFF_STATS,
    OFFCPU_BLOCKED_FRAME,
    OFFCPU_GIL_FRAME,
    OFFCPU_PREEMPTED_FRAME,
    Drainer,
    SamplerStats,
    _OffRead,
    offcpu_stack,
)
from flamed.sampling.program import BpfSamplerOptions


def _off_profile(kind: str = "off_cpu") -> Profile:
    return Profile(stacks={("main", "nap", OFFCPU_BLOCKED_FRAME): 1500, ("main", "work"): 250},
                   labels={"unit": "microseconds", "kind": kind})


def test_time_kind_reads_the_labels() -> None:
    assert time_kind(_off_profile()) == ("off-CPU time", "\u00b5s")
    assert time_kind(_off_profile("wall")) == ("wall-clock time", "\u00b5s")
    assert time_kind(Profile(labels={"unit": "samples"})) is None
    assert time_kind(Profile(labels={"unit": "microseconds"})) is None  # no kind: not claimed


def test_svg_states_the_unit_in_subtitle_and_tooltips() -> None:
    out = io.BytesIO()
    render_profile(_off_profile(), out)
    svg = out.getvalue().decode()
    assert "off-CPU time in \u00b5s" in svg
    assert "1,500 \u00b5s" in svg or "1500 \u00b5s" in svg
    titles = re.findall(r"<title>([^<]*)</title>", svg)
    assert titles and all("samples" not in t for t in titles) and any("\u00b5s" in t for t in titles), titles
    plain = io.BytesIO()
    render_profile(Profile(stacks={("a",): 3}), plain)
    assert "\u00b5s" not in plain.getvalue().decode()


def test_speedscope_unit_is_microseconds() -> None:
    doc = to_document(_off_profile())
    assert {p["unit"] for p in doc["profiles"]} == {"microseconds"}


def test_chrometrace_of_an_off_cpu_profile_lays_out_its_times() -> None:
    """1,500 µs of off-CPU time is an event of 1,500 µs on the trace's axis,
    not 1,500 sampling intervals (15 s at 99 Hz); sample counts still weigh
    one interval each."""
    from flamed.outputs.chrometrace import profile_trace  # noqa: PLC0415

    for kind in ("off_cpu", "wall"):
        p = _off_profile(kind)
        p.sample_rate = 99.0
        events = {e["name"]: e for e in profile_trace(p)["traceEvents"] if e["ph"] == "X"}
        assert events["main"]["dur"] == 1750.0, events["main"]
        assert events["nap"]["dur"] == 1500.0 and events[OFFCPU_BLOCKED_FRAME]["dur"] == 1500.0
        assert events["work"]["ts"] == 1500.0 and events["work"]["dur"] == 250.0
    counts = Profile(stacks={("main", "work"): 99}, sample_rate=99.0)
    events = {e["name"]: e for e in profile_trace(counts)["traceEvents"] if e["ph"] == "X"}
    assert events["work"]["dur"] == 1e6  # 99 samples at 99 Hz: one second


def test_pprof_sample_type_and_round_trip() -> None:
    for kind in ("off_cpu", "wall"):
        msg = to_proto(_off_profile(kind))
        st = [(msg.string_table[t.type], msg.string_table[t.unit]) for t in msg.sample_type]
        assert st == [(kind, "nanoseconds")]
        assert msg.string_table[msg.default_sample_type] == kind
        assert sorted(v for s in msg.sample for v in s.value) == [250_000, 1_500_000]
        buf = io.BytesIO()
        write_pprof(_off_profile(kind), buf)
        back = read_pprof(buf.getvalue())
        assert back.labels["unit"] == "microseconds" and back.labels["kind"] == kind
        assert back.stacks == _off_profile(kind).stacks


def test_pprof_of_another_profiler_in_nanoseconds_reads_as_microseconds() -> None:
    msg = pb.Profile()
    msg.string_table.extend(["", "off_cpu", "nanoseconds", "f"])
    msg.sample_type.add(type=1, unit=2)
    msg.function.add(id=1, name=3)
    loc = msg.location.add(id=1)
    loc.line.add(function_id=1)
    msg.sample.add(location_id=[1], value=[2_500_000])
    p = read_pprof(gzip.compress(msg.SerializeToString()))
    assert p.labels == {"kind": "off_cpu", "unit": "microseconds"}
    assert p.stacks == {("f",): 2500}


def _args(mode: str, rate: int = 100) -> argparse.Namespace:
    return argparse.Namespace(mode=mode, rate=rate, root=None, subprocesses=False)


def _recorder(counts: dict[Any, int], offcpu: dict[Any, int]) -> RecordCommand:
    cmd = RecordCommand()
    cmd._identities = {}
    cmd._offcpu = offcpu
    return cmd


CPU = {(1, 1, "py", ("main", "work")): 30}
OFF = {(1, 1, "py", ("main", "nap", OFFCPU_BLOCKED_FRAME)): 2_400_400,
       (1, 2, "py", ("main", "nap", OFFCPU_BLOCKED_FRAME)): 600_000,
       (1, 2, "py", ("main", "work", OFFCPU_PREEMPTED_FRAME)): 400}


def test_record_modes_weigh_in_samples_or_microseconds() -> None:
    cmd = _recorder(CPU, OFF)
    cpu = cmd._profile(_args("cpu"), [], CPU, None)
    assert cpu.labels["unit"] == "samples" and "kind" not in cpu.labels
    assert cpu.stacks == {("main", "work"): 30}
    off = cmd._profile(_args("offcpu"), [], CPU, None)
    assert off.labels["unit"] == "microseconds" and off.labels["kind"] == "off_cpu"
    # Summed in ns per stack (both threads), rounded once.
    # 400 ns round to 0 us: no stack.
    assert off.stacks == {("main", "nap", OFFCPU_BLOCKED_FRAME): 3000}
    wall = cmd._profile(_args("wall", rate=100), [], CPU, None)
    assert wall.labels["kind"] == "wall"
    # 30 samples at 100 Hz: 300 ms of CPU.
    assert wall.stacks[("main", "work")] == 300_000
    assert wall.stacks[("main", "nap", OFFCPU_BLOCKED_FRAME)] == 3000


def test_offcpu_stack_cuts_the_tracing_frames() -> None:
    raw: Stack = ("main", "schedule_[k]", "__schedule_[k]", "bpf_trace_run4_[k]", "bpf_prog_3f1d_flamed_offcpu_[k]")
    assert offcpu_stack(raw, 0) == ("main", "schedule_[k]", "__schedule_[k]", OFFCPU_BLOCKED_FRAME)
    assert offcpu_stack(("main",), 1) == ("main", OFFCPU_PREEMPTED_FRAME)
    # FLAMED_OFF_GIL: blocked on the interpreter's GIL.
    assert offcpu_stack(("main", "spin"), 2) == ("main", "spin", OFFCPU_GIL_FRAME)


def _start(epoch: int, kt: int, flags: int = 0) -> tuple[int, int, int, int, int, int, int, int, bytes]:
    # ktime, python id, cgroup, epoch, tgid, kernel id, user id, flags, comm
    return (kt, 0, 0, epoch, 7, 11, 12, flags, b"py")


def _drainer() -> Drainer:
    """A Drainer with only what _offcpu uses: stacks are named by a stub."""
    d = Drainer.__new__(Drainer)
    d.options = BpfSamplerOptions(offcpu=True, offcpu_starts=4)
    d._carry = {}
    d._stats = SamplerStats()

    def symbolize(keys: Any, _ev: Any, _stacks: Any, _py: Any, _us: Any) -> tuple[dict[Any, int], list[Any]]:
        out: dict[Any, int] = {}
        for tgid, tid, kid, uid, _comm, _pyid, _nid, _cg, _leaf, n in keys:
            k = (tgid, tid, "py", (f"u{uid}", f"k{kid}_[k]"))
            out[k] = out.get(k, 0) + n
        return out, []

    d._symbolize = symbolize  # type: ignore[method-assign]
    return d


def test_a_wait_spanning_drains_keeps_its_stacks_until_it_ends() -> None:
    d = _drainer()
    counters: dict[str, int] = {}
    # Drain of epoch 3: thread 5 is still waiting since epoch 3.
    open5 = {(5, 100): _start(3, 100)}
    off = _OffRead(rows=[], to_carry=open5, ended={}, live=set(open5))
    assert d._offcpu(off, {}, {}, counters) == {}
    assert d._stats.offcpu_carried_open == 1
    # Drain of epoch 4: still waiting (not to carry again: it began in 3).
    off = _OffRead(rows=[], to_carry={}, ended={}, live=set(open5))
    assert d._offcpu(off, {}, {}, counters) == {}
    # Drain of epoch 5: it ended in 5 after 2.5 s, and one ended with no kept stack.
    off = _OffRead(rows=[], to_carry={}, ended={(5, 100): (_start(3, 100), 2_500_000_000),
                                                 (6, 50): (_start(2, 50), 10)}, live=set())
    got = d._offcpu(off, {}, {}, counters)
    assert got == {(7, 5, "py", ("u12", "k11_[k]", OFFCPU_BLOCKED_FRAME)): 2_500_000_000}
    assert counters["CARRY_MISSING"] == 1 and counters["CARRY_EXPIRED"] == 0
    assert d._carry == {}


def test_carried_waits_that_vanish_expire_and_the_store_is_bounded() -> None:
    d = _drainer()
    counters: dict[str, int] = {}
    starts = {(t, 1): _start(1, 1) for t in range(6)}
    off = _OffRead(rows=[], to_carry=starts, ended={}, live=set(starts))
    d._offcpu(off, {}, {}, counters)
    assert counters["CARRY_OVERFLOW"] == 2 and len(d._carry) == 4
    off = _OffRead(rows=[], to_carry={}, ended={}, live={(0, 1)})
    d._offcpu(off, {}, {}, counters)
    assert counters["CARRY_EXPIRED"] == 3 and list(d._carry) == [(0, 1)]


def test_same_generation_rows_get_their_reason_as_leaf() -> None:
    d = _drainer()
    rows = [((7, 5, 1, 2, b"py", 0, 0, 0, 0, 4000), 0), ((7, 5, 1, 2, b"py", 0, 0, 0, 0, 600), 1)]
    got = d._offcpu(_OffRead(rows=rows, to_carry={}, ended={}, live=set()), {}, {}, {})
    assert got == {(7, 5, "py", ("u2", "k1_[k]", OFFCPU_BLOCKED_FRAME)): 4000,
                   (7, 5, "py", ("u2", "k1_[k]", OFFCPU_PREEMPTED_FRAME)): 600}
    assert set(OFF_STATS) >= {"OFF_SWITCHES", "CARRY_MISSING"}


def test_speedscope_document_is_json() -> None:
    json.dumps(to_document(_off_profile()))


class _FakeStarts(dict[int, object]):
    """offcpu_start as bcc shows it: Key(tid), del table[key]."""

    @staticmethod
    def Key(tid: int) -> int:  # noqa: N802 -- bcc's name
        return tid


def test_the_last_drain_counts_open_waits_up_to_its_flip(monkeypatch: Any) -> None:
    from flamed.sampling import drain

    monkeypatch.setattr(drain, "thread_alive", lambda tgid, tid: tid != 9)
    d = _drainer()
    table = _FakeStarts({5: object(), 6: object()})
    d._program = type("P", (), {"bpf": {"offcpu_start": table}})()  # type: ignore[assignment]
    counters: dict[str, int] = {}
    # Thread 5 waits since ktime 1e9 (kept at an earlier drain); thread 6 since 2e9 (this one).
    d._carry[(5, 1_000_000_000)] = (7, "py", ("u1",), 0)
    off = _OffRead(rows=[], to_carry={(6, 2_000_000_000): _start(9, 2_000_000_000)}, ended={},
                   live={(5, 1_000_000_000), (6, 2_000_000_000)},
                   open_waits={(5, 1_000_000_000), (6, 2_000_000_000), (8, 9_000_000_000)})
    out = d._offcpu(off, {}, {}, counters)
    d._close_waits(off, 4_000_000_000, out)
    assert out == {(7, 5, "py", ("u1", OFFCPU_BLOCKED_FRAME)): 3_000_000_000,
                   (7, 6, "py", ("u12", "k11_[k]", OFFCPU_BLOCKED_FRAME)): 2_000_000_000}
    assert d._carry == {} and dict(table) == {}
    # A thread gone (tid 9) is not waiting: its stale start is dropped, not counted.
    d._carry[(9, 1)] = (7, "py", ("u1",), 0)
    out = {}
    d._close_waits(_OffRead(rows=[], to_carry={}, ended={}, live=set(), open_waits={(9, 1)}), 5, out)
    assert out == {} and d._carry == {}
