"""Answers to the control socket (status, snapshot, flush) and the pull endpoint (pprof).

They run in client and HTTP threads.  They read the ring and only *ask* the
main loop (through :class:`LoopRequests`) for a drain or a flush, then wait;
they never touch the sampler or the files, so a slow client cannot delay a
drain.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from flamed import outputs
from flamed.daemon.config import DaemonConfig
from flamed.daemon.control import Client, ClientGone
from flamed.daemon.fleet import OFFCPU_LABELS, identity_parts, labelled_pprof, parts_profile, windows_pprof
from flamed.daemon.metrics import DaemonMetrics, NotRecordedError
from flamed.daemon.protocol import (
    ProtocolError,
    SnapshotFilter,
    SnapshotRequest,
    encode_header,
    error_header,
    parse_request,
)
from flamed.daemon.ring import RingWindow, WindowRing
from flamed.daemon.store import ProfileStore, ns_to_us
from flamed.errors import FlamedError
from flamed.outputs import OutputOptions

log = logging.getLogger("flamed.daemon")

#: How often a waiting request looks at the daemon's state and at its client.
_STEP = 0.5
#: Window bounds within this of the span asked for are on it (the forced drains' own jitter).
_SLACK_NS = 1_000_000

_NOT_RECORDED = ("this daemon does not record off-CPU time: set off_cpu = true in [sampling] and reload it "
                 "(docs/offcpu.md)")


class LoopRequests(Protocol):
    """What the handlers need of the main loop (:class:`flamed.daemon.loop.DrainLoop` is one)."""

    config: DaemonConfig
    last_drain_ns: int

    @property
    def stop_requested(self) -> bool: ...

    def request_drain(self) -> None: ...

    def request_flush(self) -> str | None: ...

    def offcpu_enabled(self) -> bool: ...


class RequestHandlers:
    def __init__(self, loop: LoopRequests, *, ring: WindowRing, store: ProfileStore, metrics: DaemonMetrics,
                 clock_ns: Callable[[], int], stopping: threading.Event, status: Callable[[], dict[str, Any]],
                 min_drain_spacing: float, wait_timeout: float) -> None:
        self.loop = loop
        self.ring = ring
        self.store = store  # for its host name, which a reload may change
        self.metrics = metrics
        self.clock_ns = clock_ns
        self.stopping = stopping
        self.status = status
        self.spacing_ns = int(min_drain_spacing * 1e9)  # the loop drains no more often than this
        self.wait_timeout = wait_timeout  # how long to wait for the loop to drain

    def handle_request(self, line: bytes, client: Client) -> Iterator[bytes]:
        """One control-socket request: a JSON header line, then the payload in chunks.

        A refusal is counted here; an answer is counted by the server once it
        was sent (``ok``), or not all of it (``gone``).
        """
        try:
            cfg = self.loop.config
            req = parse_request(
                line,
                formats=outputs.names(),
                max_next=cfg.snapshot.max_next_seconds,
                ring_seconds=cfg.snapshot.ring_seconds,
                default_root=cfg.output.root_frame,
            )
            client.request = req.request
            if req.request == "status":
                yield encode_header({"ok": True, "status": self.status()})
                return
            if req.request == "flush":
                path = self.loop.request_flush()
                answer: dict[str, Any] = {"ok": True, "file": path}
                error = self.store.last_error
                if path is None and error is not None:
                    # Closed but not written: the state directory refuses it (it waits in memory).
                    answer["write_error"] = error
                yield encode_header(answer)
                return
            assert req.snapshot is not None
            header, payload = self.snapshot(req.snapshot, client)
        except ProtocolError as e:
            if e.request is not None:
                client.request = e.request  # a bad field of a request whose kind is known
            client.count(e.code)
            yield error_header(str(e), e.code)
            return
        except FlamedError as e:
            client.count("error")
            yield error_header(str(e), "error")
            return
        except ClientGone:
            raise  # the server counts it
        except Exception:
            client.count("internal_error")
            log.exception("snapshot failed")
            yield error_header("internal error in the daemon (see its log)", "internal_error")
            return
        yield encode_header(header)
        view = memoryview(payload)
        for i in range(0, len(view), 1 << 18):
            yield bytes(view[i: i + (1 << 18)])

    def pprof_profile(self, seconds: float, kind: str = "cpu") -> bytes:
        """``/debug/pprof/profile?seconds=N``: the samples of the next N seconds (an HTTP thread waits);
        ``kind="offcpu"`` (``/debug/pprof/offcpu``): the time off the CPU, in nanoseconds."""
        if kind == "offcpu" and not self.loop.offcpu_enabled():
            raise NotRecordedError(_NOT_RECORDED)
        windows, t0, t1 = self._next_windows(seconds, kind)
        if not windows and self.stopping.is_set():
            raise FlamedError("the daemon is stopping; retry when it is back")
        empty = kind == "offcpu" and not windows  # nothing waited: the span asked for, no samples
        return windows_pprof(windows, root=self.loop.config.output.root_frame, host=self.store.host, kind=kind,
                             start_ns=t0 if empty else None, end_ns=t1 if empty else None)

    def snapshot(self, req: SnapshotRequest, client: Client | None = None) -> tuple[dict[str, Any], bytes]:
        """The answer to a snapshot request; ``client``, when given, is watched while a ``next``
        request waits (:class:`ClientGone` once it hung up)."""
        offcpu = req.kind == "offcpu"
        if offcpu and not self.loop.offcpu_enabled():
            raise ProtocolError(_NOT_RECORDED, "not_recorded")
        # Why the profile covers less than the span asked for (None: it covers it all).
        partial: str | None = None
        if req.next is not None:
            windows, t0, t1 = self._next_windows(req.next, req.kind, client)
            if not windows or windows[-1].end_ns < t1 - _SLACK_NS:
                # The span's last drain did not come: the daemon stopped (or its loop is stuck).
                partial = "stopping" if self._stop_seen() else "drain_timeout"
            elif windows[0].start_ns > t0 + _SLACK_NS:
                partial = "ring"  # its oldest windows were evicted (ring_max_stacks) before the end
        else:
            now = self.clock_ns()
            if req.drain and now - self.loop.last_drain_ns > self.spacing_ns:
                self.loop.request_drain()
                self._wait_ring(now - self.spacing_ns)
            if req.since_ns is not None:
                windows = self.ring.since(req.since_ns, kind=req.kind)
            else:
                assert req.seconds is not None
                # The last N seconds before the request, which the drain just done (or one at most
                # the spacing before it) ends: counted from when the request came, not from when
                # that drain was done, which may take longer than N on a busy host.
                upto = min(now, self._newest_end(now))
                start = upto - int(req.seconds * 1e9)
                windows = self.ring.since(start, kind=req.kind)
                if windows and windows[0].start_ns > start + _SLACK_NS:
                    # What the ring no longer holds (or never did: the daemon started later).
                    partial = "ring"
        flt = SnapshotFilter(req)
        samples = 0
        lost: dict[str, int] = {}
        for w in windows:
            samples += w.samples
            for r, n in w.lost.items():
                lost[r] = lost.get(r, 0) + n
        # Filtered and named window by window: a process that moved to another
        # cgroup keeps, in root frames and labels, the identity its filter matched.
        parts = identity_parts(windows, lambda w, into, cache: flt.apply(w.counts, into, w.identities, cache))
        rates = {w.sample_rate for w in windows}
        profile = parts_profile(
            parts,
            req.root,
            start_ns=windows[0].start_ns if windows else None,
            end_ns=windows[-1].end_ns if windows else None,
            sample_rate=None if offcpu else rates.pop() if len(rates) == 1 else None,
            labels={"host": self.store.host, **(OFFCPU_LABELS if offcpu else {"unit": "samples"})},
        )
        if req.format == "pprof":
            # Labelled per sample (task, service, container...), as the pull endpoint.
            payload = labelled_pprof(profile, parts, root=req.root, host=self.store.host)
        else:
            if offcpu:
                # Microseconds, as the files and `flamed record --mode offcpu` write them.
                profile.stacks = ns_to_us(profile.stacks)
                profile.labels["unit"] = "microseconds"
            buf = io.BytesIO()
            outputs.get(req.format).write(profile, buf, OutputOptions(title=req.title))
            payload = buf.getvalue()
        header = {
            "ok": True,
            "format": req.format,
            "start_ns": profile.start_ns,
            "end_ns": profile.end_ns,
            "windows": len(windows),
            "stacks": len(profile),
            "kind": req.kind,
            "unit": profile.labels["unit"] if req.format != "pprof" else "nanoseconds" if offcpu else "samples",
            "weight": profile.total(),
            "samples_all_tasks": samples,
            "lost": dict(sorted(lost.items())),
            "sample_rate": profile.sample_rate,
            # Where the ring begins now: a since_ns before it lost what was evicted.
            "ring_start_ns": self.ring.oldest_start_ns(req.kind),
            # Covering less than asked: why (docs/protocol.md).
            "partial": partial is not None,
            "partial_reason": partial,
            "length": len(payload),
        }
        return header, payload

    def _stop_seen(self) -> bool:
        return self.stopping.is_set() or self.loop.stop_requested

    def _wait_ring(self, end_ns: int, client: Client | None = None) -> None:
        deadline = time.monotonic() + self.wait_timeout
        while not self.ring.wait_for_end(end_ns, _STEP):
            if client is not None:
                client.check()
            if self.stopping.is_set() or time.monotonic() > deadline:
                return
            self.loop.request_drain()

    def _sleep_until(self, t_ns: int, client: Client | None = None) -> None:
        """Wait until ``t_ns`` (or the daemon stops), a step at a time; after each step,
        a client that hung up ends the wait (:class:`ClientGone`): its slot is free again."""
        while not self._stop_seen():
            if client is not None:
                client.check()
            left = (t_ns - self.clock_ns()) / 1e9
            if left <= 0:
                return
            self.stopping.wait(min(left, _STEP))

    def _next_windows(self, seconds: float, kind: str = "cpu",
                      client: Client | None = None) -> tuple[list[RingWindow], int, int]:
        """Wait ``seconds`` and return the windows of those seconds, with the span's (start, end)."""
        # A drain now puts a window boundary at the start of the requested span.
        t_req = self.clock_ns()
        self.loop.request_drain()
        self._wait_ring(t_req, client)
        t0 = max(t_req - self.spacing_ns, self._newest_end(t_req))
        t1 = t0 + int(seconds * 1e9)
        self._sleep_until(t1, client)
        self.loop.request_drain()
        self._wait_ring(t1, client)
        if client is not None:
            client.check()  # not worth building a profile for nobody
        windows = [w for w in self.ring.since(t0, kind=kind) if w.start_ns >= t0 - _SLACK_NS and w.start_ns < t1]
        return windows, t0, t1

    def _newest_end(self, default: int) -> int:
        ws = self.ring.since(0)
        return ws[-1].end_ns if ws else default
