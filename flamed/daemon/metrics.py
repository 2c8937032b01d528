"""The daemon's Prometheus metrics, in a registry of their own.

A custom :class:`~prometheus_client.CollectorRegistry` (not the library's
global one) so tests can build many daemons in one process and so processors
(mixed mode) register their metrics next to ours: ``ctx.registry``.

Names follow the Prometheus conventions: ``flamed_`` prefix, base units
(seconds, bytes), ``_total`` on counters, ``_info`` for the build info.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client import ProcessCollector
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from flamed import __version__
from flamed.daemon.config import parse_address

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
        self.backlog_bytes = Gauge(
            "flamed_backlog_bytes", "Bytes of profile files waiting in memory for the disk.", registry=r
        )
        self.backlog_files = Gauge("flamed_backlog_files", "Profile files waiting in memory for the disk.",
                                   registry=r)
        self.processes_primed = Counter(
            "flamed_processes_primed",
            "Processes whose memory map was read when first sampled, by result: primed; gone (exited "
            "before it could be read); lost (the report was dropped, the daemon fell behind); "
            "throttled (over sampling.prime_rate reads per second).",
            ["result"], registry=r,
        )
        self.python_bpf_samples = Counter(
            "flamed_python_bpf_samples",
            "Samples of CPython processes whose frames the BPF program reads, by result: stack (Python "
            "frames taken); no_thread (a thread without a thread state: native threads); no_frame (no "
            "frame: idle or starting); read_fault; truncated (deeper than sampling.python_depth, outer "
            "frames cut); stacks_full (sampling.python_stack_map_size reached: no Python frames).",
            ["result"], registry=r,
        )
        self.backlog_dropped = Counter(
            "flamed_backlog_dropped_files", "Unwritten files dropped because the backlog was full.", registry=r
        )
        self.last_rotation = Gauge(
            "flamed_last_rotation_timestamp_seconds", "Unix time of the last rotation (file closed).", registry=r
        )
        self.ring_windows = Gauge("flamed_ring_windows", "Windows held in memory for snapshots.", registry=r)
        self.ring_stacks = Gauge("flamed_ring_stacks", "(task, stack) entries held in memory.", registry=r)
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

    def observe_lost(self, lost: dict[str, int]) -> None:
        for reason, n in lost.items():
            if n:
                self.samples_lost.labels(reason=reason).inc(n)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every 15 s is not worth a log line


class MetricsServer:
    """The /metrics HTTP endpoint on HOST:PORT, restartable on reload."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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
            host, port = parse_address(address)
            # The family of the address asked for (HTTPServer alone binds IPv4 only).
            family, _, _, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]

            class _Server(ThreadingWSGIServer):
                address_family = family

            self._server = make_server(str(sockaddr[0]), port, make_wsgi_app(self.registry), _Server,
                                       handler_class=_QuietHandler)
            self._server.timeout = 0  # handle_request() is only called when a connection waits
            self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._thread = threading.Thread(target=self._serve, args=(self._server, self._wake_fd),
                                            name="flamed-metrics", daemon=True)
            self._thread.start()
            log.info("metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]", self.port)
        self.address = address

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
