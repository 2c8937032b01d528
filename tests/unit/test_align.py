"""The time-aligned join, on synthetic timelines with a known truth.

A tiny model of py-spy writes chrometrace exactly as py-spy 0.4 does (an event
only when a thread's stack changes, stamped at the recorder's ``increment`` in
microseconds since its start), plus the uprobe hits the BPF clock program
would see, plus BPF samples whose signature depends on the true phase.
"""

from __future__ import annotations

import json
import random

import pytest

from flamed.errors import InputError
from flamed.pyspy.align import NO_PYTHON_FRAME, JoinOptions, align_trace, join, join_events, mixed_stack
from flamed.pyspy.chrometrace import parse_chrometrace
from flamed.pyspy.clockfit import QUEUED_NS, fit_clock, sample_times
from flamed.sampling.contract import SampleEvent
from flamed.sampling.pystack import native_below_interpreter

PID = 4242
TID = 4242
SYS = ("<module> (app.py:30)", "do_io (app.py:10)")
CPU = ("<module> (app.py:31)", "crunch (app.py:20)")


def frames(stack: tuple[str, ...]) -> list[tuple[str, str, int]]:
    out = []
    for f in stack:
        name, rest = f.split(" (")
        file, line = rest.rstrip(")").split(":")
        out.append((name, file, int(line)))
    return out


class FakePySpy:
    """py-spy's chrometrace recorder, sampling ``truth(t)`` every ``interval`` ns."""

    def __init__(self, start_ns: int, interval_ns: int, lag_ns: int = 3_000, *, poisson: bool = False,
                 spacing_ns: tuple[int, int] | None = None, first_call_ns: int = 0) -> None:
        """``poisson``: exponential intervals, as py-spy's timer draws them (the
        default is a fixed interval).  ``spacing_ns``: the threads of one sample
        are incremented one after the other, this far apart (min, max); by
        default each thread's hit is drawn on its own.  ``first_call_ns``: the
        very first increment reads the clock this much after its hit (py-spy's
        first clock read is slow)."""
        self.start_ns = start_ns
        self.interval = interval_ns
        self.lag = lag_ns
        self.poisson = poisson
        self.spacing = spacing_ns
        self.first_call = first_call_ns
        self.events: list[dict[str, object]] = []
        self.hits: list[int] = []
        self.samples: list[int] = []  # first hit of each sample
        self.prev: dict[int, list[tuple[str, str, int]]] = {}

    def run(self, truth, tids: dict[int, int], end_ns: int, jitter: random.Random) -> None:
        t = self.start_ns + 13_000_000
        while t < end_ns:
            hit = t + self.lag
            for n, (ptid, tid) in enumerate(tids.items()):
                stack = [("thread (%d): T%d" % (tid, tid), "", 0)] + frames(truth(tid, t))
                if self.spacing is None:
                    hit = t + self.lag + jitter.randrange(0, 20_000)
                elif n:
                    hit += jitter.randrange(*self.spacing)
                if n == 0:
                    self.samples.append(hit)
                now = hit + (self.first_call if not self.hits else 0)
                self.hits.append(hit)
                ts = (now + jitter.randrange(0, 800) - self.start_ns) // 1000
                prev = self.prev.get(ptid, [])
                k = 0
                while k < min(len(prev), len(stack)) and prev[k] == stack[k]:
                    k += 1
                for fr in reversed(prev[k:]):
                    self.events.append(self.ev("E", ptid, fr, ts))
                for fr in stack[k:]:
                    self.events.append(self.ev("B", ptid, fr, ts))
                self.prev[ptid] = stack
            if self.poisson:
                # back to back when the draw is shorter than a sample takes
                t = max(t + int(jitter.expovariate(1 / self.interval)), hit + 200_000)
            else:
                t += self.interval
        ts = (t - self.start_ns) // 1000
        for ptid, prev in self.prev.items():
            for fr in prev:
                self.events.append(self.ev("E", ptid, fr, ts))

    def ev(self, ph: str, ptid: int, fr: tuple[str, str, int], ts: int) -> dict[str, object]:
        return {"args": {"filename": fr[1], "line": fr[2]}, "cat": "py-spy", "name": fr[0], "ph": ph,
                "pid": PID, "tid": ptid, "ts": ts}

    def chrometrace(self) -> bytes:
        return json.dumps(self.events).encode()


def phase_truth(phase_ns: int, t0: int):
    def truth(tid: int, t: int) -> tuple[str, ...]:
        return SYS if ((t - t0) // phase_ns) % 2 == 0 else CPU
    return truth


def bpf_events(truth, t0: int, t1: int, hz: int, rng: random.Random, tid: int = TID) -> list[SampleEvent]:
    out = []
    step = 1_000_000_000 // hz
    t = t0 + rng.randrange(step)
    while t < t1:
        if truth(tid, t) == SYS:
            # mostly in the kernel, sometimes in libc's wrapper
            kern = ("entry_SYSCALL_64_after_hwframe_[k]", "do_syscall_64_[k]") if rng.random() < 0.85 else ()
            user = ("fstatat64",) if kern or rng.random() < 0.5 else ("_PyEval_EvalFrameDefault",)
        else:
            kern = ("asm_sysvec_apic_timer_interrupt_[k]",) if rng.random() < 0.03 else ()
            user = ("_PyEval_EvalFrameDefault",) if rng.random() < 0.8 else ("PyLong_Add",)
        out.append(SampleEvent(ktime_ns=t, tgid=PID, tid=tid, comm="python3", user_stack=user, kernel_stack=kern))
        t += step + rng.randrange(-50_000, 50_000)
    return out


def build(phase_ms: int, seed: int, py_hz: int = 100, calibrated: bool = True):
    rng = random.Random(seed)
    spawn = 1_000_000_000_000
    start = spawn + rng.randrange(18_000_000, 33_000_000)
    interval = 1_000_000_000 // py_hz
    t0 = start + 5_000_000
    end = t0 + 3_000_000_000
    truth = phase_truth(phase_ms * 1_000_000, t0)
    spy = FakePySpy(start, interval)
    spy.run(truth, {0x7F001: TID}, end, rng)
    trace = parse_chrometrace(spy.chrometrace())
    hits = spy.hits if calibrated else []
    clock = fit_clock(trace, hits, spawn_ns=spawn, interval_ns=interval)
    aligned = align_trace(PID, trace, clock, sample_times(hits, interval), interval)
    events = bpf_events(truth, start + 20_000_000, end - 20_000_000, 199, rng)
    return spy, trace, clock, aligned, events, truth


def accuracy(events, stacks, truth) -> float:
    ok = sum(1 for ev, st in zip(events, stacks) if st is not None and st == truth(ev.tid, ev.ktime_ns))
    return ok / len(events)


def test_clock_fit_recovers_start_to_microseconds() -> None:
    for seed in range(5):
        spy, trace, clock, *_ = build(50, seed)
        assert clock.calibrated
        assert clock.matched == len(trace.change_ts_us)
        # hits are ~3-23 us after the true start-based time; allow that lag
        assert abs(clock.start_ns - spy.start_ns) < 25_000, (seed, clock.start_ns - spy.start_ns)


def test_uncalibrated_clock_falls_back_to_spawn_guess() -> None:
    spy, trace, clock, *_ = build(50, 1, calibrated=False)
    assert not clock.calibrated
    assert abs(clock.start_ns - spy.start_ns) < 10_000_000


def test_parse_maps_threads_by_os_tid_and_skips_name_only_changes() -> None:
    ev = [
        {"ph": "B", "ts": 10, "tid": 99, "pid": 1, "name": "thread (501)", "args": {"filename": "", "line": 0}},
        {"ph": "B", "ts": 10, "tid": 99, "pid": 1, "name": "f", "args": {"filename": "/usr/lib/python3.11/json/x.py", "line": 3}},
        {"ph": "E", "ts": 20, "tid": 99, "pid": 1, "name": "f", "args": {"filename": "/usr/lib/python3.11/json/x.py", "line": 3}},
        {"ph": "E", "ts": 20, "tid": 99, "pid": 1, "name": "thread (501)", "args": {"filename": "", "line": 0}},
        {"ph": "B", "ts": 20, "tid": 99, "pid": 1, "name": "thread (501): Main", "args": {"filename": "", "line": 0}},
        {"ph": "B", "ts": 20, "tid": 99, "pid": 1, "name": "f", "args": {"filename": "/usr/lib/python3.11/json/x.py", "line": 3}},
        {"ph": "B", "ts": 30, "tid": 7, "pid": 1, "name": "thread (0x7)", "args": {"filename": "", "line": 0}},
        {"ph": "E", "ts": 40, "tid": 99, "pid": 1, "name": "f", "args": {"filename": "/usr/lib/python3.11/json/x.py", "line": 3}},
        {"ph": "E", "ts": 40, "tid": 99, "pid": 1, "name": "thread (501): Main", "args": {"filename": "", "line": 0}},
    ]
    t = parse_chrometrace(json.dumps(ev))
    # 7 (a hex id) is a pthread id: kept, for flamed.pyspy.threadids to map
    assert t.threads == {501: [(10, ("f (json/x.py:3)",))], 7: [(30, ())]}
    assert t.thread_names == {501: "Main"}
    # a hex id is a pthread id (Python < 3.11), kept for flamed.pyspy.threadids to map
    assert t.pthread_ids == {7} and t.unmapped == 0
    assert (t.first_ts_us, t.last_ts_us) == (10, 40)


@pytest.mark.parametrize("bad", [b"", b"{", b"{}", b'[{"ph": "B"}]', b"\xff\xfe"])
def test_parse_rejects_garbage_with_input_error(bad: bytes) -> None:
    with pytest.raises(InputError):
        parse_chrometrace(bad, source="x.json")


@pytest.mark.parametrize("phase_ms,floor", [(200, 0.99), (50, 0.97), (20, 0.90)])
def test_join_accuracy_on_synthetic_phases(phase_ms: int, floor: float) -> None:
    accs = []
    for seed in range(3):
        _, _, _, aligned, events, truth = build(phase_ms, seed)
        stacks, stats = join(events, [aligned])
        assert stats.matched == len(events) and stats.unmatched == 0
        accs.append(accuracy(events, stacks, truth))
    assert min(accs) >= floor, accs


def test_likelihood_beats_midpoint_at_short_phases() -> None:
    refined = midpoint = 0.0
    for seed in range(4):
        _, _, _, aligned, events, truth = build(20, seed)
        a, sa = join(events, [aligned], JoinOptions(refine=True))
        b, sb = join(events, [aligned], JoinOptions(refine=False))
        assert sa.placed_likelihood > 0 and sb.placed_likelihood == 0
        refined += accuracy(events, a, truth)
        midpoint += accuracy(events, b, truth)
    assert refined > midpoint


def test_weights_are_those_of_bpf_samples() -> None:
    # py-spy at 4x the BPF rate must not change how many samples come out (py-spy #506)
    _, _, _, aligned, events, _ = build(50, 3, py_hz=200)
    stacks, stats = join_events(events, [aligned])
    assert len(stacks) == len(events)
    assert stats.matched + stats.unmatched == len(events)


def test_unmatched_samples_keep_native_frames_under_placeholder() -> None:
    _, _, _, aligned, events, _ = build(50, 4)
    late = SampleEvent(ktime_ns=aligned.end_ns + 10**9, tgid=PID, tid=TID, comm="python3",
                       user_stack=("fstatat64",), kernel_stack=("do_syscall_64_[k]",))
    other_thread = SampleEvent(ktime_ns=aligned.start_ns + 10**8, tgid=PID, tid=TID + 1, comm="python3",
                               user_stack=("memcpy",), kernel_stack=())
    other_pid = SampleEvent(ktime_ns=aligned.start_ns + 10**8, tgid=PID + 1, tid=TID + 1, comm="x",
                            user_stack=(), kernel_stack=())
    stacks, stats = join_events([late, other_thread, other_pid], [aligned])
    assert stacks[0] == (NO_PYTHON_FRAME, "fstatat64", "do_syscall_64_[k]")
    assert stacks[1] == (NO_PYTHON_FRAME, "memcpy")
    assert (stats.no_trace, stats.no_thread, stats.matched) == (2, 1, 0)


def test_overlapping_runs_prefer_the_one_without_a_gap() -> None:
    _, _, _, a1, events, truth = build(50, 5)
    stacks1, _ = join(events, [a1])
    stacks2, _ = join(events, [a1, a1])
    assert stacks1 == stacks2


def test_mixed_stack_replaces_eval_frames() -> None:
    ev = SampleEvent(ktime_ns=0, tgid=1, tid=1, comm="python3",
                     user_stack=("_start", "Py_RunMain", "_PyEval_EvalFrameDefault", "cfunction_call",
                                 "_PyEval_EvalFrameDefault", "os_stat", "fstatat64"),
                     kernel_stack=("entry_SYSCALL_64_[k]", "vfs_statx_[k]"))
    assert mixed_stack(("main (a.py:1)", "f (a.py:2)"), ev) == (
        "main (a.py:1)", "f (a.py:2)", "os_stat", "fstatat64", "entry_SYSCALL_64_[k]", "vfs_statx_[k]")
    assert native_below_interpreter(("[unknown]", "[unknown]", "_PyTime_AsSecondsDouble")) == (
        "_PyTime_AsSecondsDouble",)
    assert native_below_interpreter(("[unknown]",)) == ("[unknown]",)
    assert native_below_interpreter(("_PyEval_EvalFrameDefault",)) == ()
    # A PLT stub about to enter the eval loop is below it, not one of it.
    assert native_below_interpreter(("_PyEval_EvalFrameDefault", "PyObject_Call", "_PyEval_EvalFrameDefault@plt")) == (
        "PyObject_Call", "_PyEval_EvalFrameDefault@plt")


def test_observed_times_pair_read_bursts_with_increments() -> None:
    from flamed.pyspy.clockfit import observed_times

    iv = 10_000_000
    reads, incs = [], []
    for k in range(20):
        start = 1_000_000_000 + k * iv
        if k == 7:
            reads += [start, start + 50_000]  # a sample that failed: reads, no increment
            continue
        reads += [start + j * 20_000 for j in range(30)]  # one burst of reads
        incs.append(start + 600_000 + (k % 3) * 3_000_000)  # queued up to 6.6 ms late
    samples = sample_times(incs, iv)
    obs = observed_times(samples, reads, iv)
    expected = [1_000_000_000 + k * iv for k in range(20) if k != 7]
    assert obs == expected
    # without reads, samples keep their increment times
    assert observed_times(samples, [], iv) == samples


def test_trace_times_move_to_read_times() -> None:
    # a late increment must not push the change later than when py-spy looked
    spy, trace, clock, _, _, _ = build(50, 2)
    samples = sample_times(spy.hits, spy.interval)
    early = [s - 2_000_000 for s in samples]
    a = align_trace(PID, trace, clock, samples, spy.interval)
    b = align_trace(PID, trace, clock, samples, spy.interval, early)
    for sa, sb in zip(a.threads[TID], b.threads[TID]):
        assert sb.hi_ns == sa.hi_ns - 2_000_000


BG = ("run (worker.py:5)", "step (worker.py:9)")
BG2 = ("run (worker.py:5)", "step (worker.py:10)")


def build_threads(seed: int, first_call_ns: int):
    """Two threads sampled by a py-spy with exponential intervals, incremented one after the other."""
    rng = random.Random(seed)
    start = 1_000_000_000_000 + rng.randrange(18_000_000, 33_000_000)
    interval = 10_000_000
    t0 = start + 5_000_000
    main = phase_truth(20_000_000, t0)

    def truth(tid: int, t: int) -> tuple[str, ...]:
        if tid == TID:
            return main(tid, t)
        return BG if (t // 90_000_000) % 2 else BG2

    # py-spy walks the newest thread first: the worker's increment comes before the main thread's
    spy = FakePySpy(start, interval, poisson=True, spacing_ns=(12_000, 40_000), first_call_ns=first_call_ns)
    spy.run(truth, {0x7F002: TID + 1, 0x7F001: TID}, t0 + 3_000_000_000, rng)
    return spy, parse_chrometrace(spy.chrometrace())


@pytest.mark.parametrize("seed", range(4))
def test_clock_fit_is_not_pulled_by_other_threads_increments(seed: int) -> None:
    # The first clock read of py-spy is slow (tens of us after its hit); pairing each
    # change with its nearest hit from there takes the other thread's increment for
    # many changes, and their median is off by a thread's spacing.
    spy, trace = build_threads(seed, first_call_ns=30_000)
    clock = fit_clock(trace, spy.hits, interval_ns=spy.interval)
    # ts = hit + [0, 0.8 us) truncated to us: the start is known to ~2 us
    assert abs(clock.start_ns - spy.start_ns) <= 2_000, clock.start_ns - spy.start_ns


@pytest.mark.parametrize("seed", range(4))
def test_each_change_lands_in_the_sample_that_wrote_it(seed: int) -> None:
    spy, trace = build_threads(seed, first_call_ns=30_000)
    clock = fit_clock(trace, spy.hits, interval_ns=spy.interval)
    samples = sample_times(spy.hits, spy.interval)
    assert samples == spy.samples
    aligned = align_trace(PID, trace, clock, samples, spy.interval)
    for tid in (TID, TID + 1):
        changes = trace.threads[tid]
        segs = aligned.threads[tid]
        assert len(segs) == len(changes)
        for (ts, _), seg in zip(changes, segs):
            written = spy.start_ns + ts * 1000  # when that increment ran, truncated to 1 us
            j = max(k for k, s in enumerate(spy.samples) if s <= written + 1000)
            assert seg.hi_ns == spy.samples[j], (tid, ts)
            if j and spy.samples[j] - spy.samples[j - 1] >= QUEUED_NS:
                assert seg.lo_ns == spy.samples[j - 1]
            elif j:
                # incremented right after the previous sample: it may have waited in py-spy's queue
                assert seg.lo_ns <= spy.samples[j - 1]


def build_poisson(phase_ms: int, seed: int, signatures=None):
    """One thread, py-spy at exponential intervals (mean 10 ms) as its timer draws them."""
    rng = random.Random(seed)
    start = 1_000_000_000_000 + rng.randrange(18_000_000, 33_000_000)
    interval = 10_000_000
    t0 = start + 5_000_000
    end = t0 + 4_000_000_000
    truth = phase_truth(phase_ms * 1_000_000, t0)
    spy = FakePySpy(start, interval, poisson=True)
    spy.run(truth, {0x7F001: TID}, end, rng)
    trace = parse_chrometrace(spy.chrometrace())
    clock = fit_clock(trace, spy.hits, interval_ns=interval)
    aligned = align_trace(PID, trace, clock, sample_times(spy.hits, interval), interval, None, spy.hits)
    events = bpf_events(signatures or truth, start + 20_000_000, end - 20_000_000, 199, rng)
    return aligned, events, truth


@pytest.mark.parametrize("phase_ms,floor", [(200, 0.99), (50, 0.97), (20, 0.93)])
def test_join_accuracy_with_exponential_pyspy_intervals(phase_ms: int, floor: float) -> None:
    accs = []
    for seed in range(3):
        aligned, events, truth = build_poisson(phase_ms, seed)
        stacks, _ = join(events, [aligned])
        accs.append(accuracy(events, stacks, truth))
    assert min(accs) >= floor, accs


def test_functions_run_between_two_pyspy_samples_are_found() -> None:
    # At 20 ms phases about one phase in seven falls between two py-spy samples.
    found = missed = 0.0
    for seed in range(3):
        aligned, events, truth = build_poisson(20, seed)
        a, sa = join(events, [aligned], JoinOptions(unseen=True))
        b, sb = join(events, [aligned], JoinOptions(unseen=False))
        assert sa.placed_unseen > 0 and sb.placed_unseen == 0
        found += accuracy(events, a, truth)
        missed += accuracy(events, b, truth)
    assert found > missed


def test_unseen_functions_cost_nothing_where_signatures_say_nothing() -> None:
    # Signatures drawn independently of the running function: nothing to go on,
    # so few samples move and the accuracy stays that of the plain placement.
    rng = random.Random(7)

    def coin(tid: int, t: int) -> tuple[str, ...]:
        return SYS if rng.random() < 0.5 else CPU

    for seed in range(3):
        aligned, events, truth = build_poisson(20, seed, signatures=coin)
        a, stats = join(events, [aligned])
        b, _ = join(events, [aligned], JoinOptions(unseen=False, relearn=0))
        assert stats.placed_unseen <= 0.04 * len(events)
        assert accuracy(events, a, truth) >= accuracy(events, b, truth) - 0.01


def test_samples_split_by_a_preempted_recorder_are_joined_and_catch_up_bursts_cut() -> None:
    iv = 10_000_000
    hits = []
    for k in range(30):
        t = 1_000_000_000 + k * iv
        if k == 10:
            hits += [t, t + 900_000]  # the second thread's increment 0.9 ms later: one sample
        elif k == 20:
            # three samples back to back after a late wakeup, 100 us apart
            hits += [t, t + 20_000, t + 120_000, t + 140_000, t + 240_000, t + 260_000]
        else:
            hits += [t, t + 20_000]
    samples = sample_times(hits, iv)
    expected = [1_000_000_000 + k * iv for k in range(30)]
    expected[21:21] = [expected[20] + 120_000, expected[20] + 240_000]
    assert samples == expected


def test_samples_incremented_back_to_back_may_have_waited_in_the_queue() -> None:
    # py-spy's main thread ran late: three samples read at unknown times since the
    # one at 10 ms were incremented at 40.0, 40.3 and 40.6 ms.  A change seen at the
    # last of them happened after 10 ms, not after 40.3 ms.
    from flamed.pyspy.chrometrace import PyTrace
    from flamed.pyspy.clockfit import ClockFit

    start = 1_000_000_000
    samples = [start, start + 10_000_000, start + 40_000_000, start + 40_300_000, start + 40_600_000,
               start + 55_000_000]
    trace = PyTrace(threads={TID: [(0, SYS), (40_600, CPU), (55_000, SYS)]}, change_ts_us=[0, 40_600, 55_000],
                    first_ts_us=0, last_ts_us=60_000)
    clock = ClockFit(start_ns=start, calibrated=True)
    a = align_trace(PID, trace, clock, samples, 10_000_000, None, samples)
    segs = a.threads[TID]
    assert (segs[1].lo_ns, segs[1].hi_ns) == (samples[1], samples[4])
    assert (segs[2].lo_ns, segs[2].hi_ns) == (samples[4], samples[5])


def test_after_the_last_pyspy_sample_the_last_stack_holds_while_samples_look_like_it() -> None:
    # py-spy's last successful sample came 40 ms before a phase ended; it wrote its
    # trace 20 ms into the next phase.  The samples in between that look like the
    # last function keep its stack; those of the next phase keep no Python frame.
    from dataclasses import replace

    aligned, events, truth = build_poisson(200, 1)
    t0 = min(ev.ktime_ns for ev in events)
    boundary = next(t for t in range(t0, t0 + 10**10, 1_000_000) if truth(TID, t) != truth(TID, t0)
                    and truth(TID, t - 1_000_000) == truth(TID, t0) and t > t0 + 10**9)
    cut = boundary - 40_000_000
    samples = [s for s in aligned.samples_ns if s <= cut]
    segs = [s for s in aligned.threads[TID] if s.hi_ns <= samples[-1]]
    tr = replace(aligned, threads={TID: segs}, samples_ns=samples, end_ns=samples[-1],
                 written_ns=boundary + 20_000_000, _los={}, _his={})
    mine = [ev for ev in events if ev.ktime_ns <= boundary + 20_000_000]
    stacks, stats = join(mine, [tr])
    tail = [(ev, st) for ev, st in zip(mine, stacks) if ev.ktime_ns > samples[-1] + aligned.interval_ns // 2]
    before = [(ev, st) for ev, st in tail if ev.ktime_ns < boundary]
    after = [(ev, st) for ev, st in tail if ev.ktime_ns >= boundary + 5_000_000]
    assert before and after
    assert sum(st == truth(TID, ev.ktime_ns) for ev, st in before) >= 0.8 * len(before)
    assert sum(st is None for ev, st in after) >= 0.8 * len(after)
    assert stats.no_trace >= len(after) * 0.8


def test_a_thread_ending_is_not_found_unseen_in_between() -> None:
    # The thread's last segment is the empty stack of a thread ending, seen in a
    # few samples whose leaf a broken walk left as "[unknown]"; a run of such
    # samples in the middle of a phase must not be taken for it.
    from dataclasses import replace

    from flamed.pyspy.align import Segment

    aligned, events, truth = build_poisson(200, 2)
    last = aligned.samples_ns[-1]
    end = Segment(aligned.samples_ns[-2], last, ())
    tr = replace(aligned, threads={TID: aligned.threads[TID] + [end]}, _los={}, _his={})
    odd = [ev for ev in events if ev.ktime_ns < last - 100_000_000][-40:-30]
    weird = {id(ev) for ev in odd}
    mixed = [replace(ev, user_stack=("[unknown]",), kernel_stack=()) if id(ev) in weird else ev for ev in events]
    mixed += [SampleEvent(ktime_ns=last + k * 1_000_000, tgid=PID, tid=TID, comm="python3",
                          user_stack=("[unknown]",), kernel_stack=()) for k in range(1, 4)]
    stacks, _ = join(mixed, [tr])
    assert all(st != () for ev, st in zip(mixed, stacks) if ev.ktime_ns < last - 100_000_000)
