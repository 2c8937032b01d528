"""A tracemalloc diff across the daemon's drains (diagnosis only; docs/bpf.md,
"What survives a drain").

With this directory on ``PYTHONPATH`` and ``FLAMED_MEMTRACE=PREFIX`` set, a
Python process starts tracemalloc (8 frames a trace) and, once
``flamed.daemon.loop`` is imported, wraps ``DrainLoop.drain_once``: after each
drain (and a ``gc.collect()``) it writes ``PREFIX.N`` with the traced heap,
the traced peak since the last drain, the largest lines, and the diff
against the previous drain's snapshot by traceback.  It slows every
allocation: figures of time and RSS from such a run are not the daemon's.

    FLAMED_MEMTRACE=/tmp/memtrace/t PYTHONPATH=bench/memtrace sudo -E .venv/bin/python \\
        bench/drain_scale.py --kinds python --daemon --daemon-only --daemon-windows 2 --sizes 100000 --no-peer

``FLAMED_MALLOCSTATS=PREFIX`` instead (no tracemalloc, so the figures are
the daemon's): after each drain ``PREFIX.N`` gets VmRSS and CPython's
allocator statistics (``sys._debugmallocstats()``: arenas allocated and
reclaimed, bytes in use in them), which tell memory the allocator keeps
from memory glibc keeps, and the bytes of the snapshot ring's arrays (its
table's and its windows').

``FLAMED_MEMPEAK=PREFIX``: tracemalloc again, and a thread that takes a
snapshot each time the traced heap passes its highest so far by 4 MB;
after each drain ``PREFIX.N`` gets the largest lines and tracebacks of the
last such snapshot: what is alive at the peak (inside a drain, or between
drains), which is what sets how many arenas the allocator keeps.
"""

import os
import sys
import threading
import time


#: The daemon's DrainLoop, once it has drained (for _ring_sizes).
_loop: list = [None]


def _ring_sizes() -> str:
    """What the snapshot ring's table and windows take, in bytes of their arrays."""
    loop = _loop[0]
    ring = getattr(loop, "ring", None)
    if ring is None:
        return "ring: not seen\n"
    t = ring._table
    slots, _mask = t._index
    size = lambda a: a.buffer_info()[1] * a.itemsize  # noqa: E731
    windows = [w.counts for w in list(ring._windows)]
    entries = sum(len(c) for c in windows)
    win_bytes = sum(size(c._state[1]) + size(c._state[2]) for c in windows if hasattr(c, "_state"))
    return (f"ring: {len(t)} stacks, {len(t.tasks)} tasks, {len(t.frames)} frames; blob {len(t._blob)} B, "
            f"offs {size(t._offs)} B, hashes {size(t._hashes)} B, index {size(slots)} B; "
            f"{len(windows)} windows, {entries} entries, {win_bytes} B; sweeps {ring.sweeps}\n")


def _mallinfo() -> str:
    """glibc's malloc totals (mallinfo2): bytes in use against bytes held, main heap and mmapped."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        mi = libc.mallinfo2()
    except (OSError, AttributeError):
        return "malloc: no mallinfo2\n"
    return (f"malloc (all arenas): held {mi.arena} B, in use {mi.uordblks} B, free {mi.fordblks} B "
            f"in {mi.ordblks} chunks; mmapped {mi.hblkhd} B in {mi.hblks}\n")


def _after_each_drain(hook) -> None:  # type: ignore[no-untyped-def]
    """Call ``hook(n)`` after the daemon's n-th drain (n from 1): wraps
    ``DrainLoop.drain_once`` once ``flamed.daemon.loop`` is imported."""
    count = [0]

    def patch() -> None:
        cls = sys.modules["flamed.daemon.loop"].DrainLoop
        orig = cls.drain_once

        def drain_once(self, *a, **k):  # type: ignore[no-untyped-def]
            orig(self, *a, **k)
            _loop[0] = self
            count[0] += 1
            hook(count[0])

        cls.drain_once = drain_once

    def wait() -> None:
        while not hasattr(sys.modules.get("flamed.daemon.loop"), "DrainLoop"):
            time.sleep(0.05)
        patch()

    threading.Thread(target=wait, daemon=True).start()


def _write_tracebacks(f, stats) -> None:  # type: ignore[no-untyped-def]
    """tracemalloc statistics (or differences) with the last 8 frames of each one's traceback."""
    for s in stats:
        f.write(f"{s}\n")
        for line in s.traceback.format()[-8:]:
            f.write(f"    {line}\n")


if os.environ.get("FLAMED_MEMTRACE"):
    import gc
    import tracemalloc

    tracemalloc.start(8)
    _prev: list = [None]

    def _trace(n: int) -> None:
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        cur, peak = tracemalloc.get_traced_memory()
        with open(f"{os.environ['FLAMED_MEMTRACE']}.{n}", "w") as f:
            f.write(f"traced {cur / 1e6:.1f} MB peak {peak / 1e6:.1f}\n")
            for s in snap.statistics("lineno")[:40]:
                f.write(f"{s}\n")
            if _prev[0] is not None:
                f.write("\n--- diff vs previous drain (traceback)\n")
                _write_tracebacks(f, snap.compare_to(_prev[0], "traceback")[:25])
        _prev[0] = snap
        tracemalloc.reset_peak()

    _after_each_drain(_trace)


if os.environ.get("FLAMED_MALLOCSTATS"):

    def _mallocstats(n: int) -> None:
        path = f"{os.environ['FLAMED_MALLOCSTATS']}.{n}"
        with open("/proc/self/status") as st:
            rss = [ln for ln in st if ln.startswith(("VmRSS", "VmHWM"))]
        maps = []
        with open("/proc/self/smaps") as sm:
            head = ""
            for ln in sm:
                first = ln.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):
                    head = ln.strip()
                elif first == "Rss:":
                    maps.append((int(ln.split()[1]), head))
        maps.sort(reverse=True)
        with open(path, "w") as f:
            f.writelines(rss)
            f.write(_ring_sizes())
            f.write(_mallinfo())
            f.write(f"mappings {len(maps)}, 1 MiB anonymous ones (allocator arenas) "
                    f"{sum(kb for kb, h in maps if len(h.split()) == 5)} kB resident in unnamed mappings\n")
            for kb, h in maps[:25]:
                f.write(f"{kb:>8} kB  {h}\n")
            f.flush()
            saved = os.dup(2)
            try:
                os.dup2(f.fileno(), 2)
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)

    _after_each_drain(_mallocstats)


if os.environ.get("FLAMED_MEMPEAK"):
    import tracemalloc

    tracemalloc.start(8)
    _best: list = [0, None]  # traced bytes, snapshot at that moment

    def _watch() -> None:
        # A snapshot whenever the traced heap passes its highest so far by 4 MB:
        # what a drain holds at its peak, not what it leaves.
        while True:
            time.sleep(0.1)
            cur, _peak = tracemalloc.get_traced_memory()
            if cur > _best[0] + 4_000_000:
                _best[:] = [cur, tracemalloc.take_snapshot()]

    threading.Thread(target=_watch, daemon=True).start()

    def _peak(n: int) -> None:
        cur, peak = tracemalloc.get_traced_memory()
        with open(f"{os.environ['FLAMED_MEMPEAK']}.{n}", "w") as f:
            f.write(f"traced now {cur / 1e6:.1f} MB, peak {peak / 1e6:.1f} MB, "
                    f"snapshot at {_best[0] / 1e6:.1f} MB\n")
            if _best[1] is not None:
                snap = _best[1].filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
                for s in snap.statistics("lineno")[:30]:
                    f.write(f"{s}\n")
                f.write("\n--- by traceback\n")
                _write_tracebacks(f, snap.statistics("traceback")[:12])
        _best[:] = [cur, None]
        tracemalloc.reset_peak()

    _after_each_drain(_peak)
