"""Time-aligned merge of py-spy's Python stacks into BPF samples.

The BPF sampler knows, for every sample of a watched Python thread, the kernel
stack and (usually only the leaf of) the native stack, stamped with
CLOCK_MONOTONIC.  py-spy knows the Python stack.  They are joined per OS
thread and per instant, in three steps:

1. **Parse** py-spy's chrometrace (:mod:`flamed.pyspy.chrometrace`): the
   stack changes of each thread, in py-spy's own clock.
2. **Calibrate** that clock (:mod:`flamed.pyspy.clockfit`) from the uprobe
   on py-spy's recorder, which also says when py-spy sampled.
3. **Place** each change (:func:`align_trace`, :func:`join`, here).  A change
   seen at sample *j* happened somewhere between samples *j-1* and *j* (or
   since the sample before a run of samples that waited in py-spy's queue).
   BPF samples in that gap get the old or the new stack by the likelihood of
   their signature (kernel frames present, native leaf symbol) under each
   stack, learnt from the BPF samples of the same run that are not in any
   gap; with nothing to learn from, the midpoint decides.  A function py-spy
   saw nearby may also have run entirely between two samples, when the
   signatures say so; the model is then learnt again from every placed
   sample, and samples placed again.

Weights are always those of the BPF samples: py-spy only names the Python
frames, it never adds or scales samples (the trap of py-spy issue #506).
"""

from __future__ import annotations

import bisect
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flamed.model import Stack, is_kernel_frame
from flamed.pyspy.chrometrace import PyTrace
from flamed.pyspy.clockfit import QUEUED_NS, SAMPLE_GAP_NS, ClockFit
from flamed.sampling.contract import SampleEvent
from flamed.sampling.pystack import native_below_interpreter

#: Root frame of a BPF sample that no Python stack could be joined with.
NO_PYTHON_FRAME = "[python: no frame]"


@dataclass(frozen=True, slots=True)
class Segment:
    """A Python stack of one thread from some instant in ``[lo_ns, hi_ns]`` on.

    py-spy last saw the previous stack at ``lo_ns`` and first saw this one at
    ``hi_ns``; the change happened in between.
    """

    lo_ns: int
    hi_ns: int
    stack: Stack


@dataclass
class AlignedTrace:
    """One py-spy run on one process, on CLOCK_MONOTONIC."""

    pid: int
    clock: ClockFit
    threads: dict[int, list[Segment]]
    start_ns: int  # first py-spy sample
    end_ns: int  # py-spy's last sample (or the write, when unknown)
    interval_ns: int
    #: when py-spy sampled (every thread of the process in each sample, with ``--idle``)
    samples_ns: list[int] = field(default_factory=list)
    #: when py-spy wrote its trace (it kept sampling until then, with no success after ``end_ns``)
    written_ns: int = 0
    _los: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _his: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def los(self, tid: int) -> list[int]:
        """Start of each segment's gap for ``tid`` (cached: the join bisects it per sample)."""
        v = self._los.get(tid)
        if v is None:
            v = self._los[tid] = [s.lo_ns for s in self.threads.get(tid, ())]
        return v

    def seen(self, tid: int, t: int) -> int:
        """Index of the segment py-spy saw ``tid`` in at its sample ``t`` (-1: none yet)."""
        v = self._his.get(tid)
        if v is None:
            v = self._his[tid] = [s.hi_ns for s in self.threads.get(tid, ())]
        return bisect.bisect_right(v, t) - 1


def align_trace(pid: int, trace: PyTrace, clock: ClockFit, samples_ns: Sequence[int],
                interval_ns: int, observed_ns: Sequence[int] | None = None,
                hits_ns: Sequence[int] | None = None) -> AlignedTrace:
    """Put each stack change of ``trace`` in its gap between py-spy samples.

    ``samples_ns``: sample starts (:func:`sample_times`); ``hits_ns``: the
    increment calls they were made from (each change then belongs to the
    sample of the call nearest to it); ``observed_ns``: the same samples'
    read times (:func:`observed_times`), when known.
    """
    obs = observed_ns if observed_ns is not None and len(observed_ns) == len(samples_ns) else samples_ns
    # py-spy's sampling thread hands each sample to its main thread, which
    # calls increment; when the main thread runs late, the samples queue up and
    # are incremented back to back, each long after it was read.  A sample
    # incremented right after the previous one may have been read any time
    # since the sample before that run of samples: its change gap starts there.
    since: list[int] = []
    for j in range(len(samples_ns)):
        if j == 0:
            since.append(obs[0] - interval_ns)
        elif samples_ns[j] - samples_ns[j - 1] < QUEUED_NS:
            since.append(since[j - 1])
        else:
            since.append(obs[j - 1])
    threads: dict[int, list[Segment]] = {}
    for tid, changes in trace.threads.items():
        segs: list[Segment] = []
        for ts, stack in changes:
            at = clock.to_mono(ts)
            if samples_ns:
                # The sample whose increment stamped ``ts``: the one of the
                # call nearest to it, else the one starting at or just before
                # it (half a SAMPLE_GAP_NS absorbs what is left of the clock's
                # error).
                j = -1
                if hits_ns:
                    k = bisect.bisect_left(hits_ns, at)
                    near = [hits_ns[x] for x in (k - 1, k) if 0 <= x < len(hits_ns)]
                    h = min(near, key=lambda x: abs(x - at))
                    if abs(h - at) <= SAMPLE_GAP_NS // 2:
                        j = bisect.bisect_right(samples_ns, h) - 1
                if j < 0:
                    j = bisect.bisect_right(samples_ns, at + SAMPLE_GAP_NS // 2) - 1
                hi = obs[j] if j >= 0 else at
                lo = since[j] if j >= 0 else hi - interval_ns
                if segs:
                    lo = max(lo, segs[-1].hi_ns)  # after the previous change was seen
            else:
                hi = at
                lo = at - interval_ns
            if lo > hi:
                lo = hi
            segs.append(Segment(lo, hi, stack))
        threads[tid] = segs
    first = clock.to_mono(trace.first_ts_us or 0)
    if samples_ns:
        start = obs[0]
        end = obs[-1]
    else:
        start = first
        end = clock.to_mono(trace.last_ts_us or 0)
    written = clock.to_mono(trace.last_ts_us) if trace.last_ts_us is not None else end
    return AlignedTrace(pid=pid, clock=clock, threads=threads, start_ns=start, end_ns=end,
                        interval_ns=interval_ns, samples_ns=list(obs), written_ns=max(written, end))


def signature(ev: SampleEvent) -> tuple[bool, str]:
    """What a BPF sample says about the Python code it interrupted."""
    leaf = ev.user_stack[-1] if ev.user_stack else ""
    return (bool(ev.kernel_stack), leaf)


def _stack_key(stack: Stack) -> str:
    """The Python function (leaf, line number dropped) a signature model is kept for."""
    if not stack:
        return ""
    leaf = stack[-1]
    return re.sub(r":\d+\)$", ")", leaf)


@dataclass
class JoinStats:
    """Counts of one join, by outcome (exported as metrics)."""

    matched: int = 0
    #: in a change gap and placed by the signature likelihood
    placed_likelihood: int = 0
    #: in a change gap and placed by the midpoint
    placed_midpoint: int = 0
    #: given a function py-spy did not see between two of its samples (see :func:`join`)
    placed_unseen: int = 0
    #: no py-spy trace covers the sample's time for that process
    no_trace: int = 0
    #: a trace covers the time, but py-spy never saw that thread
    no_thread: int = 0

    def add(self, other: JoinStats) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def unmatched(self) -> int:
        return self.no_trace + self.no_thread


@dataclass(frozen=True)
class JoinOptions:
    """How samples are joined with Python stacks.

    refine: choose each change point by signature likelihood (default True); else midpoint.
    unseen: with refine, let samples between two py-spy samples take a function
        py-spy saw the thread run nearby but not at either sample, when their
        signatures say so beyond the prior odds of two unseen changes (default True).
    relearn: with refine, rounds of learning the signatures again from every
        sample as placed (the first model, from the samples outside any gap,
        also holds those of functions py-spy did not see) and placing again (default 1).
    smoothing: additive smoothing of the signature model (default 0.5).
    edge_ns: how far outside a trace's first/last sample a stack is still assumed
        (default: half a py-spy interval, computed per trace when None).
    """

    refine: bool = True
    smoothing: float = 0.5
    edge_ns: int | None = None
    #: with ``refine``, also look for functions run entirely between two py-spy samples
    unseen: bool = True
    #: with ``refine``, learn the signatures again from every placed sample and place again, this many times
    relearn: int = 1


def join(events: Sequence[SampleEvent], traces: Sequence[AlignedTrace],
         options: JoinOptions | None = None) -> tuple[list[Stack | None], JoinStats]:
    """The Python stack (root first) of each event, ``None`` where there is none.

    ``traces`` may hold several (possibly overlapping) runs per process; a run
    in which the sample falls clearly inside one stack is preferred to one in
    which it falls in a change gap.
    """
    opts = options or JoinOptions()
    stats = JoinStats()
    by_pid: dict[int, list[AlignedTrace]] = defaultdict(list)
    for t in traces:
        by_pid[t.pid].append(t)
    result: list[Stack | None] = [None] * len(events)
    # (trace index, tid, segment index) -> event indices in that change gap
    gaps: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    trace_ids = {id(t): n for n, t in enumerate(traces)}
    certain: list[tuple[int, Stack]] = []  # (event index, stack) used to learn signatures
    members: dict[tuple[int, int], list[int]] = defaultdict(list)  # (trace index, tid) -> event indices
    tails: dict[tuple[int, int], list[int]] = defaultdict(list)  # the same, after the trace's last sample

    for n, ev in enumerate(events):
        best: tuple[int, AlignedTrace, int, bool] | None = None  # (rank, trace, seg, in_gap)
        covered = False
        for tr in by_pid.get(ev.tgid, ()):
            edge = opts.edge_ns if opts.edge_ns is not None else tr.interval_ns // 2
            if (opts.refine and tr.end_ns + edge < ev.ktime_ns <= tr.written_ns and tr.samples_ns
                    and tr.threads.get(ev.tid) and tr.seen(ev.tid, tr.end_ns) == len(tr.threads[ev.tid]) - 1):
                # After py-spy's last sample, before it wrote: see _tail.
                cand = (3, tr, len(tr.threads[ev.tid]) - 1, False)
                if best is None or cand[0] < best[0]:
                    best = cand
                continue
            if not (tr.start_ns - edge <= ev.ktime_ns <= tr.end_ns + edge):
                continue
            covered = True
            segs = tr.threads.get(ev.tid)
            if not segs:
                continue
            i = bisect.bisect_right(tr.los(ev.tid), ev.ktime_ns) - 1
            if i < 0:
                # Before py-spy first saw the thread: only its first sample's
                # half interval is taken as that stack.
                if ev.ktime_ns >= segs[0].hi_ns - edge:
                    cand = (1, tr, 0, False)
                else:
                    continue
            elif ev.ktime_ns >= segs[i].hi_ns or i == 0:
                cand = (0, tr, i, False)
            else:
                cand = (2, tr, i, True)
            if best is None or cand[0] < best[0]:
                best = cand
        if best is None:
            if covered:
                stats.no_thread += 1
            else:
                stats.no_trace += 1
            continue
        _, tr, i, in_gap = best
        stats.matched += 1
        if best[0] == 3:
            tails[(trace_ids[id(tr)], ev.tid)].append(n)
            continue
        if best[0] != 1:
            members[(trace_ids[id(tr)], ev.tid)].append(n)
        if in_gap:
            gaps[(trace_ids[id(tr)], ev.tid, i)].append(n)
        else:
            stack = tr.threads[ev.tid][i].stack
            result[n] = stack
            certain.append((n, stack))

    # Signature model per Python function, first from the samples outside any
    # gap; then (``relearn``) from every sample as placed, and placed again.
    vocab: set[tuple[bool, str]] = {signature(ev) for ev in events}
    alpha = opts.smoothing
    v = max(len(vocab), 1)
    base = list(result)
    labelled: list[tuple[int, Stack]] = certain
    for rnd in range(1 + max(0, opts.relearn)):
        model: dict[str, Counter[tuple[bool, str]]] = defaultdict(Counter)
        for n, stack in labelled:
            model[_stack_key(stack)][signature(events[n])] += 1
        totals = {k: sum(c.values()) for k, c in model.items()}
        if rnd == 0:
            # functions with enough samples outside any gap to tell them from noise
            known = {k for k, n in totals.items() if n >= UNSEEN_MIN_SAMPLES and k}
        pool: Counter[tuple[bool, str]] = Counter()
        for c in model.values():
            pool.update(c)
        pool_n = sum(pool.values())

        def logpool(sig: tuple[bool, str], pool: Counter[tuple[bool, str]] = pool, pool_n: int = pool_n) -> float:
            return math.log((pool[sig] + alpha) / (pool_n + alpha * v))

        def logp(key: str, sig: tuple[bool, str], model: dict[str, Counter[tuple[bool, str]]] = model,
                 totals: dict[str, int] = totals) -> float:
            c = model.get(key)
            if c is None:
                return math.log(1.0 / v)
            return math.log((c[sig] + alpha) / (totals[key] + alpha * v))

        result = list(base)
        last = rnd == max(0, opts.relearn)
        for (tix, tid, i), idxs in sorted(gaps.items()):
            tr = traces[tix]
            segs = tr.threads[tid]
            old, new = segs[i - 1], segs[i]
            idxs.sort(key=lambda n: events[n].ktime_ns)
            mid = (new.lo_ns + new.hi_ns) // 2
            k_mid = sum(1 for n in idxs if events[n].ktime_ns < mid)  # events before the midpoint
            k = k_mid
            ka, kb = _stack_key(old.stack), _stack_key(new.stack)
            if opts.refine and ka != kb and (ka in model or kb in model):
                # score(k) = sum_{<k} log P(sig|old) + sum_{>=k} log P(sig|new)
                sigs = [signature(events[n]) for n in idxs]
                score = sum(logp(kb, s) for s in sigs)
                best_score, best_k = score, 0
                for j, s in enumerate(sigs, start=1):
                    score += logp(ka, s) - logp(kb, s)
                    if score > best_score + 1e-9 or (abs(score - best_score) <= 1e-9
                                                      and abs(j - k_mid) < abs(best_k - k_mid)):
                        best_score, best_k = score, j
                k = best_k
                if last:
                    stats.placed_likelihood += len(idxs)
            elif last:
                stats.placed_midpoint += len(idxs)
            for j, n in enumerate(idxs):
                result[n] = old.stack if j < k else new.stack
        dropped = 0
        for (tix, tid), idxs in sorted(tails.items()):
            dropped += _tail(events, idxs, traces[tix].threads[tid][-1].stack, result, logp, logpool)
        if last:
            stats.matched -= dropped
            stats.no_trace += dropped
        if opts.refine and opts.unseen and model:
            moved = 0
            for (tix, tid), idxs in sorted(members.items()):
                moved += _unseen(events, idxs, traces[tix], tid, result, logp, known.__contains__)
            if last:
                stats.placed_unseen += moved
        if not opts.refine:
            break
        labelled = [(n, st) for n, st in enumerate(result) if st is not None]
    return result, stats


def _tail(events: Sequence[SampleEvent], idxs: list[int], last: Stack, result: list[Stack | None],
          logp: Callable[[str, tuple[bool, str]], float], logpool: Callable[[tuple[bool, str]], float]) -> int:
    """Samples after a trace's last py-spy sample, before py-spy wrote it.

    py-spy kept sampling without success (an exponential interval running past
    the process's exit, say): the thread is taken to have stayed in its last
    stack for as long as its samples look like that function rather than like
    any function of the run (the split point of greatest likelihood); the
    later ones keep no Python frame.  Returns how many keep none.
    """
    idxs.sort(key=lambda n: events[n].ktime_ns)
    key = _stack_key(last)
    sigs = [signature(events[n]) for n in idxs]
    score = sum(logpool(s) for s in sigs)
    best_score, best_k = score, 0
    for j, s in enumerate(sigs, start=1):
        score += logp(key, s) - logpool(s)
        if score > best_score + 1e-9:
            best_score, best_k = score, j
    for j, n in enumerate(idxs):
        result[n] = last if j < best_k else None
    return len(idxs) - best_k


#: Segments on either side of a py-spy interval whose functions may have run unseen in it.
UNSEEN_NEIGHBOURS = 3

#: Samples outside any gap a function needs before it may be found unseen.
UNSEEN_MIN_SAMPLES = 10


def _unseen(events: Sequence[SampleEvent], idxs: list[int], tr: AlignedTrace, tid: int,
            result: list[Stack | None], logp: Callable[[str, tuple[bool, str]], float],
            known: Callable[[str], bool]) -> int:
    """Let the samples between two py-spy samples take a function py-spy missed there.

    py-spy samples at exponentially distributed intervals (mean 1/rate, so a
    quarter of them are longer than 1.4/rate), so a function that runs for a
    few intervals can start and end between two of its samples and never be
    seen there.  Between samples *j-1* and *j* (stacks A and B), the samples
    may also follow A -> C -> B with C a function py-spy saw the thread run
    in a neighbouring segment; that path is taken when its signature
    likelihood beats the best one without C by more than the prior odds of
    the extra changes -- Poisson, at the rate the thread's function changed
    in this trace: (m/2) for A != B, (m^2/2) for A == B, m = rate x interval
    -- and the number of placements tried (the best of many fits better by
    chance alone).
    Returns how many samples changed.
    """
    segs = tr.threads.get(tid)
    S = tr.samples_ns
    if not segs or len(S) < 2:
        return 0
    keys = [_stack_key(s.stack) for s in segs]
    changes = sum(1 for a, b in zip(keys, keys[1:]) if a != b)
    span = max(S[-1] - S[0], 1)
    rate = max(changes, 1) / span  # per ns
    by_gap: dict[int, list[int]] = defaultdict(list)
    for n in idxs:
        j = bisect.bisect_right(S, events[n].ktime_ns)
        if 0 < j < len(S):
            by_gap[j].append(n)
    moved = 0
    for j, ns in by_gap.items():
        ia, ib = tr.seen(tid, S[j - 1]), tr.seen(tid, S[j])
        if ia < 0 or ib < 0:
            continue
        ka, kb = keys[ia], keys[ib]
        cands: dict[str, Stack] = {}
        for x in list(range(ib + 1, min(len(segs), ib + 1 + UNSEEN_NEIGHBOURS))) + \
                list(range(ia - 1, max(-1, ia - 1 - UNSEEN_NEIGHBOURS), -1)):
            # only a function with samples of its own outside any gap (not the empty
            # stack of a thread starting or ending): nothing tells another from noise
            if keys[x] not in (ka, kb) and keys[x] not in cands and known(keys[x]):
                cands[keys[x]] = segs[x].stack
        if not cands:
            continue
        ns.sort(key=lambda n: events[n].ktime_ns)
        sigs = [signature(events[n]) for n in ns]
        placed = [result[n] for n in ns]
        labels = [lb for lb in placed if lb is not None]
        if len(labels) != len(placed):
            continue
        current = sum(logp(_stack_key(lb), sg) for lb, sg in zip(labels, sigs))
        m = rate * (S[j] - S[j - 1])
        prior = math.log(m / 2) if ka != kb else 2 * math.log(m) - math.log(2)
        if prior >= 0:
            prior = 0.0
        la = [logp(ka, sg) for sg in sigs]
        lb_ = [logp(kb, sg) for sg in sigs]
        # prefix sums: A before p, C in [p, q), B from q
        pa = [0.0]
        for v in la:
            pa.append(pa[-1] + v)
        sb = [0.0]
        for v in reversed(lb_):
            sb.append(sb[-1] + v)
        sb.reverse()  # sb[q] = sum of lb_[q:]
        best: tuple[float, int, int, Stack] | None = None
        for kc, stack_c in cands.items():
            lc = [logp(kc, sg) for sg in sigs]
            pc = [0.0]
            for v in lc:
                pc.append(pc[-1] + v)
            for p in range(len(ns)):
                for q in range(p + 1, len(ns) + 1):
                    sc = pa[p] + (pc[q] - pc[p]) + sb[q]
                    if best is None or sc > best[0]:
                        best = (sc, p, q, stack_c)
        # the best of that many placements is better than the current one by chance alone
        chance = math.log(len(cands) * len(ns))
        if best is None or best[0] + prior - chance <= current:
            continue
        _, p, q, stack_c = best
        a_stack, b_stack = segs[ia].stack, segs[ib].stack
        for x, n in enumerate(ns):
            new = a_stack if x < p else stack_c if x < q else b_stack
            if new != result[n]:
                result[n] = new
                moved += 1
    return moved


# ---------------------------------------------------------------------------
# composing the mixed stack


def mixed_stack(python: Stack | None, ev: SampleEvent) -> Stack:
    """Root first: Python frames; native frames below the interpreter; kernel frames."""
    kernel = tuple(f if is_kernel_frame(f) else f + "_[k]" for f in ev.kernel_stack)
    if python is None:
        return (NO_PYTHON_FRAME,) + ev.user_stack + kernel
    return python + native_below_interpreter(ev.user_stack) + kernel


def join_events(events: Sequence[SampleEvent], traces: Sequence[AlignedTrace],
                options: JoinOptions | None = None) -> tuple[list[Stack], JoinStats]:
    """:func:`join` then :func:`mixed_stack`: one mixed stack per event."""
    py, stats = join(events, traces, options)
    return [mixed_stack(p, ev) for p, ev in zip(py, events)], stats
