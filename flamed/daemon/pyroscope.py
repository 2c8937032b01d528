"""Push every window to a Grafana Pyroscope server (``POST SERVER/ingest``).

The drain only appends the window to a bounded queue (:meth:`Pusher.submit`,
a lock and a deque append); one thread of its own encodes and sends, oldest
first.  A failed request (connection refused, timeout, 5xx, 408, 429) is
retried with a doubling wait up to ``retry_max_backoff``, the window staying
at the head of the queue, so windows arrive in order.  A window the server
refuses for good (another 4xx) is counted ``failed`` and skipped.  When the
queue is full the oldest waiting window is dropped and counted ``dropped``.

Ingest parameters, as Pyroscope's HTTP API documents them: ``name``
(application name with ``{tag=value,...}``), ``from``/``until`` (Unix seconds),
``format`` (``pprof`` -- the body a multipart form with the gzipped profile in
field ``profile`` -- or ``folded``, plain lines), ``sampleRate`` (Hz),
``spyName=flamed``, ``units=samples``, ``aggregationType=sum``.

Services: a window is sent as one request per ``service_name`` of its tasks
(the systemd unit without its suffix, or the container's name or short id;
see flamed.sampling.cgroups), each tagged ``service_name=...``, so Pyroscope
keeps one series per service; tasks without one go in a request without the
tag (unless ``[pyroscope.tags]`` sets ``service_name`` itself, which then
tags every request).  A window counts once (sent, failed, dropped) whatever
its number of requests; a retried window resumes at its first unsent request.

Off-CPU windows (``[sampling] off_cpu``) are pushed as requests of their own,
same name and tags, always as pprof (folded text cannot say its unit): one
sample type ``offcpu`` in ``nanoseconds``, the name and unit Grafana Alloy's
eBPF profiler gives off-CPU profiles, without ``sampleRate`` or ``units``
(they describe samples).  See docs/fleet.md.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import re
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from flamed import __version__
from flamed.daemon.config import PyroscopeConfig
from flamed.daemon.fleet import windows_folded, windows_pprof
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.ring import RingWindow
from flamed.errors import ConfigError, FlamedError

log = logging.getLogger("flamed.daemon")

#: First wait after a failed request; it doubles up to retry_max_backoff.
FIRST_BACKOFF = 1.0
#: The pprof sample type of pushed off-CPU windows (unit: nanoseconds), as Alloy's eBPF profiler names it.
PUSH_OFFCPU_SAMPLE_TYPE = "offcpu"


class PushError(FlamedError):
    """A push request failed; ``retry`` tells whether sending it again may help,
    ``answered`` whether the server answered at all (an HTTP status)."""

    def __init__(self, message: str, *, retry: bool, answered: bool = True) -> None:
        super().__init__(message)
        self.retry = retry
        self.answered = answered


@dataclass(frozen=True)
class Target:
    """Where and how to send: the [pyroscope] table with the password read."""

    server: str
    application_name: str
    tags: Mapping[str, str]
    format: str
    timeout: float
    user: str = ""
    password: str = ""
    tenant_id: str = ""

    @classmethod
    def from_config(cls, cfg: PyroscopeConfig, host: str) -> Target:
        password = ""
        if cfg.basic_auth_password_file:
            password = read_password(cfg.basic_auth_password_file)
        tags = dict(cfg.tags)
        tags.setdefault("host", host)
        return cls(cfg.server_address.rstrip("/"), cfg.application_name, tags, cfg.format, cfg.timeout,
                   cfg.basic_auth_user, password, cfg.tenant_id)


#: Longest first line read from the password file (bounded: a wrong path such as /dev/zero stops here).
MAX_PASSWORD_LINE = 64 << 10


def read_password(path: str) -> str:
    what = "point it at a file (mode 0600) whose first line is the password"
    try:
        with open(path, "rb") as f:
            line = f.readline(MAX_PASSWORD_LINE + 1)
    except OSError as e:
        raise FlamedError(f"pyroscope.basic_auth_password_file: cannot read {path}: {e.strerror or e}; "
                          f"{what}") from None
    # What the file holds is a configuration error (exit 2: systemd does not
    # restart into it again, RestartPreventExitStatus); a file that cannot be
    # read yet (a secret not provisioned yet) is not, and a restart may find it.
    if len(line) > MAX_PASSWORD_LINE:
        raise ConfigError(f"pyroscope.basic_auth_password_file: {path}: first line longer than "
                          f"{MAX_PASSWORD_LINE >> 10} KiB; {what}")
    try:
        first = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"pyroscope.basic_auth_password_file: {path}: not UTF-8 text (byte 0x{line[e.start]:02x} "
                          f"at offset {e.start}); {what}") from None
    with contextlib.suppress(OSError):
        if os.stat(path).st_mode & 0o004:
            log.warning("pyroscope.basic_auth_password_file %s is readable by every user; chmod 600 it", path)
    return first.rstrip("\r\n")


def app_name(name: str, tags: Mapping[str, str]) -> str:
    """``name{k=v,...}`` (tags sorted: the same series every time)."""
    if not tags:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(tags.items())) + "}"


def ingest_request(target: Target, *, start_ns: int, end_ns: int, sample_rate: float | None,
                   body: bytes, kind: str = "cpu") -> urllib.request.Request:
    """The POST of one profile: URL with the ingest parameters, headers, body."""
    params: dict[str, str] = {
        "name": app_name(target.application_name, target.tags),
        "from": str(start_ns // 1_000_000_000),
        # until > from: a window shorter than a second still covers one second
        "until": str(max(-(-end_ns // 1_000_000_000), start_ns // 1_000_000_000 + 1)),
        "format": target.format,
        "sampleRate": str(int(round(sample_rate))) if sample_rate else "100",
        "spyName": "flamed",
        "units": "samples",
        "aggregationType": "sum",
    }
    if kind == "offcpu":
        # The pprof body says its sample type and unit; these two describe samples.
        del params["sampleRate"], params["units"]
    headers = {"User-Agent": f"flamed/{__version__}"}
    if target.format == "pprof":
        boundary = uuid.uuid4().hex
        data = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode() + body + f"\r\n--{boundary}--\r\n".encode()
        headers["Content-Type"] = f"multipart/form-data; boundary={boundary}"
    else:
        data = body
        headers["Content-Type"] = "text/plain; charset=utf-8"
    if target.tenant_id:
        headers["X-Scope-OrgID"] = target.tenant_id
    if target.user or target.password:
        token = base64.b64encode(f"{target.user}:{target.password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    url = f"{target.server}/ingest?{urllib.parse.urlencode(params)}"
    return urllib.request.Request(url, data=data, headers=headers, method="POST")


def send(target: Target, req: urllib.request.Request) -> None:
    """POST ``req``; raises PushError (``retry`` when sending it again may help)."""
    try:
        with urllib.request.urlopen(req, timeout=target.timeout) as r:
            r.read()
    except urllib.error.HTTPError as e:
        detail = ""
        with contextlib.suppress(Exception):
            detail = e.read(300).decode("utf-8", "replace").strip()
        retry = e.code >= 500 or e.code in (408, 429)
        raise PushError(f"{target.server}/ingest answered {e.code} {e.reason}" + (f": {detail}" if detail else ""),
                        retry=retry) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise PushError(f"cannot send to {target.server}/ingest: {reason}", retry=True, answered=False) from None


#: What a Pyroscope tag value may not hold (it would break ``name{k=v,...}``).
_BAD_TAG_CHARS = re.compile(r"[{},=\s]")


def service_parts(w: RingWindow) -> list[tuple[str | None, RingWindow]]:
    """``w`` split by the service_name of its tasks, tasks without one (None) first, then by name."""
    names = {tgid: ident.service_name for tgid, ident in w.identities.items()}
    groups: dict[str | None, dict[tuple[int, int, str, tuple[str, ...]], int]] = {}
    for key, n in w.counts.items():
        name = names.get(key[0])
        part = groups.setdefault(_BAD_TAG_CHARS.sub("_", name) if name else None, {})
        part[key] = n
    if len(groups) <= 1:
        return [(next(iter(groups), None), w)]
    order = sorted(groups, key=lambda g: (g is not None, g or ""))
    # samples/lost stay on the first part: they describe the window, not a service.
    return [(g, replace(w, counts=groups[g], samples=w.samples if i == 0 else 0, lost=w.lost if i == 0 else {}))
            for i, g in enumerate(order)]


def part_target(target: Target, service: str | None) -> Target:
    """The target of one service's request: its tags plus ``service_name`` (a configured one wins)."""
    if service is None or "service_name" in target.tags:
        return target
    return replace(target, tags={**target.tags, "service_name": service})


def encode(target: Target, windows: list[RingWindow], *, root: str, host: str) -> bytes:
    if windows and windows[0].kind == "offcpu":
        return windows_pprof(windows, root=root, host=host, sample_type=PUSH_OFFCPU_SAMPLE_TYPE)
    if target.format == "folded":
        return windows_folded(windows, root=root)
    return windows_pprof(windows, root=root, host=host)


class Pusher:
    """The queue and the thread that empties it; thread-safe."""

    def __init__(self, cfg: PyroscopeConfig, metrics: DaemonMetrics, *, host: str, root: str,
                 sender: Callable[[Target, urllib.request.Request], None] = send) -> None:
        self.metrics = metrics
        self._send = sender
        self.host = host
        self.root = root
        self.cfg = cfg
        self.target = Target.from_config(cfg, host)
        self._queue: deque[RingWindow] = deque()
        self._inflight: RingWindow | None = None
        # (window, requests of it already sent): where a retry of the head resumes
        self._resume: tuple[RingWindow | None, int] = (None, 0)
        self._cond = threading.Condition()
        self._stop = False
        self._deadline = 0.0
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.last_error = ""
        self.last_error_ns = 0
        self.last_sent_ns = 0
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="flamed-pyroscope", daemon=True)
        self._thread.start()
        log.info("pushing every window to %s/ingest as %s (%s)", self.target.server,
                 app_name(self.target.application_name, self.target.tags), self.target.format)

    def configure(self, cfg: PyroscopeConfig, root: str) -> None:
        """Reload: raises FlamedError (password file) before changing anything."""
        target = Target.from_config(cfg, self.host)
        with self._cond:
            self.cfg = cfg
            self.target = target
            self.root = root
            while self._waiting() > cfg.max_queue:
                self._drop_oldest()
            self._cond.notify_all()

    def submit(self, w: RingWindow) -> None:
        """Called by the drain: never waits for the network."""
        with self._cond:
            while self._waiting() >= self.cfg.max_queue:
                self._drop_oldest()
            self._queue.append(w)
            self.metrics.push_queue.set(self._waiting())
            self._cond.notify_all()

    def _sending(self) -> bool:
        """Is the head of the queue in flight (a request under way)?"""
        return self._inflight is not None and bool(self._queue) and self._queue[0] is self._inflight

    def _waiting(self) -> int:
        """Windows waiting: not the one in flight (it may arrive; dropping it
        as well would count it twice)."""
        return len(self._queue) - self._sending()

    def _drop_oldest(self) -> None:
        # The window being sent stays; the oldest waiting one goes.
        del self._queue[1 if self._sending() else 0]
        self.dropped += 1
        self.metrics.push_windows.labels(result="dropped").inc()
        self.metrics.push_queue.set(self._waiting())

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue or (self._stop and time.monotonic() >= self._deadline):
                    return
                w = self._queue[0]
                self._inflight = w
                target, root = self.target, self.root
            cpu0 = time.thread_time()
            try:
                parts = service_parts(w)
                first = self._resume[1] if self._resume[0] is w else 0
                for i in range(first, len(parts)):
                    service, part = parts[i]
                    part_to = part_target(target, service)
                    if w.kind == "offcpu":
                        part_to = replace(part_to, format="pprof")
                    body = encode(part_to, [part], root=root, host=self.host)
                    self._send(part_to, ingest_request(part_to, start_ns=w.start_ns, end_ns=w.end_ns,
                                                       sample_rate=w.sample_rate, body=body, kind=w.kind))
                    self.metrics.push_bytes.inc(len(body))
                    self._resume = (w, i + 1)
            except PushError as e:
                self.metrics.push_cpu.inc(time.thread_time() - cpu0)
                self._error(str(e))
                if not e.retry:
                    self._done(w, "failed")
                    backoff = 0.0
                    continue
                self.metrics.push_retries.inc()
                backoff = min(max(FIRST_BACKOFF, backoff * 2), self.cfg.retry_max_backoff)
                with self._cond:
                    self._inflight = None
                    end = time.monotonic() + backoff
                    if self._stop:
                        end = min(end, self._deadline)
                    while time.monotonic() < end:
                        self._cond.wait(end - time.monotonic())
                continue
            except Exception as e:  # a bug in encoding must not kill the thread, nor loop on the window
                log.exception("pyroscope: encoding a window failed")
                self._error(f"internal error encoding a window: {e}")
                self._done(w, "failed")
                continue
            backoff = 0.0
            self.metrics.push_cpu.inc(time.thread_time() - cpu0)
            self._done(w, "sent")

    def _done(self, w: RingWindow, result: str) -> None:
        with self._cond:
            self._inflight = None
            if self._queue and self._queue[0] is w:
                self._queue.popleft()
            else:
                return  # counted already (dropped when the daemon stopped)
            if result == "sent":
                if self._failing:
                    log.info("pyroscope push: sending again (%d window(s) queued)", len(self._queue))
                self._failing = False
                self.sent += 1
                self.last_sent_ns = time.time_ns()
            else:
                self.failed += 1
            self.metrics.push_windows.labels(result=result).inc()
            self.metrics.push_queue.set(self._waiting())

    def _error(self, message: str) -> None:
        with self._cond:
            first = not self._failing
            self._failing = True
            self.last_error = message
            self.last_error_ns = time.time_ns()
        # One line per outage, not one per retry; status and the counters tell the rest.
        (log.warning if first else log.debug)("pyroscope push: %s", message)

    def stop(self, grace: float) -> None:
        """Send what is queued for at most ``grace`` seconds, then drop (and count) the rest."""
        with self._cond:
            self._stop = True
            self._deadline = time.monotonic() + grace
            self._cond.notify_all()
        # Not a second more: a slow server must not hold the daemon's exit (the
        # windows are in the files already); what is still queued is counted.
        self._thread.join(grace)
        with self._cond:
            left = len(self._queue)
            self._queue.clear()
            self.metrics.push_queue.set(0)
        if left:
            self.dropped += left
            self.metrics.push_windows.labels(result="dropped").inc(left)
            log.warning("pyroscope: %d window(s) not sent before stopping (last error: %s)", left,
                        self.last_error or "none")

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                "server": self.target.server,
                "name": app_name(self.target.application_name, self.target.tags),
                "format": self.target.format,
                "queue": self._waiting(),
                "sending": self._sending(),
                "max_queue": self.cfg.max_queue,
                "sent": self.sent,
                "failed": self.failed,
                "dropped": self.dropped,
                "last_sent_ns": self.last_sent_ns,
                "last_error": self.last_error or None,
                "last_error_ns": self.last_error_ns or None,
            }
