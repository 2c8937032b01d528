"""What a sampler's ``stats()`` tell, into the metrics and the status.

Beyond the :class:`~flamed.sampling.contract.Sampler` protocol: the BPF
sampler reports cumulative totals (samples, priming, the Python walker, the
native unwinder).  A reload starts a new sampler whose totals begin again
from 0, so the counters here advance by what is new since the last look and
the retired samplers' sample count is carried over.
"""

from __future__ import annotations

from typing import Any

from flamed.daemon.metrics import DaemonMetrics
from flamed.sampling.stats import OFF_FETCH_FAILED, OFF_LOST_TO_REASON

#: FLAMED_STAT_PY_* totals by the ``result`` label of flamed_python_bpf_samples_total.
_PYTHON_RESULTS = (("stack", "PY_STACKS"), ("no_thread", "PY_NO_THREAD"), ("no_frame", "PY_NO_FRAME"),
                   ("read_fault", "PY_READ_FAULT"), ("truncated", "PY_TRUNCATED"),
                   ("stacks_full", "PY_STACKS_FULL"))
#: FLAMED_STAT_UW_* totals by the ``result`` label of the unwind stacks counter (and in the status).
_UNWIND_RESULTS = (("complete", "UW_COMPLETE"), ("no_table", "UW_NO_TABLE"),
                   ("unsupported_rule", "UW_UNSUPPORTED"), ("depth_limit", "UW_DEPTH"),
                   ("read_fault", "UW_READ_FAULT"), ("stacks_full", "UW_STACKS_FULL"))
#: FLAMED_STAT_OFF_* (and the drain's CARRY_*) totals by the labels of the off-CPU counters.
_OFFCPU_WAITS = (("recorded", "OFF_COUNTED"), ("carried", "OFF_CARRIED"), ("below_threshold", "OFF_BELOW"))
_OFFCPU_DROPPED = (("start_full", "OFF_START_FULL"), ("map_full", "OFF_MAP_FULL"), ("carry_full", "OFF_CARRY_FULL"),
                   ("carry_overflow", "CARRY_OVERFLOW"), ("carry_missing", "CARRY_MISSING"),
                   ("carry_expired", "CARRY_EXPIRED"))
#: The priming metric's results, by the sampler's counter of each.
PRIMING_RESULTS = (("primed", "primed_total"), ("gone", "prime_missed_total"),
                   ("lost", "prime_lost_total"), ("throttled", "prime_throttled_total"),
                   ("late", "prime_late_total"), ("renamed", "prime_renamed_total"),
                   ("remapped", "prime_remapped_total"), ("remap_lost", "new_code_lost_total"),
                   ("failed", "prime_failed_total"))


class SamplerAccounting:
    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics
        self.last: Any = None  # the sampler's stats() as of the last drain
        self._retired = 0  # BPF samples counted by samplers replaced on reload
        self._seen: dict[str, int] = {}  # the sampler's cumulative totals already counted
        #: Samples that found a map of the program full since the last drain, by the setting
        #: that sizes that map (Python frames or unwound stacks dropped: flamed/daemon/losses.py).
        self.new_full: dict[str, int] = {}
        #: What the counts in ``new_full`` are a part of, by the same setting, when it is not
        #: the window's samples: the Python walker also runs at each switch off the CPU of a
        #: Python process when off-CPU time is on, and its map fills for both.
        self.new_full_of: dict[str, int] = {}
        #: Off-CPU waits recorded (counted or carried) in the last drain's window,
        #: each with the stacks it took at its switch off the CPU (off-CPU time on;
        #: ``None`` when it is off).
        self.new_offcpu_waits: int | None = None

    def take(self, st: Any) -> None:
        """One drain's stats into the metrics; raises AttributeError, TypeError or ValueError on odd ones."""
        self.last = st  # for the status: the sampler's lock is held during drains
        self.new_full = {}
        self.new_full_of = {}
        self.new_offcpu_waits = None
        m = self.metrics
        m.symbolize_duration.observe(float(st.last_symbolize_seconds))
        m.map_fill.labels(map="counts").set(float(st.count_map_fill))
        m.map_fill.labels(map="stacks").set(float(st.stack_map_fill))
        for result, attr in PRIMING_RESULTS:
            self._advance(m.processes_primed.labels(result=result), result, int(getattr(st, attr, 0)))
        m.cgroup_filter_ids.set(int(getattr(st, "cgroup_filter_ids", 0)))
        self._advance(m.cgroup_filter_changes, "cgroup_filter", int(getattr(st, "cgroup_filter_changes_total", 0)))
        self._count_python(st)
        self._count_unwind(st)
        self._count_offcpu(st)

    def sampler_replaced(self, retired_total: int | None) -> None:
        """A reload retired the sampler whose samples (with those before it) were ``retired_total``."""
        self._retired = retired_total or 0
        self.last = None
        self._seen.clear()

    def _count_python(self, st: Any) -> None:
        totals = getattr(st, "python_total", None)
        if not isinstance(totals, dict):
            return
        for result, name in _PYTHON_RESULTS:
            n = self._advance(self.metrics.python_bpf_samples.labels(result=result), "py:" + result,
                              int(totals.get(name, 0)))
            if result == "stacks_full" and n:
                self.new_full["sampling.python_stack_map_size"] = n
        # Every walk of the window (samples and, with off-CPU time on, switches off the CPU):
        # what a full map's count is a share of.
        walks = int(totals.get("PY_SAMPLES", 0))
        last = self._seen.get("py:walks", 0)
        self.new_full_of["sampling.python_stack_map_size"] = walks - last if walks >= last else walks
        self._seen["py:walks"] = walks

    def _count_offcpu(self, st: Any) -> None:
        totals = getattr(st, "offcpu_total", None)
        if not isinstance(totals, dict) or not any(totals.values()):
            return  # off-CPU is off (every counter stays 0)
        m = self.metrics
        self._advance(m.offcpu_switches, "off:switches", int(totals.get("OFF_SWITCHES", 0)))
        for result, name in _OFFCPU_WAITS:
            self._advance(m.offcpu_waits.labels(result=result), "off:" + result, int(totals.get(name, 0)))
        for reason, name in _OFFCPU_DROPPED:
            self._advance(m.offcpu_dropped.labels(reason=reason), "offdrop:" + reason, int(totals.get(name, 0)))
        self._advance(m.offcpu_estimated, "off:stale", int(totals.get("OFF_STALE", 0)))
        for name, reason in OFF_LOST_TO_REASON.items():
            self._advance(m.offcpu_stacks_lost.labels(reason=reason), "offlost:" + reason, int(totals.get(name, 0)))
        for name, reason in OFF_FETCH_FAILED.items():
            self._advance(m.offcpu_switch_stack_failures.labels(reason=reason), "offfetch:" + reason,
                          int(totals.get(name, 0)))
        # The waits recorded: those whose stack losses are in the window's offcpu_lost.
        recorded = int(totals.get("OFF_COUNTED", 0)) + int(totals.get("OFF_CARRIED", 0))
        last = self._seen.get("off:waits_taken", 0)
        self.new_offcpu_waits = recorded - last if recorded >= last else recorded
        self._seen["off:waits_taken"] = recorded
        m.offcpu_open.set(int(getattr(st, "offcpu_carried_open", 0)))

    def _count_unwind(self, st: Any) -> None:
        totals = getattr(st, "unwind_total", None)
        if not isinstance(totals, dict):
            return
        m = self.metrics
        for result, name in _UNWIND_RESULTS:
            n = self._advance(m.unwind_stacks.labels(result=result), "uw:" + result, int(totals.get(name, 0)))
            if result == "stacks_full" and n:
                self.new_full["sampling.unwind_stack_map_size"] = n
        self._advance(m.unwind_fp_frames, "uw:fp", int(totals.get("UW_FP_FRAMES", 0)))
        u = getattr(st, "unwind", None)
        if u is None:
            return
        m.unwind_rows.labels(state="used").set(u.rows_used)
        m.unwind_rows.labels(state="capacity").set(u.rows_capacity)
        m.unwind_binaries.set(u.binaries)
        m.unwind_processes.set(u.processes)
        for reason, v in u.skipped.items():
            self._advance(m.unwind_skipped.labels(reason=reason), "uwskip:" + reason, int(v))
        self._advance(m.unwind_built.labels(source="built"), "uwb:built", int(u.tables_built))
        self._advance(m.unwind_built.labels(source="cache"), "uwb:cache", int(u.tables_cached))

    def _advance(self, counter: Any, key: str, v: int) -> int:
        """Advance ``counter`` to a cumulative total (a new sampler after a reload starts again
        from 0); what it advanced by."""
        last = self._seen.get(key, 0)
        n = v - last if v >= last else v
        counter.inc(n)
        self._seen[key] = v
        return n

    def bpf_samples_total(self, st: Any) -> int | None:
        """Samples the BPF program(s) counted since start (its never-reset counter), if ``st`` tells."""
        try:
            return None if st is None else self._retired + int(st.bpf_samples_total)
        except (AttributeError, TypeError, ValueError):
            return None

    def unwind_status(self) -> dict[str, Any] | None:
        """The native unwinder as of the last drain: stacks by how they ended, tables, memory."""
        st: Any = self.last
        u = getattr(st, "unwind", None)
        if u is None:
            return None
        t = st.unwind_total
        return {
            "stacks": {result: t[name] for result, name in _UNWIND_RESULTS},
            "processes": u.processes, "binaries": u.binaries,
            "rows": {"used": u.rows_used, "capacity": u.rows_capacity},
            "tables": {"built": u.tables_built, "cached": u.tables_cached,
                       "build_seconds": round(u.build_seconds, 3)},
            "skipped": dict(u.skipped), "resets": u.resets,
            "evicted": {"tables": u.evicted, "rows": u.evicted_rows},
            "largest": [{"binary": name, "rows": rows, "idle_s": idle} for name, rows, idle in u.largest],
        }

    def symbol_cache_stats(self) -> dict[str, int] | None:
        """Per-process symbol caches of the sampler (fault tests count them before and after churn)."""
        st: Any = self.last  # as of the last drain: status must not wait for one
        if st is None:
            return None
        try:
            return {"processes": int(st.symbol_processes), "addresses": int(st.symbol_addresses)}
        except (AttributeError, TypeError, ValueError):
            return None
