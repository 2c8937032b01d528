"""The HTTP side of ``flamed serve``: GET only, JSON API plus the page and its assets.

On a state directory every API request first takes in the files written (or
removed) since the last look, at most once per second (:meth:`Index.refresh`).

Endpoints (times are integer milliseconds since the epoch):

* ``/api/index``: what is served (kind, time range, files, weight).
* ``/api/timeline?start&end&view&FILTERS``: histogram or heatmap cells.
* ``/api/profile?start&end&format&FILTERS``: the range as folded, svg, pprof,
  speedscope (``format``; ``download=1`` asks the browser to save it).
* ``/api/top?start&end&limit&FILTERS``: functions by self and total weight.
* ``/api/diff?start&end&bstart&bend&FILTERS``: differential SVG, A before, B after;
  ``format=json`` gives the grown / shrunk functions.
* ``/api/status``: the parsed-file cache (files, bytes, limit) and the files
  parsed since start (a range asked for again within the cache parses none).

FILTERS: ``pid``, ``tid``, ``comm``, ``include``, ``exclude``, ``kinds`` (see
:class:`flamed.serve.index.Filters`).
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from flamed.errors import FlamedError
from flamed.loopback import REFUSED, host_allowed
from flamed.model import INT64_MAX
from flamed.serve.index import Filters, Index

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
_FORMATS = {"folded": ("text/plain; charset=utf-8", ".folded"), "svg": ("image/svg+xml", ".svg"),
            "pprof": ("application/octet-stream", ".pb.gz"), "speedscope": ("application/json", ".speedscope.json")}


#: Seconds a connection may stay silent while its request is read, or not take
#: any of its answer, before it is closed (``flamed serve --timeout``): a client
#: that connects and sends nothing, or half a request, holds its thread this long.
IDLE_TIMEOUT = 30.0
#: Bytes written at a time: the timeout bounds each piece, so a large answer to a
#: slow reader is not cut short while it keeps reading.
_WRITE_PIECE = 1 << 16


#: Connections served at once (``flamed serve --max-connections``): each one has a
#: thread; more are answered 503 at once, from the accepting thread.
MAX_CONNECTIONS = 32
#: Refused connections kept open (written to, never read) until their answer has
#: had time to leave: closing at once could reset it away.  At most this many.
_LINGER_MAX = 256
_LINGER_S = 1.0


class _DeadlineReader(io.RawIOBase):
    """A connection's request side with one deadline for the whole request.

    A socket timeout bounds each read only: a client sending a byte every few
    seconds kept its thread for ever.  Each read here waits at most until
    ``deadline`` (monotonic), then raises TimeoutError, which the handler
    takes as a timed-out request (the connection is closed)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not complete within --timeout")
        self._sock.settimeout(left)
        return self._sock.recv_into(b)


class ServeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], index: Index, idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.index = index
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self._active = 0
        self._count_lock = threading.Lock()
        self._lingering: collections.deque[tuple[float, socket.socket]] = collections.deque()
        #: Connections refused for want of a thread since start (503).
        self.refused = 0
        if ":" in address[0]:  # [::1]:8080: an IPv6 address (the base class listens on IPv4)
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)

    @property
    def active(self) -> int:
        """Connections being served (each in a thread of its own)."""
        return self._active

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._count_lock:
            self._active -= 1

    def _refuse(self, conn: socket.socket) -> None:
        """503 without a thread: one non-blocking send from the accepting thread."""
        self.refused += 1
        body = (f"flamed serve: too many connections ({self.max_connections} served at once, "
                "--max-connections); try again\n").encode()
        head = ("HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            conn.setblocking(False)
            conn.send(head + body)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            self.shutdown_request(conn)
            return
        if len(self._lingering) >= _LINGER_MAX:
            self._close_lingering(self._lingering.popleft()[1])
        self._lingering.append((time.monotonic() + _LINGER_S, conn))

    def service_actions(self) -> None:
        # serve_forever calls this at least every poll interval (0.5 s)
        now = time.monotonic()
        while self._lingering and self._lingering[0][0] <= now:
            self._close_lingering(self._lingering.popleft()[1])

    @staticmethod
    def _close_lingering(conn: socket.socket) -> None:
        # what the client sent meanwhile is read and dropped: closing over unread
        # bytes would send a reset, which can destroy the 503 before it is read
        with contextlib.suppress(OSError):
            while conn.recv(1 << 16):
                pass
        with contextlib.suppress(OSError):
            conn.close()

    def server_close(self) -> None:
        while self._lingering:
            self._close_lingering(self._lingering.popleft()[1])
        super().server_close()


#: The latest time a range may name: what int64 nanoseconds hold (the year 2262).
MAX_MS = INT64_MAX // 1_000_000


def _range(q: dict[str, str], index: Index, a: str = "start", b: str = "end") -> tuple[int, int]:
    try:
        lo = int(q[a]) * 1_000_000 if q.get(a) else index.start_ns
        hi = int(q[b]) * 1_000_000 if q.get(b) else index.end_ns
    except ValueError:
        raise FlamedError(f"{a}/{b} must be integer milliseconds since the epoch") from None
    for name, ns in ((a, lo), (b, hi)):
        if not 0 <= ns <= MAX_MS * 1_000_000:
            raise FlamedError(f"{name}: expected 0..{MAX_MS} milliseconds since the epoch, got {ns // 1_000_000}")
    if hi <= lo:
        raise FlamedError(f"empty range: {b} ({hi // 1_000_000}) must be after {a} ({lo // 1_000_000})")
    return lo, hi


class Handler(BaseHTTPRequestHandler):
    server: ServeServer
    server_version = "flamed-serve"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass  # a viewer's every request on stderr is noise

    def setup(self) -> None:
        super().setup()
        # The whole request (request line and headers) must arrive within --timeout
        # of the connection; each piece of the answer then waits that long at most.
        # A timeout closes the connection (handle_one_request) and frees the thread.
        self.connection.settimeout(self.server.idle_timeout)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.server.idle_timeout))

    def end_headers(self) -> None:
        self.connection.settimeout(self.server.idle_timeout)  # the answer: per piece, as before
        super().end_headers()

    def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            for i in range(0, len(body), _WRITE_PIECE):
                self.wfile.write(body[i:i + _WRITE_PIECE])

    def _json(self, obj: object, code: int = 200) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self) -> None:
        self._send(405, b"flamed serve is read-only\n", "text/plain", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def __getattr__(self, name: str) -> Any:
        # Any other method (OPTIONS, TRACE, CONNECT, made-up ones) is refused the
        # same way: the request handler looks up do_<METHOD>, and answers 501 when
        # there is none.
        if name.startswith("do_"):
            return self._refuse
        raise AttributeError(name)

    def _host_ok(self) -> bool:
        """On a loopback address, only requests naming a loopback host: a web
        page elsewhere must not reach the stacks through DNS rebinding
        (flamed/loopback.py)."""
        return host_allowed(str(self.server.server_address[0]), self.headers.get("Host"))

    def do_GET(self) -> None:
        if not self._host_ok():
            self._send(403, f"flamed serve {REFUSED}\n".encode(), "text/plain")
            return
        url = urllib.parse.urlsplit(self.path)
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        try:
            self._route(url.path, q)
        except FlamedError as e:
            self._json({"error": str(e)}, 400)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the client left, or stopped reading its answer
        except Exception as e:  # noqa: BLE001 - the client gets an answer, the traceback goes to stderr
            traceback.print_exc(file=sys.stderr)
            try:
                self._json({"error": f"internal error: {type(e).__name__}: {e}"}, 500)
            except OSError:
                pass

    def _route(self, path: str, q: dict[str, str]) -> None:
        index = self.server.index
        if path in ("/", "/index.html"):
            path = "/assets/index.html"
        if path.startswith("/assets/"):
            name = os.path.basename(path)
            full = os.path.join(ASSETS, name)
            ext = os.path.splitext(name)[1]
            if ext not in _TYPES or not os.path.isfile(full):
                self._send(404, b"not found\n", "text/plain")
                return
            with open(full, "rb") as fh:
                self._send(200, fh.read(), _TYPES[ext])
            return
        if path.startswith("/api/"):
            index.refresh()  # files the daemon wrote since: at most one look per second
        if path == "/api/index":
            self._json(index.summary())
            return
        if path == "/api/status":
            self._json(index.status())
            return
        filters = Filters.parse(q)
        if path == "/api/timeline":
            lo, hi = _range(q, index)
            self._json(index.timeline(lo, hi, filters, q.get("view", "auto") or "auto"))
            return
        if path == "/api/profile":
            lo, hi = _range(q, index)
            self._profile(index.profile(lo, hi, filters), q, lo, hi)
            return
        if path == "/api/top":
            from flamed.top import function_stats, ranked

            lo, hi = _range(q, index)
            p = index.profile(lo, hi, filters)
            total = p.total()
            limit = _limit(q)
            rows = ranked(function_stats(p), q.get("sort", "self") if q.get("sort") == "total" else "self")[:limit]
            self._json({"total": total, "stacks": len(p.stacks), "rows": [
                {"name": r.name, "self": r.self_weight, "total": r.total_weight} for r in rows]})
            return
        if path == "/api/diff":
            self._diff(index, q, filters)
            return
        self._send(404, b"not found\n", "text/plain")

    def _profile(self, p: Any, q: dict[str, str], lo: int, hi: int) -> None:
        from flamed import outputs
        from flamed.outputs.base import OutputOptions

        fmt = q.get("format", "svg") or "svg"
        if fmt not in _FORMATS:
            raise FlamedError(f"unknown format {fmt!r}; use {', '.join(_FORMATS)}")
        ctype, ext = _FORMATS[fmt]
        buf = io.BytesIO()
        title = q.get("title") or "Flame Graph"
        minwidth = _minwidth(q)
        outputs.get(fmt).write(p, buf, OutputOptions(title=title, subtitle=_span_text(lo, hi), palette="mixed", minwidth=minwidth,
                                                     width=_width(q)))
        extra = {}
        if q.get("download"):
            extra["Content-Disposition"] = f'attachment; filename="flamed-{lo // 1_000_000}-{hi // 1_000_000}{ext}"'
        self._send(200, buf.getvalue(), ctype, extra)

    def _diff(self, index: Index, q: dict[str, str], filters: Filters) -> None:
        from flamed.diff import changes, diff_profiles
        from flamed.layout import flame_frames, table_from_items
        from flamed.outputs.base import OutputOptions
        from flamed.outputs.svg import min_weight, render_boxes

        a0, a1 = _range(q, index)
        b0, b1 = _range(q, index, "bstart", "bend")
        d = diff_profiles(index.profile(a0, a1, filters), index.profile(b0, b1, filters), normalize=q.get("normalize") == "1")
        if q.get("format") == "json":
            rows = [c for c in changes(d) if c.self_delta or c.total_delta][: _limit(q)]
            self._json({"before": d.before_total, "after": d.after_total, "rows": [
                {"name": c.function, "before": c.total_before, "after": c.total_after, "delta": c.total_delta,
                 "self_delta": c.self_delta} for c in rows]})
            return
        options = OutputOptions(title="Differential Flame Graph", subtitle=f"A {_span_text(a0, a1)} -> B {_span_text(b0, b1)}",
                                minwidth=_minwidth(q), width=_width(q))
        table = table_from_items(d.after_items(include_gone=True), d.deltas())
        boxes = flame_frames(table, min_weight(table.total, options)) if len(table) else []
        buf = io.BytesIO()
        render_boxes(boxes, buf, options, diff=True)
        self._send(200, buf.getvalue(), "image/svg+xml")


def _span_text(lo: int, hi: int) -> str:
    import time

    def t(ns: int) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns // 1_000_000_000)) + "Z"

    return f"{t(lo)} .. {t(hi)}"


def _limit(q: dict[str, str]) -> int:
    """``limit``: rows of a table, 30 by default."""
    raw = q.get("limit", "") or "30"
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 100_000:
        raise FlamedError(f"limit: expected 1..100000 rows, got {raw!r}")
    return int(raw)


def _width(q: dict[str, str]) -> int:
    """``width`` (px) of an SVG: 1200 as ``flamed svg`` by default (downloads);
    the page asks for its frame's width, so the graph fits it."""
    raw = q.get("width", "") or "1200"
    if not (raw.isascii() and raw.isdigit()) or not 100 <= int(raw) <= 20000:
        raise FlamedError(f"width: expected 100..20000 pixels, got {raw!r}")
    return int(raw)


def _minwidth(q: dict[str, str]) -> float:
    """``minwidth`` (px) of an SVG: 0.1 as ``flamed svg`` by default (downloads);
    the page asks for 0.5: a cold hour of a busy host was a 3 MB SVG whose
    layout alone took the browser over a second (docs/serve.md)."""
    raw = q.get("minwidth", "") or "0.1"
    try:
        v = float(raw)
    except ValueError:
        raise FlamedError(f"minwidth: expected pixels, got {raw!r}") from None
    if not 0 <= v <= 100:
        raise FlamedError("minwidth: expected 0..100 pixels")
    return v
