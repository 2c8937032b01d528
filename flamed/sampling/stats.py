"""The sampler's counters: what the program counts (by the names the drain
reads them under), which of them are losses, and :class:`SamplerStats`, the
running totals and last-drain figures that metrics and status show."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from flamed.sampling.unwind.tables import UnwindStats

#: Window.lost keys, in this order, always all present.
LOST_REASONS = (
    "map_full",
    "ringbuf_full",
    "kernel_stack_eexist",
    "kernel_stack_enomem",
    "kernel_stack_error",
    "kernel_stack_missing",
    "user_stack_eexist",
    "user_stack_enomem",
    "user_stack_error",
    "user_stack_missing",
    "stack_read_failed",
)
#: The reasons that drop a sample (the others degrade its stack or its path).
DROPPING_REASONS = ("map_full",)

STAT_TO_REASON = {
    "MAP_FULL": "map_full",
    "RINGBUF_FULL": "ringbuf_full",
    "KSTACK_EEXIST": "kernel_stack_eexist",
    "KSTACK_ENOMEM": "kernel_stack_enomem",
    "KSTACK_ERROR": "kernel_stack_error",
    "KSTACK_MISSING": "kernel_stack_missing",
    "USTACK_EEXIST": "user_stack_eexist",
    "USTACK_ENOMEM": "user_stack_enomem",
    "USTACK_ERROR": "user_stack_error",
    "USTACK_MISSING": "user_stack_missing",
}


#: FLAMED_STAT_PY_* counters, by the names _take_stats gives them.
PY_STATS = ("PY_SAMPLES", "PY_STACKS", "PY_NO_THREAD", "PY_NO_FRAME", "PY_READ_FAULT", "PY_TRUNCATED",
             "PY_STACKS_FULL", "PY_NS")
#: FLAMED_STAT_UW_* counters, by the names _take_stats gives them.
UW_STATS = ("UW_SAMPLES", "UW_COMPLETE", "UW_NO_TABLE", "UW_UNSUPPORTED", "UW_DEPTH", "UW_READ_FAULT",
             "UW_STACKS_FULL", "UW_FP_FRAMES", "UW_NS", "UW_TAIL_FAILED")
#: FLAMED_STAT_OFF_* counters (bpf/offcpu.bpf.c) by the names _take_stats gives
#: them, then the drain's own: waits spanning a drain whose stacks were not
#: kept (CARRY_MISSING: the record came without its start having been seen;
#: CARRY_OVERFLOW: more open waits than ``offcpu_starts``) or whose end never
#: came (CARRY_EXPIRED: the start vanished without a record, e.g. the record
#: map was full).
#: Then the program's stack counters of off-CPU waits: OFF_LOST_TO_REASON
#: (waits recorded with a stack lost at their switch-out) and OFF_FETCH_FAILED
#: (switch-outs whose stacks failed, whatever became of their wait).
OFF_LOST_TO_REASON = {
    "OFF_KSTACK_EEXIST": "kernel_stack_eexist",
    "OFF_KSTACK_ENOMEM": "kernel_stack_enomem",
    "OFF_KSTACK_ERROR": "kernel_stack_error",
    "OFF_KSTACK_MISSING": "kernel_stack_missing",
    "OFF_USTACK_EEXIST": "user_stack_eexist",
    "OFF_USTACK_ENOMEM": "user_stack_enomem",
    "OFF_USTACK_ERROR": "user_stack_error",
    "OFF_USTACK_MISSING": "user_stack_missing",
}
#: Switch-outs whose stack ids failed, by the ``reason`` label of
#: flamed_offcpu_switch_stack_failures_total.
OFF_FETCH_FAILED = {"OFF_FETCH_EEXIST": "eexist", "OFF_FETCH_ENOMEM": "enomem", "OFF_FETCH_ERROR": "error"}
OFF_STATS = ("OFF_SWITCHES", "OFF_STARTS", "OFF_START_FULL", "OFF_BELOW", "OFF_COUNTED", "OFF_MAP_FULL",
             "OFF_CARRIED", "OFF_CARRY_FULL", "OFF_STALE", "CARRY_MISSING", "CARRY_EXPIRED", "CARRY_OVERFLOW",
             *OFF_LOST_TO_REASON, *OFF_FETCH_FAILED)

# ---------------------------------------------------------------------------
# Counters for metrics


@dataclass
class SamplerStats:
    """Cumulative counters and last-drain figures, for metrics and status."""

    event: str = ""  # "cycles" or "cpu-clock" once started
    #: Seconds of each start-up phase: compile_s (BTF offsets, compile, maps,
    #: the verifier), attach_s (perf events, tracepoints), sampler_s (the whole start).
    startup: dict[str, float] = field(default_factory=dict)
    #: Where the BPF program came from: ``cache`` (compiled before, read back),
    #: ``child`` (compiled in a short-lived process), ``compiled`` (here).
    program: str = ""
    frequency: int = 0
    cpus: tuple[int, ...] = ()
    samples_total: int = 0  # sum of Window.samples over all drains
    #: The program's own never-reset count of samples that passed the filters,
    #: as of the last drain.  After stop() and a final drain it equals
    #: samples_total: no sample was lost or counted twice between windows.
    bpf_samples_total: int = 0
    counted_total: int = 0
    events_total: int = 0  # samples sent as events (watched processes)
    idle_total: int = 0  # idle samples skipped (include_idle=False)
    filtered_total: int = 0  # samples the filters excluded
    cgroup_filter_ids: int = 0  # cgroup ids in the BPF filter map now
    cgroup_filter_changes_total: int = 0  # filtered cgroups created, removed or re-created since start
    lost_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOST_REASONS, 0))
    drains_total: int = 0
    quiesce_timeouts: int = 0
    last_drain_seconds: float = 0.0  # whole drain, symbolization included
    last_symbolize_seconds: float = 0.0
    last_drain_cpu_seconds: float = 0.0  # CPU time of the draining thread (less than wall on a busy host)
    last_keys: int = 0  # count-map entries read in the last drain
    last_stack_ids: int = 0  # distinct stack ids read in the last drain
    last_unwound_stacks: int = 0  # distinct unwound user stacks read in the last drain
    last_stacks: int = 0  # distinct (tgid, tid, comm, stack) in the last Window
    last_events: int = 0
    count_map_fill: float = 0.0  # last_keys / max_entries
    stack_map_fill: float = 0.0  # stack ids used / stack map buckets
    max_entries: int = 0
    stack_buckets: int = 0
    symbol_processes: int = 0  # processes with a live symbol cache
    symbol_addresses: int = 0  # cached address -> frame results
    #: Process images whose maps were read when first sampled; those whose
    #: first read failed for good (gone by then, or still in exec after every
    #: try); reports the perf buffer lost (user space fell behind).
    #: The user frames of the last two are named only if alive at the drain.
    primed_total: int = 0
    prime_missed_total: int = 0
    prime_lost_total: int = 0
    prime_throttled_total: int = 0  # skipped: over prime_rate
    #: Sampled processes a drain found never read (report lost, throttled, or
    #: not sent for a reused pid and comm): read then, and handed on.
    prime_late_total: int = 0
    #: Reports of an image read already, for another thread name (not read again).
    prime_renamed_total: int = 0
    #: Second reads of a process's maps, made while it runs, after it mapped
    #: code (the program's report) or the unwinder met an address outside
    #: them (a library loaded since: dlopen, an extension module).
    prime_remapped_total: int = 0
    #: Reports of code mapped after a process was read, lost (perf buffer overrun).
    new_code_lost_total: int = 0
    #: Reports whose first read or hand-over raised (logged): the batch's others are still read.
    prime_failed_total: int = 0
    #: FLAMED_STAT_PY_* summed over drains (PY_SAMPLES, PY_STACKS, PY_NO_THREAD...).
    python_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PY_STATS, 0))
    #: FLAMED_STAT_UW_* summed over drains (UW_SAMPLES, UW_COMPLETE, UW_NO_TABLE...).
    unwind_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UW_STATS, 0))
    #: The unwinder's tables and processes (``options.unwind``), as of the last drain.
    unwind: UnwindStats | None = None
    #: Off-CPU counters summed over drains (``options.offcpu``; :data:`OFF_STATS`).
    offcpu_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OFF_STATS, 0))
    #: Waits spanning a drain whose stacks are kept in user space now.
    offcpu_carried_open: int = 0

    def copy(self) -> SamplerStats:
        c = SamplerStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        c.lost_total = dict(self.lost_total)
        c.python_total = dict(self.python_total)
        c.unwind_total = dict(self.unwind_total)
        c.offcpu_total = dict(self.offcpu_total)
        c.startup = dict(self.startup)
        c.unwind = self.unwind.copy() if self.unwind is not None else None
        return c
