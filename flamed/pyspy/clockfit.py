"""Calibrating py-spy's chrometrace clock, and when py-spy sampled.

``bpf/pyspy_clock.bpf.c`` puts a uprobe on py-spy's ``Chrometrace::increment``
(:mod:`flamed.pyspy.clock`): each hit is the same instant as the
``Instant::now()`` that stamps the events written by that call, in
CLOCK_MONOTONIC.  The offset is the one at which the trace's changes meet
the hits in the greatest number, first searched between py-spy's spawn and
what the first hit allows (that hit may be py-spy's first call or a later
one), then fixed to about a microsecond where the pairs are densest
(:func:`fit_clock`); an offset too few changes agree on is no calibration.
The hits, one per thread per sample, are also the times py-spy sampled
(:func:`sample_times`).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flamed.pyspy.chrometrace import PyTrace


@dataclass(frozen=True, slots=True)
class ClockFit:
    """CLOCK_MONOTONIC ns of py-spy's ``ts == 0``; ``calibrated`` False means a guess."""

    start_ns: int
    calibrated: bool
    #: changes with a hit within MATCH_NS of their time at the chosen offset
    #: (what :func:`flamed.pyspy.align.align_trace` places by their own call)
    matched: int = 0
    #: spread (max - min) of the per-event offsets used, ns: about 1000 when healthy
    spread_ns: int = 0
    #: changes that fall between the first and the last hit at that offset: each
    #: was written by a call the uprobe saw, so each should be matched
    expected: int = 0
    #: where the first hit alone puts ``ts == 0`` (right only when the uprobe saw
    #: py-spy's first call); ``start_ns - anchor_ns`` is how far the fit moved it
    anchor_ns: int = 0

    def to_mono(self, ts_us: int) -> int:
        return self.start_ns + ts_us * 1000


#: Where py-spy's recorder clock starts relative to its spawn when nothing
#: better is known (a prototype measured 18-33 ms).
SPAWN_TO_START_GUESS_NS = 25_000_000

#: A fit needs this many changes paired with their own call (or every change
#: that should pair, when there are fewer) ...
MIN_MATCHED = 3
#: ... and at least this share of the changes that should pair.
MIN_MATCHED_SHARE = 0.5
#: How close to its time a change's hit must be to count as its own call: the
#: clock read of ``increment`` follows the uprobe's by 1 us mostly, but by up to
#: 70 us now and then (measured: 9 of 24 changes of a healthy run within the
#: densest 3 us, all 24 within 75 us).  Samples are at least SAMPLE_GAP_NS apart.
MATCH_NS = 75_000

#: The search for the offset pairs at most this many (change, hit) candidates:
#: a subset of the changes when the hits are dense (many threads) or the
#: offset is loosely bounded (a py-spy slow to attach).
SEARCH_PAIRS = 200_000
#: Changes the search uses at least (when there are that many).
SEARCH_MIN_CHANGES = 32


def fit_clock(trace: PyTrace, hits_ns: Sequence[int], *, spawn_ns: int | None = None,
              interval_ns: int = 10_000_000) -> ClockFit:
    """Fit py-spy's chrometrace clock to CLOCK_MONOTONIC from its uprobe hits.

    ``hits_ns``: sorted CLOCK_MONOTONIC times of ``Chrometrace::increment``
    calls of this py-spy process, ideally all of them from its first; a
    uprobe that saw py-spy only from some later call is allowed for.
    ``spawn_ns``: when py-spy was started (its recorder clock starts later).
    Without hits, or when no offset pairs enough changes with hits, falls back
    to ``spawn_ns`` + 25 ms (``calibrated=False``).
    """
    if trace.first_ts_us is None:
        return ClockFit(start_ns=spawn_ns or 0, calibrated=False)
    guess = (spawn_ns or 0) + SPAWN_TO_START_GUESS_NS
    if not hits_ns:
        return ClockFit(start_ns=guess, calibrated=False)
    # When the uprobe saw py-spy's first increment call, the first hit and the
    # first event are the same call (the first call always writes events: every
    # stack is new), which puts the offset within a millisecond, as a
    # rule: that call's clock read is slow (15-600 us; once 3.1 ms, measured).
    # And nothing makes the first hit that call: a uprobe attached while py-spy
    # already sampled sees only later calls, and the first hit then puts every
    # stack one or more samples late.  So the offset is searched for between
    # py-spy's spawn (its recorder is created after the exec) and the first hit
    # (the recorder exists before any call), as the one at which the most
    # changes meet a hit.
    anchor = hits_ns[0] - trace.first_ts_us * 1000
    changes = trace.change_ts_us
    window = max(interval_ns // 4, 200_000)
    if not changes:
        return ClockFit(start_ns=anchor, calibrated=True, anchor_ns=anchor)
    hi = max(anchor + window, hits_ns[0])
    lo = hits_ns[0] - changes[-1] * 1000 - window  # below: every change before the first hit
    if spawn_ns is not None and spawn_ns <= hits_ns[0]:
        lo = max(lo, spawn_ns - window)
    lo = min(lo, anchor - window)
    coarse = _search(changes, hits_ns, lo, hi)
    if coarse is None:
        return ClockFit(start_ns=guess if spawn_ns is not None else anchor, calibrated=False, anchor_ns=anchor)
    # Each change event is matched with every hit near the offset found.  One
    # of them is the call that wrote it: those pairs all share the offset
    # (start + r - delay, r in [0, 1 us) from the truncation to microseconds,
    # delay the ~1 us from the uprobe to Instant::now()).  The other pairs are
    # the increments of the sample's other threads, 10-100 us before or after,
    # and scatter.  So the offset is where the pairs are densest -- not their
    # median, which such neighbours pull by a thread's spacing (measured:
    # 15-25 us off, enough to put a change in the sample before its own).
    offsets: list[int] = []
    nearest: list[int] = []
    for ts in changes:
        want = coarse + ts * 1000
        i = bisect.bisect_left(hits_ns, want - window)
        best: int | None = None
        while i < len(hits_ns) and hits_ns[i] <= want + window:
            offsets.append(hits_ns[i] - ts * 1000)
            if best is None or abs(hits_ns[i] - want) < abs(best - want):
                best = hits_ns[i]
            i += 1
        if best is not None:
            nearest.append(best - ts * 1000)
    offsets.sort()
    lo_i, hi_i = _densest(offsets, CLOCK_PEAK_NS)
    peak = offsets[lo_i:hi_i]
    med = peak[len(peak) // 2]
    start = med - 500
    # The changes between the first and the last hit: the calls that wrote them were seen.
    first_ts = (hits_ns[0] - start - MATCH_NS) // 1000
    last_ts = (hits_ns[-1] - start + MATCH_NS) // 1000
    expected = bisect.bisect_right(changes, last_ts) - bisect.bisect_left(changes, first_ts)
    matched = _matched(changes, hits_ns, start)
    if matched < min(MIN_MATCHED, expected) or matched < MIN_MATCHED_SHARE * expected:
        # No offset at which the changes meet their calls: the hits are not
        # this trace's, or too many are missing.  Any offset would be a
        # coincidence; the spawn time is at least off by a bounded amount.
        return ClockFit(start_ns=guess if spawn_ns is not None else start, calibrated=False, matched=matched,
                        expected=expected, anchor_ns=anchor)
    return ClockFit(start_ns=start, calibrated=True, matched=matched,
                    spread_ns=(nearest and max(nearest) - min(nearest)) or 0, expected=expected,
                    anchor_ns=anchor)


def _search(changes: Sequence[int], hits_ns: Sequence[int], lo: int, hi: int) -> int | None:
    """The offset in ``[lo, hi]`` at which the most changes (us) meet a hit (ns).

    Every (change, hit) pair within the bounds votes for its offset; the
    densest MATCH_NS of votes wins: at the right offset every change
    whose call the uprobe saw votes, at any other only coincidences do
    (py-spy's timer draws exponential intervals, so its samples have no
    period for a wrong offset to line up with).  With dense hits or wide
    bounds, an evenly spread subset of the changes votes.
    """
    span = max(hits_ns[-1] - hits_ns[0], 1)
    per_change = 1 + len(hits_ns) * min(hi - lo, span) // span
    k = max(SEARCH_MIN_CHANGES, SEARCH_PAIRS // per_change)
    step = max(1, -(-len(changes) // k))
    votes: list[int] = []
    for ts in changes[::step]:
        base = ts * 1000
        i = bisect.bisect_left(hits_ns, lo + base)
        j = bisect.bisect_right(hits_ns, hi + base)
        votes.extend(h - base for h in hits_ns[i:j])
    if not votes:
        return None
    votes.sort()
    a, b = _densest(votes, MATCH_NS)
    return votes[(a + b - 1) // 2]


def _matched(changes: Sequence[int], hits_ns: Sequence[int], start_ns: int) -> int:
    """Changes (us) with a hit within MATCH_NS of ``start_ns + ts``."""
    n = 0
    for ts in changes:
        at = start_ns + ts * 1000
        i = bisect.bisect_left(hits_ns, at - MATCH_NS)
        if i < len(hits_ns) and hits_ns[i] <= at + MATCH_NS:
            n += 1
    return n


#: Width of the offset peak of :func:`fit_clock`: truncation to microseconds
#: plus the uprobe's own jitter.
CLOCK_PEAK_NS = 3_000


def _densest(values: Sequence[int], width: int) -> tuple[int, int]:
    """``[lo, hi)`` of the most values of sorted ``values`` within ``width`` of each other.

    Ties go to the earliest such run.
    """
    best = (0, 0)
    j = 0
    for i in range(len(values)):
        while values[i] - values[j] > width:
            j += 1
        if i + 1 - j > best[1] - best[0]:
            best = (j, i + 1)
    return best


#: Increment calls of one sample (one per thread) follow each other within
#: microseconds; a py-spy catching up after a late wakeup takes samples back to
#: back, but each costs it a read of the target, hundreds of microseconds.
SAMPLE_GAP_NS = 150_000

#: A sample incremented less than this after the previous one may have
#: waited in py-spy's queue (see :func:`align_trace`).
QUEUED_NS = 500_000

#: Bursts around which the usual number of increments per sample is counted.
_LOCAL_BURSTS = 10


def sample_times(hits_ns: Sequence[int], interval_ns: int) -> list[int]:
    """Start of each py-spy sample: its first increment call (one call per thread).

    Calls closer than SAMPLE_GAP_NS form a burst.  With ``--idle`` every
    sample has one call per thread, so the usual burst size (the most common
    one among the neighbouring bursts) is the number of threads, and it
    corrects the bursts that are not one sample: py-spy's main thread,
    preempted between two calls of one sample (measured: 0.15-2.7 ms, in 4-7 %
    of the samples of a busy 2-CPU host), leaves two short bursts, joined again
    here when they fit in one sample and are less than half an interval
    apart; samples taken back to back to catch up leave one long burst, cut
    here into samples of the usual size.
    """
    return [s[0] for s in sample_spans(hits_ns, interval_ns)]


def sample_spans(hits_ns: Sequence[int], interval_ns: int) -> list[list[int]]:
    """The increment calls of each py-spy sample (see :func:`sample_times`)."""
    gap = min(interval_ns // 2, SAMPLE_GAP_NS)
    bursts: list[list[int]] = []
    for h in hits_ns:
        if bursts and h - bursts[-1][-1] <= gap:
            bursts[-1].append(h)
        else:
            bursts.append([h])
    sizes = [len(b) for b in bursts]
    out: list[list[int]] = []
    i = 0
    while i < len(bursts):
        lo = max(0, i - _LOCAL_BURSTS)
        usual = Counter(sizes[lo:i + _LOCAL_BURSTS + 1]).most_common(1)[0][0]
        cur = list(bursts[i])
        while (len(cur) < usual and i + 1 < len(bursts) and len(cur) + len(bursts[i + 1]) <= usual
               and bursts[i + 1][0] - cur[-1] < interval_ns // 2):
            i += 1
            cur.extend(bursts[i])
        if len(cur) > usual and len(cur) % usual == 0:
            out.extend(cur[k:k + usual] for k in range(0, len(cur), usual))
        else:
            out.append(cur)
        i += 1
    return out


def _bursts(times: Sequence[int], gap: int) -> list[int]:
    out: list[int] = []
    prev: int | None = None
    for h in times:
        if prev is None or h - prev > gap:
            out.append(h)
        prev = h
    return out


def observed_times(samples_ns: Sequence[int], reads_ns: Sequence[int], interval_ns: int) -> list[int]:
    """When each sample (an increment burst) actually read the stacks.

    ``reads_ns``: the py-spy process's process_vm_readv calls.  Each sample is
    one burst of reads followed, after a queueing delay, by its increment
    burst; they pair up in order.  A read burst more than one interval older
    than the next increment while a later burst also precedes it had no
    increments (a failed sample) and is skipped.  Samples with no read burst
    keep their increment time.
    """
    bursts = _bursts(reads_ns, interval_ns // 2)
    out: list[int] = []
    b = 0
    for s in samples_ns:
        while (b + 1 < len(bursts) and bursts[b + 1] <= s and s - bursts[b] > interval_ns):
            b += 1
        if b < len(bursts) and bursts[b] <= s:
            out.append(bursts[b])
            b += 1
        else:
            out.append(s)
    return out


def hits_by_pid(hits: Iterable[tuple[int, int]]) -> Mapping[int, list[int]]:
    """``[(tgid, ktime_ns)]`` -> sorted times per tgid."""
    out: dict[int, list[int]] = defaultdict(list)
    for tgid, t in hits:
        out[tgid].append(t)
    for v in out.values():
        v.sort()
    return out
