"""The daemon's Prometheus metrics, in a registry of their own.

A custom :class:`~prometheus_client.CollectorRegistry` (not the library's
global one) so tests can build many daemons in one process and so processors
(mixed mode) register their metrics next to ours: ``ctx.registry``.

Names follow the Prometheus conventions: ``flamed_`` prefix, base units
(seconds, bytes), ``_total`` on counters, ``_info`` for the build info.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import selectors
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client import ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from flamed import __version__
from flamed.daemon.config import MetricsConfig, parse_address
from flamed.errors import FlamedError
from flamed.loopback import REFUSED, host_allowed
from flamed.sampling.memory import memory_by_part_cached

log = logging.getLogger("flamed.daemon")

# Drains of big maps take seconds; small ones milliseconds.
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DaemonMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        if process:
            # process_cpu_seconds_total, process_resident_memory_bytes, open fds...
            ProcessCollector(registry=r)
        self.build_info = Info("flamed_build", "Version of the running flamed daemon.", registry=r)
        import platform

        self.build_info.info({"version": __version__, "python": platform.python_version()})
        self.samples = Counter("flamed_samples", "Samples taken by the sampler.", registry=r)
        self.samples_lost = Counter(
            "flamed_samples_lost", "Samples or stacks lost, by reason.", ["reason"], registry=r
        )
        self.drains = Counter("flamed_drains", "Drains of the sampler.", registry=r)
        self.drain_errors = Counter("flamed_drain_errors", "Drains that raised an error.", registry=r)
        self.unique_stacks = Gauge(
            "flamed_drain_unique_stacks", "Unique (task, stack) keys in the last drained window.", registry=r
        )
        self.drain_duration = Histogram(
            "flamed_drain_duration_seconds",
            "Time to drain and symbolize one window.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.symbolize_duration = Histogram(
            "flamed_symbolize_duration_seconds",
            "Part of the drain spent symbolizing stacks (as reported by the sampler).",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.drain_lateness = Histogram(
            "flamed_drain_lateness_seconds",
            "How late a scheduled drain started.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.map_fill = Gauge(
            "flamed_bpf_map_fill_ratio", "Entries used over capacity of a BPF map at the last drain.", ["map"],
            registry=r,
        )
        self.window_seconds = Gauge(
            "flamed_last_window_seconds", "Duration of the last drained window.", registry=r
        )
        self.files_written = Counter("flamed_files_written", "Profile files written.", registry=r)
        self.bytes_written = Counter(
            "flamed_written_bytes", "Bytes of profile files and sidecars written.", registry=r
        )
        self.write_errors = Counter(
            "flamed_write_errors", "Failed writes of a profile file, by errno.", ["errno"], registry=r
        )
        self.disk_bytes = Gauge(
            "flamed_disk_bytes", "Bytes of profile files and sidecars in the state directory.", registry=r
        )
        self.disk_files = Gauge("flamed_disk_files", "Profile files in the state directory.", registry=r)
        self.retention_deletions = Counter(
            "flamed_retention_deletions", "Profile files deleted by retention, by limit.", ["reason"], registry=r
        )
        self.files_deleted = Counter(
            "flamed_files_deleted", "Profile files deleted, by reason: a retention limit (max_files, max_bytes, "
            "max_age) or disk_full (the oldest make room for the newest).", ["reason"], registry=r
        )
        self.bytes_deleted = Counter(
            "flamed_files_deleted_bytes", "Bytes of profile files and sidecars deleted, by reason.", ["reason"],
            registry=r
        )
        self.delete_errors = Counter(
            "flamed_delete_errors", "Refused deletions of a profile file (retention or a full disk), by errno: "
            "the file stays and the next oldest is deleted instead.", ["errno"], registry=r
        )
        self.samples_written = Counter(
            "flamed_samples_written", "Samples in the profile files written (the sidecars' samples).", registry=r
        )
        self.backlog_bytes = Gauge(
            "flamed_backlog_bytes", "Bytes of profile files waiting in memory for the disk.", registry=r
        )
        self.backlog_files = Gauge("flamed_backlog_files", "Profile files waiting in memory for the disk.",
                                   registry=r)
        self.processes_primed = Counter(
            "flamed_processes_primed",
            "Processes whose memory map was read when first sampled, by result: primed; gone (exited "
            "before it could be read); lost (the report was dropped, the daemon fell behind); "
            "throttled (over sampling.prime_rate reads per second); late (read by a drain); renamed (a "
            "report of an image read already); remapped (read again after a library was loaded); "
            "remap_lost (reports of code mapped that were dropped: that library may stay unnamed if its "
            "process exits before the drain); failed.",
            ["result"], registry=r,
        )
        self.cgroup_filter_ids = Gauge(
            "flamed_cgroup_filter_ids", "cgroup ids in the BPF filter map of sampling.cgroups and "
            "sampling.units (each named cgroup and those below it).", registry=r,
        )
        self.cgroup_filter_changes = Counter(
            "flamed_cgroup_filter_changes", "cgroups named by sampling.cgroups or sampling.units that appeared, "
            "went away or were re-created with a new id (a restarted unit) since the daemon started.", registry=r,
        )
        self.python_bpf_samples = Counter(
            "flamed_python_bpf_samples",
            "Samples of CPython processes whose frames the BPF program reads, by result: stack (Python "
            "frames taken); no_thread (its thread state was not found: a native thread, or one of a long "
            "thread list not reached yet; the stack shows [python: thread not found]); no_frame (no "
            "frame: idle or starting); read_fault; truncated (deeper than sampling.python_depth, outer "
            "frames cut); stacks_full (sampling.python_stack_map_size reached: no Python frames). With "
            "sampling.off_cpu the walker also runs at each switch off the CPU of those processes, counted here "
            "too: walks, not samples.",
            ["result"], registry=r,
        )
        self.unwind_stacks = Counter(
            "flamed_unwind_stacks",
            "User stacks unwound from .eh_frame tables in the BPF program, by how the walk ended: complete "
            "(the outermost frame); no_table (no table and no frame pointer to follow); unsupported_rule; "
            "depth_limit (deeper than sampling.unwind_depth); read_fault; stacks_full "
            "(sampling.unwind_stack_map_size reached: the frame-pointer stack instead). All but complete "
            "end in a [truncated: REASON] frame.",
            ["result"], registry=r,
        )
        self.unwind_fp_frames = Counter(
            "flamed_unwind_frame_pointer_frames",
            "Frames the unwinder followed by frame pointer (no table for their address: JIT code, a "
            "library loaded since the process was described).", registry=r,
        )
        self.unwind_rows = Gauge(
            "flamed_unwind_table_rows", "Rows of the unwind tables in the BPF map, by state: used, capacity "
            "(sampling.unwind_rows; 8 bytes each, preallocated).", ["state"], registry=r,
        )
        self.unwind_binaries = Gauge("flamed_unwind_binaries", "Binaries whose unwind table is loaded.", registry=r)
        self.unwind_processes = Gauge("flamed_unwind_processes", "Processes described to the unwinder.",
                                      registry=r)
        self.unwind_skipped = Counter(
            "flamed_unwind_binaries_skipped",
            "Binaries left without an unwind table, by reason: no_cfi (no .eh_frame or .debug_frame); "
            "rows_full (sampling.unwind_rows reached); error (unreadable or malformed).",
            ["reason"], registry=r,
        )
        self.unwind_built = Counter(
            "flamed_unwind_tables", "Unwind tables obtained, by source: built (parsed from the binary) or "
            "cache (read from the cache directory by build id).", ["source"], registry=r,
        )
        self.backlog_dropped = Counter(
            "flamed_backlog_dropped_files", "Unwritten files dropped because the backlog was full.", registry=r
        )
        self.last_rotation = Gauge(
            "flamed_last_rotation_timestamp_seconds", "Unix time of the last rotation (file closed).", registry=r
        )
        self.ring_windows = Gauge("flamed_ring_windows", "Windows held in memory for snapshots, by kind (cpu, offcpu): "
                                  "with off-CPU time on, each drain adds one of each.", ["kind"], registry=r)
        self.ring_windows.labels(kind="cpu")  # 0 before the first drain
        self.ring_stacks = Gauge("flamed_ring_stacks", "(task, stack) entries held in memory, of both kinds "
                                 "(what snapshot.ring_max_stacks bounds).", registry=r)
        self.requests = Counter(
            "flamed_control_requests",
            "Control-socket requests, by request type and result.",
            ["request", "result"],
            registry=r,
        )
        self.clients = Gauge("flamed_control_clients", "Control-socket clients being served.", registry=r)
        self.reloads = Counter("flamed_config_reloads", "Configuration reloads, by result.", ["result"],
                               registry=r)
        self.processor_errors = Counter(
            "flamed_processor_errors", "Window processors that raised, by processor.", ["processor"], registry=r
        )
        self.up_since = Gauge("flamed_start_time_seconds", "Unix time the daemon started.", registry=r)
        self.startup_seconds = Gauge(
            "flamed_startup_seconds", "Seconds each start-up phase took: state_dir, sampler (with sampler_compile "
            "and sampler_attach), processors, servers; ready is the whole start.", ["part"], registry=r)
        r.register(_MemoryCollector())
        self.profile_requests = Counter(
            "flamed_pprof_requests", "Requests of /debug/pprof/profile, by result: ok; bad_request; "
            "busy (over metrics.pprof_max_requests); off (metrics.pprof = false); error.", ["result"],
            registry=r,
        )
        self.profile_waiting = Gauge("flamed_pprof_waiting", "Profile requests waiting for their seconds.",
                                     registry=r)
        self.push_windows = Counter(
            "flamed_push_windows",
            "Windows pushed to Pyroscope, by result: sent; failed (the server refused it, 4xx: not "
            "retried); dropped (the queue was full, or the daemon stopped before it could be sent).",
            ["result"], registry=r,
        )
        self.push_retries = Counter("flamed_push_retries", "Push requests that failed and are retried.",
                                    registry=r)
        self.push_bytes = Counter("flamed_push_sent_bytes", "Bytes of profile bodies sent to Pyroscope.",
                                  registry=r)
        self.push_cpu = Counter("flamed_push_cpu_seconds",
                                "CPU time of the push thread: encoding the windows and sending them.", registry=r)
        self.push_queue = Gauge("flamed_push_queue_windows", "Windows waiting to be pushed.", registry=r)
        # Off-CPU ([sampling] off_cpu): the off-CPU program's counters (bpf/offcpu.bpf.c) and the drain's.
        self.offcpu_switches = Counter(
            "flamed_offcpu_switches", "Switches off a CPU of sampled tasks seen by the off-CPU program "
            "(sampling.off_cpu); one in sampling.off_cpu_every of them is followed.", registry=r,
        )
        self.offcpu_waits = Counter(
            "flamed_offcpu_waits",
            "Off-CPU waits that ended, by result: recorded (in the off-CPU profile of the window they "
            "ended in); carried (begun before a drain: added to the profile under the stack of their "
            "start once that is read, or counted in flamed_offcpu_waits_dropped_total{reason=~\"carry_.*\"}); "
            "below_threshold (shorter than sampling.off_cpu_min_us, not recorded).", ["result"], registry=r,
        )
        self.offcpu_dropped = Counter(
            "flamed_offcpu_waits_dropped",
            "Off-CPU waits lost, by reason: start_full (more waits open at once than the program can "
            "follow); map_full (more distinct off-CPU stacks in a drain interval than its map holds); "
            "carry_full and carry_overflow (more waits spanning a drain than can be carried over); "
            "carry_missing (a wait whose start was not kept); carry_expired (a wait whose end never came).",
            ["reason"], registry=r,
        )
        self.offcpu_stacks_lost = Counter(
            "flamed_offcpu_stacks_lost",
            "Off-CPU waits recorded (in the off-CPU profile, or carried to it) whose kernel or user stack "
            "was lost when they left the CPU, by reason as flamed_samples_lost_total (which counts CPU "
            "samples only): each shows as a placeholder frame in the off-CPU profile.", ["reason"], registry=r,
        )
        self.offcpu_switch_stack_failures = Counter(
            "flamed_offcpu_switch_stack_failures",
            "Switches off a CPU whose stacks could not be taken from the stack map (eexist: a hash "
            "collision; enomem: the map was full; error: another errno), taken before the wait's length "
            "is known: most of their waits end below sampling.off_cpu_min_us and are never recorded "
            "(nothing lost); those recorded are in flamed_offcpu_stacks_lost_total.", ["reason"], registry=r,
        )
        self.offcpu_estimated = Counter(
            "flamed_offcpu_waits_estimated", "Off-CPU waits whose return to a CPU was not traced: they end "
            "at the CPU's last traced switch (an estimate).", registry=r,
        )
        self.offcpu_seconds = Counter(
            "flamed_offcpu_seconds", "Seconds off the CPU recorded in off-CPU windows (all tasks).", registry=r,
        )
        self.offcpu_open = Gauge(
            "flamed_offcpu_open_waits", "Off-CPU waits spanning the last drain, carried to the next.", registry=r,
        )

    def observe_lost(self, lost: dict[str, int]) -> None:
        for reason, n in lost.items():
            if n:
                self.samples_lost.labels(reason=reason).inc(n)


class _QuietHandler(WSGIRequestHandler):
    # Seconds per read or send on a connection: a client that sends nothing or
    # never reads costs its own thread this long, nothing else.
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every 15 s is not worth a log line


#: ``seconds`` when a profile request gives none (as Go's net/http/pprof).
DEFAULT_PROFILE_SECONDS = 30.0
METRICS_PATH = "/metrics"
_SECONDS = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?", re.ASCII)
PROFILE_PATH = "/debug/pprof/profile"
#: Off-CPU time of the next N seconds (``[sampling] off_cpu``), pprof sample type off_cpu/nanoseconds.
OFFCPU_PATH = "/debug/pprof/offcpu"
#: Takes the seconds asked for and the kind (cpu, offcpu), blocks that long, returns the gzipped pprof.
ProfileSource = Callable[[float, str], bytes]


class NotRecordedError(FlamedError):
    """A profile of a kind the daemon does not record (off-CPU with ``off_cpu = false``)."""


def _plain(start_response: Callable[..., Any], status: str, body: str, *headers: tuple[str, str]) -> list[bytes]:
    """A one-line text/plain answer."""
    data = (body + "\n").encode("utf-8", "replace")
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data))),
                            *headers])
    return [data]


@dataclass(frozen=True)
class PendingListener:
    """What :meth:`MetricsServer.listen` bound, to serve on by :meth:`MetricsServer.switch`."""

    address: str
    #: The listening server; None when the running listener already has that socket address.
    server: Any
    #: The address of the running listener closed to bind this one (the same port), "" if none.
    replaced: str = ""


def _resolve(address: str) -> tuple[socket.AddressFamily, str, int]:
    """The family, host and port ``address`` binds (HTTPServer alone binds IPv4 only)."""
    host, port = parse_address(address)
    family, _, _, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0]), port


class MetricsServer:
    """The /metrics HTTP endpoint on HOST:PORT, restartable on reload.

    It also serves ``/debug/pprof/profile?seconds=N`` when a profile source
    is set and ``metrics.pprof`` is on.  Each request runs on its own thread
    (ThreadingWSGIServer), so a profile that waits N seconds, or a client that
    never reads, holds only that thread; the drain never waits for them.
    """

    def __init__(self, registry: CollectorRegistry, metrics: DaemonMetrics | None = None,
                 profile_source: ProfileSource | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.profile_source = profile_source
        self.options = MetricsConfig()
        self._profiles = 0
        self._plock = threading.Lock()
        self.address = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._wake_fd = -1

    @property
    def bound(self) -> str | None:
        """``HOST:PORT`` actually bound (the port is real even when 0 was asked), or None."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def start(self, address: str) -> None:
        """Bind ``address`` (``""`` = disabled). Raises OSError when the bind fails."""
        if address == self.address and (self._server is not None or not address):
            return
        self.stop()
        if address:
            self._serve_on(self._listen(*_resolve(address)))
        self.address = address

    def listen(self, address: str) -> PendingListener:
        """Bind ``address`` for :meth:`switch` while the running listener keeps serving
        (a reload binds first, so that an address it cannot bind refuses the reload
        and leaves the running one alone).  Raises OSError when the bind fails;
        :meth:`discard` undoes it.
        """
        family, host, port = _resolve(address)
        if self._server is not None and (family, host, port) == (
                self._server.address_family, *self._server.server_address[:2]):
            return PendingListener(address, None)  # the same socket address spelled otherwise: keep it
        try:
            return PendingListener(address, self._listen(family, host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE or self._server is None or port != self.port:
                raise
        # The same port on another host (127.0.0.1:P -> 0.0.0.0:P): the running
        # listener is in the way; closed for the bind, bound again if the bind fails.
        running = self.address
        self.stop()
        try:
            return PendingListener(address, self._listen(family, host, port), replaced=running)
        except OSError:
            self._restart(running)
            raise

    def switch(self, pending: PendingListener) -> None:
        """Serve on what :meth:`listen` bound (the running listener, if any, is closed)."""
        if pending.server is not None:
            self.stop()
            self._serve_on(pending.server)
        self.address = pending.address

    def serves(self, pending: PendingListener) -> bool:
        """:meth:`switch` to ``pending`` was done (or had nothing to do)."""
        return pending.server is None or pending.server is self._server

    def discard(self, pending: PendingListener) -> None:
        """Undo :meth:`listen`: close what it bound, and serve again where a closed listener served."""
        if pending.server is not None:
            pending.server.server_close()
        if pending.replaced:
            self._restart(pending.replaced)

    def _restart(self, address: str) -> None:
        try:
            self.start(address)
        except OSError as e:
            log.error("cannot serve metrics on %s again: %s; metrics are off until a reload binds them",
                      address, e.strerror)

    def _listen(self, family: socket.AddressFamily, host: str, port: int) -> Any:
        """A listening server on ``(host, port)``, not serving yet."""
        class _Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(host, port, self._app(make_wsgi_app(self.registry), host), _Server,
                             handler_class=_QuietHandler)
        server.timeout = 0  # handle_request() is only called when a connection waits
        return server

    def _serve_on(self, server: Any) -> None:
        self._server = server
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread = threading.Thread(target=self._serve, args=(self._server, self._wake_fd),
                                        name="flamed-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s/metrics", self.bound)

    def configure(self, options: MetricsConfig) -> None:
        """pprof settings (the address is :meth:`start`'s); applies to the next request."""
        self.options = options

    def _app(self, metrics_app: Callable[..., Iterable[bytes]], bound: str = "") -> Callable[..., Iterable[bytes]]:
        """The WSGI app of a server bound to the address ``bound``."""
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if not host_allowed(bound, environ.get("HTTP_HOST")):
                # DNS rebinding: a web page whose name resolves to 127.0.0.1 must not read
                # the metrics or the stacks of /debug/pprof (flamed/loopback.py).
                return _plain(start_response, "403 Forbidden", f"the flamed daemon's metrics server {REFUSED}")
            path = environ.get("PATH_INFO") or ""
            if path in (PROFILE_PATH, OFFCPU_PATH):
                return self._profile(environ, start_response, "offcpu" if path == OFFCPU_PATH else "cpu")
            if path.startswith("/debug/pprof"):
                # Scrapers also ask for heap, goroutine...: a clear 404, not the metrics text.
                return _plain(start_response, "404 Not Found",
                              f"{path}: not served; flamed serves {PROFILE_PATH} (CPU) and {OFFCPU_PATH} "
                              "(off-CPU time, with [sampling] off_cpu = true) only")
            if path not in (METRICS_PATH, "/"):
                # The metrics at any path (/METRICS, /foo) hid a scrape configured wrongly.
                return _plain(start_response, "404 Not Found",
                              f"{path[:200]}: not found; the metrics are at {METRICS_PATH}")
            return metrics_app(environ, start_response)

        return app

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.profile_requests.labels(result=result).inc()

    def _profile(self, environ: dict[str, Any], start_response: Callable[..., Any],
                 kind: str = "cpu") -> Iterable[bytes]:
        def text(status: str, body: str, result: str) -> list[bytes]:
            self._count(result)
            return _plain(start_response, status, body, ("X-Content-Type-Options", "nosniff"))

        opts = self.options
        source = self.profile_source
        if not opts.pprof or source is None:
            return text("404 Not Found", "profiles are off on this host (metrics.pprof = false)", "off")
        if environ.get("REQUEST_METHOD", "GET") != "GET":
            # HEAD too: its headers would cost the profile's whole wait, for nothing.
            return text("405 Method Not Allowed", "use GET (each request takes a profile of its seconds)",
                        "bad_request")
        raw = parse_qs(environ.get("QUERY_STRING", "")).get("seconds", [""])[-1]
        # Plain decimal only: float() also takes "1_0", "+1", " 1" and other scripts' digits.
        seconds = float(raw) if _SECONDS.fullmatch(raw) else float("nan") if raw else DEFAULT_PROFILE_SECONDS
        if not 0 < seconds <= opts.pprof_max_seconds:  # also false for nan
            return text("400 Bad Request", f"seconds={raw[:40]!r}: expected a number of seconds in (0, "
                        f"{opts.pprof_max_seconds:g}] (metrics.pprof_max_seconds)", "bad_request")
        with self._plock:
            if self._profiles >= opts.pprof_max_requests:
                busy = True
            else:
                busy = False
                self._profiles += 1
                if self.metrics is not None:
                    self.metrics.profile_waiting.set(self._profiles)
        if busy:
            return text("429 Too Many Requests", f"{opts.pprof_max_requests} profile requests are already "
                        "waiting (metrics.pprof_max_requests); retry later", "busy")
        try:
            data = source(seconds, kind)
        except NotRecordedError as e:
            return text("404 Not Found", str(e), "off")
        except FlamedError as e:
            return text("503 Service Unavailable", str(e), "error")
        except Exception:
            log.exception("profile request failed")
            return text("500 Internal Server Error", "internal error in the daemon (see its log)", "error")
        finally:
            with self._plock:
                self._profiles -= 1
                if self.metrics is not None:
                    self.metrics.profile_waiting.set(self._profiles)
        self._count("ok")
        start_response("200 OK", [("Content-Type", "application/octet-stream"),
                                  ("Content-Disposition", 'attachment; filename="profile"'),
                                  ("Content-Length", str(len(data))), ("X-Content-Type-Options", "nosniff")])
        return [data]

    @staticmethod
    def _serve(server: Any, wake_fd: int) -> None:
        # socketserver's serve_forever polls for shutdown twice a second;
        # this waits on the socket and stop()'s eventfd only.
        with selectors.DefaultSelector() as sel:
            sel.register(server.socket, selectors.EVENT_READ)
            sel.register(wake_fd, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fd == wake_fd:
                        return
                    server.handle_request()  # accepts and hands the request to a thread

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)
            alive = False
            if self._thread is not None:
                self._thread.join(timeout=5)
                alive = self._thread.is_alive()
            self._server.server_close()
            if not alive:
                os.close(self._wake_fd)
            self._wake_fd = -1
        self._server = None
        self._thread = None
        self.address = ""


class _MemoryCollector:
    """``flamed_memory_bytes{part}``, read at scrape time only, at most once a second (parsing smaps
    takes milliseconds: not a cost to pay at every drain)."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("flamed_memory_bytes", "The daemon's memory by part: rss (all resident), anon "
                              "(heap, caches), compiler (libLLVM/libclang pages resident), files (other "
                              "file-backed pages), bpf_maps (kernel memory of its BPF maps, not in rss).",
                              labels=["part"])
        for part, v in memory_by_part_cached().items():
            g.add_metric([part], float(v))
        yield g
