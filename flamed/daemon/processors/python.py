"""The daemon's mixed-mode processor: Python frames in the stacks of Python processes.

Configured by ``[processors.python]``; runs only with the BPF sampler.  Every
Python process the watcher finds is ``watch()``-ed (its samples arrive as
timestamped events) and gets a py-spy child; each drained window's events are
joined with py-spy's Python stacks (:mod:`flamed.pyspy.align`) and added to
the window's counts.  An event waits for the py-spy window that covers it, so
Python samples are stored up to one ``window_s`` (+ a drain) after they were
taken; their weights are the BPF samples', never py-spy's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flamed.daemon.processors.base import ProcessorContext, WindowProcessor
from flamed.errors import ConfigError
from flamed.pyspy.align import JoinOptions
from flamed.pyspy.mixed import MixedMode, MixedOptions
from flamed.pyspy.supervisor import MAX_RATE, Failure, PySpyOptions
from flamed.pyspy.watcher import WatchOptions
from flamed.sampling import pysource
from flamed.sampling.contract import Window


@dataclass(frozen=True)
class PythonProcessorOptions:
    """``[processors.python]``; every key optional.

    enabled: mixed mode on (default true; only ever active with the BPF sampler).
    source: where Python frames come from: "auto" (default: the BPF program reads
        them for CPython 3.8-3.13, see sampling.python_frames; py-spy only for the
        processes it cannot read), "bpf" (never py-spy) or "pyspy" (py-spy for every
        Python process, joined by time, as before the BPF walker).
    pyspy: py-spy binary ("" = next to flamed's python, else PATH).
    rate: py-spy samples per second per process (default 100, max 250).
    nonblocking: py-spy does not pause the target (default true).
    idle: py-spy reports idle threads too, which keeps its sample times exact (default true).
    native: py-spy's own native frames; implies blocking (default false).
    window_s: one py-spy run; Python samples are delayed by about this much (default 10).
    stop_timeout_s: how long a py-spy told to stop (SIGINT) has to write its trace
        before it is killed and counted as a timeout (default 10).
    max_processes: Python processes watched at once, a py-spy each (default 32).
    include_comm / exclude_comm: regexes on the comm ("" = none).
    include_cgroup / exclude_cgroup: regexes on the cgroup v2 path ("" = none).
    uids: only processes of these real uids (default: any).
    scan_interval: seconds between /proc scans for missed processes (default 5).
    refine: place stack changes by signature likelihood (default true).
    clock_uprobe: calibrate py-spy's clock by a uprobe on its recorder (default true).
    vm_readv_tracepoint: time py-spy's samples by its process_vm_readv calls (a
        syscall tracepoint filtered to py-spy: tens of ns per syscall host-wide;
        default false: the recorder's own calls measured more accurate).
    active_min_samples: a Python process gets py-spy once a window counts this
        many of its samples (default 1): idle interpreters cost nothing.
    idle_windows: windows without a sample before its py-spy is stopped (default 6).
    """

    enabled: bool = True
    source: str = "auto"
    pyspy: str = ""
    rate: int = 100
    nonblocking: bool = True
    idle: bool = True
    native: bool = False
    window_s: float = 10.0
    stop_timeout_s: float = 10.0
    max_processes: int = 32
    include_comm: str = ""
    exclude_comm: str = ""
    include_cgroup: str = ""
    exclude_cgroup: str = ""
    uids: tuple[int, ...] = ()
    scan_interval: float = 5.0
    refine: bool = True
    clock_uprobe: bool = True
    vm_readv_tracepoint: bool = False
    active_min_samples: int = 1
    idle_windows: int = 6

    def __post_init__(self) -> None:
        # Checked when the config is read (start, reload, --check-config), not
        # when mixed mode starts: by then the BPF program has compiled, and a
        # reload has already stopped the running py-spy children.
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"processors.python.{key}: {getattr(self, key)!r} {why}")

        if self.source not in pysource.POLICIES:
            raise bad("source", "must be auto, bpf or pyspy")
        if not 1 <= self.rate <= MAX_RATE:
            raise bad("rate", f"is out of range: py-spy samples 1..{MAX_RATE} times a second")
        if self.window_s <= 0:
            raise bad("window_s", "must be > 0 seconds (one py-spy run)")
        if not self.stop_timeout_s > 0:  # also false for nan
            raise bad("stop_timeout_s", "must be > 0 seconds")
        if self.scan_interval <= 0:
            raise bad("scan_interval", "must be > 0 seconds")
        for key in ("max_processes", "active_min_samples", "idle_windows"):
            if getattr(self, key) < 1:
                raise bad(key, "must be at least 1")
        for key in ("include_comm", "exclude_comm", "include_cgroup", "exclude_cgroup"):
            try:
                re.compile(getattr(self, key))
            except re.error as e:
                raise bad(key, f"is not a regular expression: {e}") from None
        try:
            self.mixed()
        except ConfigError as e:
            raise ConfigError(f"processors.python: {e}") from None

    def mixed(self) -> MixedOptions:
        return MixedOptions(
            pyspy=PySpyOptions(binary=self.pyspy or None, rate=self.rate, nonblocking=self.nonblocking,
                               idle=self.idle, native=self.native, window_s=self.window_s,
                               first_window_s=min(1.0, self.window_s),
                               stop_timeout_s=self.stop_timeout_s, max_children=self.max_processes),
            watch=WatchOptions(include_comm=self.include_comm or None, exclude_comm=self.exclude_comm or None,
                               include_cgroup=self.include_cgroup or None,
                               exclude_cgroup=self.exclude_cgroup or None,
                               uids=frozenset(self.uids) if self.uids else None,
                               max_watched=self.max_processes, scan_interval_s=self.scan_interval),
            join=JoinOptions(refine=self.refine),
            clock=self.clock_uprobe,
            vm_readv=self.vm_readv_tracepoint,
            active_only=True,
            active_min_samples=self.active_min_samples,
            idle_windows=self.idle_windows,
        )


class PythonProcessor(WindowProcessor):
    name = "python"
    order = 10
    options_class = PythonProcessorOptions

    def __init__(self, ctx: ProcessorContext, options: PythonProcessorOptions) -> None:
        super().__init__(ctx, options)
        self.mixed: MixedMode | None = None
        self.lost_at_close = 0
        # Samples a replaced MixedMode (reload) joined when it stopped: the next window takes them.
        self._carry: list[Any] = []
        sampler_kind = getattr(getattr(ctx.config, "sampling", None), "sampler", "bpf")
        if sampler_kind != "bpf":
            ctx.log.info("mixed mode off: it needs the BPF sampler (sampling.sampler = %r)", sampler_kind)
            return
        self._start(options)
        ctx.registry.register(_Collector(self))

    def _start(self, options: PythonProcessorOptions) -> None:
        mixed = options.mixed()
        # py-spy's trace files go under the runtime directory, where the next start finds what a SIGKILL left.
        sock = getattr(getattr(self.ctx.config, "control", None), "socket", None)
        if sock:
            runtime = os.path.join(os.path.dirname(sock), "pyspy")
            mixed = replace(mixed, pyspy=replace(mixed.pyspy, workdir_parent=runtime))
        self._source = options.source
        claim, on_exit = self._sampler_hooks(self.ctx.sampler)
        self.mixed = MixedMode(self.ctx.sampler, mixed, on_exit=on_exit, claim=claim,
                               pyspy_fallback=pysource.pyspy_fallback(options.source))
        self.mixed.start()

    def _sampler_hooks(self, sampler: Any) -> tuple[pysource.ClaimFn | None, Callable[[int], None] | None]:
        """What mixed mode asks of ``sampler``: its claim on each Python process found
        (under the configured source) and the hook told of each exit."""
        forget = getattr(sampler, "forget", None)
        return pysource.claim_for(self._source, sampler), forget if callable(forget) else None

    def process(self, window: Window) -> None:
        if self._carry:
            carry, self._carry = self._carry, []
            self._add(window, carry)
        if self.mixed is not None:
            self.mixed.observe(window)
        if self.mixed is None or not window.events:
            if self.mixed is not None:
                self._add(window, self.mixed.process([]))
            return
        events, window.events = window.events, []
        self._add(window, self.mixed.process(events))

    def finish(self, window: Window) -> None:
        """The last window: stop py-spy first, so its traces (written when it
        stops) name the Python frames of every event still waiting; the ones
        no trace covers go in under the ``[python: no frame]`` placeholder."""
        if self.mixed is None:
            self.process(window)
            return
        if self._carry:
            carry, self._carry = self._carry, []
            self._add(window, carry)
        self.mixed.observe(window)
        events, window.events = window.events, []
        joined = self.mixed.process(events)
        joined += self.mixed.close()
        self.mixed = None
        self._add(window, joined)

    @staticmethod
    def _add(window: Window, joined: list[Any]) -> None:
        counts = window.counts
        for ev, stack in joined:
            key = (ev.tgid, ev.tid, ev.comm, stack)
            counts[key] = counts.get(key, 0) + 1

    def reload(self, options: Any, config: Any) -> None:
        """New options: a new MixedMode with them (already validated).

        The old one stops its py-spy children first and joins what it holds
        (carried into the next window); the running Python processes are
        found again by the new one's /proc scan and get py-spy with the new
        options as soon as a window sees them on a CPU.
        """
        if options != self.options and self.mixed is not None:
            self._carry += self.mixed.close()
            self.mixed = None
            self.options = options
            self._start(options)
        self.options = options

    def sampler_changed(self, sampler: Any) -> None:
        super().sampler_changed(sampler)
        if self.mixed is not None:
            claim, on_exit = self._sampler_hooks(sampler)
            self.mixed.replace_sampler(sampler, claim=claim, on_exit=on_exit)

    def status(self) -> dict[str, Any]:
        if self.mixed is None:
            return {"active": False}
        m = self.mixed.metrics()
        return {"active": True, "processes": sorted(self.mixed.processes), **m}

    def close(self) -> None:
        # After finish() nothing is left; a close without it (start failed) loses what was held.
        self.lost_at_close += len(self._carry)
        self._carry = []
        if self.mixed is not None:
            self.lost_at_close += len(self.mixed.close())
            self.mixed = None


class _Collector(Collector):
    """Mixed-mode metrics, computed at scrape time."""

    def __init__(self, proc: PythonProcessor) -> None:
        self.proc = proc

    def collect(self) -> Iterator[Any]:
        mixed = self.proc.mixed
        if mixed is None:
            return
        m = mixed.metrics()
        g = GaugeMetricFamily("flamed_pyspy_children", "py-spy children running.")
        g.add_metric([], m.get("pyspy_running", 0))
        yield g
        c = CounterMetricFamily("flamed_pyspy_failures", "py-spy children that failed, by reason.",
                                labels=["reason"])
        for r in Failure:
            c.add_metric([r.value], m.get(f"pyspy_failed_{r.value}", 0))
        yield c
        c = CounterMetricFamily("flamed_pyspy_runs", "py-spy windows completed, by clock calibration.",
                                labels=["clock"])
        c.add_metric(["uprobe"], m.get("runs_calibrated", 0))
        c.add_metric(["guess"], m.get("runs_uncalibrated", 0))
        yield c
        g = GaugeMetricFamily("flamed_python_processes",
                              "Python processes found, by where their Python frames come from "
                              "(bpf, pyspy, none) and why.", labels=["source", "reason"])
        for k, v in m.items():
            if k.startswith("source_"):
                src, _, why = k[len("source_"):].partition(":")
                g.add_metric([src, why], v)
        yield g
        c = CounterMetricFamily("flamed_python_unsupported",
                                "Python processes given no Python frames because neither the BPF walker nor "
                                "py-spy reads their interpreter version, by version.", labels=["version", "reason"])
        for k, v in m.items():
            if k.startswith("watcher_unsupported_version:"):
                c.add_metric([k.partition(":")[2], "unsupported_interpreter"], v)
        yield c
        c = CounterMetricFamily("flamed_python_left_out", "Python processes not watched: max_processes reached.")
        c.add_metric([], m.get("watcher_left_out", 0) + m.get("left_out", 0))
        yield c
        c = CounterMetricFamily("flamed_python_samples", "Samples of Python processes, by join result.",
                                labels=["result"])
        for k in ("matched", "no_trace", "no_thread"):
            c.add_metric([k], m.get(f"join_{k}", 0))
        yield c
        c = CounterMetricFamily("flamed_python_pthread_ids",
                                "Python threads named by pthread id (CPython < 3.11), by whether an OS tid "
                                "was found for them (unmapped ones keep native and kernel frames only).",
                                labels=["result"])
        c.add_metric(["mapped"], m.get("pthread_ids_mapped", 0))
        c.add_metric(["unmapped"], m.get("pthread_ids_unmapped", 0))
        yield c
        g = GaugeMetricFamily("flamed_python_pending_events", "Python samples waiting for their py-spy trace.")
        g.add_metric([], m.get("pending_events", 0))
        yield g
        c = CounterMetricFamily("flamed_proc_connector_overruns", "Proc connector overflows (then /proc is scanned).")
        c.add_metric([], m.get("watcher_overruns", 0))
        yield c
