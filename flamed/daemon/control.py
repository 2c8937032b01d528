"""The Unix control socket: accept, authenticate by peer credentials, serve.

One thread accepts connections and reads their request lines, all of them
at once (non-blocking, one selector); only a complete request takes one of
the ``max_clients`` serving threads.  So a connection that sends nothing costs
a descriptor for at most ``request_timeout``, never a serving slot: idle
connections from the socket's group cannot make root's ``flamed status`` wait
or get ``busy``.  Limits, each answered with a ``busy`` error at once:
``max_connections`` in all, ``max_connections_per_uid`` for each non-root uid
(SO_PEERCRED), and ``reserved_for_root`` of the connections and of the serving
slots that only root may use.  Every send has the per-client timeout, so a
client that stops reading costs one thread for at most that long and never
holds a lock the drain needs.  The request handler (the daemon) runs in the
serving thread; a handler that waits (a ``next`` snapshot) asks
:meth:`Client.gone` at every step of its wait, so a client that hangs up gives
its slot back within a step, not at the end of the span.

Who may talk: root, the uids in ``allowed_users``, and members (primary or
supplementary group, from SO_PEERCRED and SO_PEERGROUPS) of
``allowed_groups``.  The kernel fills these in at connect time, so the file
mode of the socket is a second fence, not the one that decides.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flamed.daemon.config import ControlConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.paths import ensure_directory, not_a_socket, path_error
from flamed.daemon.protocol import EXPECTED_REQUEST, MAX_REQUEST_BYTES, ProtocolError, error_header, request_kind
from flamed.errors import FlamedError

log = logging.getLogger("flamed.daemon")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; not exported by Python 3.11


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_credentials(conn: socket.socket) -> Peer:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    try:
        # Python caps getsockopt buffers at 1024 bytes: 256 groups.
        graw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
        groups = struct.unpack(f"{len(graw) // 4}I", graw[: len(graw) // 4 * 4])
    except OSError:
        # ERANGE (more groups) or an old kernel: read them from /proc; the
        # primary gid from SO_PEERCRED counts in any case.
        groups = _proc_groups(pid)
    return Peer(pid, uid, gid, groups)


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def resolve_ids(names: Iterable[str], kind: str) -> frozenset[int]:
    """User or group names (or numeric ids) to ids; unknown names are logged and skipped."""
    out: set[int] = set()
    for n in names:
        if n.isascii() and n.isdigit():
            out.add(int(n))
            continue
        try:
            out.add(pwd.getpwnam(n).pw_uid if kind == "user" else grp.getgrnam(n).gr_gid)
        except KeyError:
            # The default group is made by the package: without it, only root is let in.
            # Any other name was written by someone, for someone now refused: a warning.
            say = log.info if (kind, n) == ("group", "flamed") else log.warning
            say("control.allowed_%ss: no %s named %r on this system; ignored", kind, kind, n)
    return frozenset(out)


class ClientGone(Exception):
    """The client hung up before its answer was sent: the request ends, its slot is given back."""


class Client:
    """One connection being served, as the request handler sees it.

    The handler names the request (``request``) as soon as it knows it.  A
    refusal (an error header, all the answer there is) is counted by the
    handler with :meth:`count` before it is sent; any other answer is counted
    by the server in ``flamed_control_requests_total`` once it was sent: ``ok``
    when all of it was, ``gone`` when the client hung up or stopped reading
    (``control.client_timeout``) first.
    """

    __slots__ = ("conn", "peer", "request", "_metrics", "_counted")

    def __init__(self, conn: socket.socket, peer: Peer, metrics: DaemonMetrics) -> None:
        self.conn = conn
        self.peer = peer
        self.request = "unknown"
        self._metrics = metrics
        self._counted = False

    def count(self, result: str) -> None:
        """Count this request with ``result`` (once: later calls do nothing)."""
        if not self._counted:
            self._counted = True
            self._metrics.requests.labels(request=self.request, result=result).inc()

    def gone(self) -> bool:
        """Has the client closed its end?  Never waits.

        POLLHUP only: a client that shut down just its writing side
        (``shutdown(SHUT_WR)`` after its request line, which the protocol
        allows) still reads the answer, so POLLRDHUP and end-of-file do not
        mean it is gone; a close (or the client's death) sets POLLHUP.
        """
        p = select.poll()
        try:
            p.register(self.conn, select.POLLHUP | select.POLLERR)
            events = p.poll(0)
        except (OSError, ValueError):  # closed under us
            return True
        return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events)

    def check(self) -> None:
        """Raise :class:`ClientGone` if the client has closed its end."""
        if self.gone():
            raise ClientGone("the client hung up")


#: handler(line, client) -> iterable of byte chunks to send (header line first)
Handler = Callable[[bytes, Client], Iterable[bytes]]


class ControlServer:
    def __init__(self, config: ControlConfig, handler: Handler, metrics: DaemonMetrics,
                 *, listen_fd: int | None = None) -> None:
        self.handler = handler
        self.metrics = metrics
        self.listen_fd = listen_fd
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_fd = -1  # eventfd in the accept loop's selector: stop() wakes it
        self._active = 0  # requests being served (threads)
        self._open = 0  # connections: waiting for their request line or being served
        self._per_uid: dict[int, int] = {}  # open connections by uid
        self._pending: dict[int, _Pending] = {}  # fd -> connection still sending its request (accept thread only)
        self._lock = threading.Lock()
        self._clients: set[threading.Thread] = set()
        self.path: str | None = None
        #: (st_dev, st_ino) of the socket file this server bound: what stop() may remove.
        self._ident: tuple[int, int] | None = None
        self.configure(config)

    def configure(self, config: ControlConfig) -> None:
        self.config = config
        self.allowed_uids = resolve_ids(config.allowed_users, "user") | {0}
        self.allowed_gids = resolve_ids(config.allowed_groups, "group")

    # -- lifecycle -------------------------------------------------------
    def start(self) -> None:
        if self.listen_fd is not None:
            # systemd socket activation: the unit's flamed.socket owns path, mode and group.
            sock = socket.socket(fileno=self.listen_fd)
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise FlamedError("the socket systemd passed (LISTEN_FDS) is not a Unix stream socket; "
                                  "check ListenStream= in flamed.socket")
            self.path = sock.getsockname() or None
            log.info("control socket from systemd: %s", self.path)
        else:
            sock = self._bind(self.config.socket)
            self.path = self.config.socket
            st = os.lstat(self.path)
            self._ident = (st.st_dev, st.st_ino)
            log.info("control socket %s (mode %o)", self.path, self.config.socket_mode)
        self._sock = sock
        self._stop.clear()
        if self._wake_fd < 0:
            self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread = threading.Thread(target=self._accept_loop, name="flamed-control", daemon=True)
        self._thread.start()

    def _bind(self, path: str) -> socket.socket:
        ensure_directory(os.path.dirname(os.path.abspath(path)), "control.socket")
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise not_a_socket(path)
            # A live daemon answers on it; a stale socket from a crash does not.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(0.5)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)
            else:
                # exit 2 like every refusal a restart would not cure (RestartPreventExitStatus=2 3)
                raise FlamedError(f"another daemon is listening on {path}; stop it or choose another control.socket",
                                  exit_code=2)
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bind under a restrictive umask so the socket is never briefly world-connectable.
        old = os.umask(0o177)
        try:
            sock.bind(path)
        except OSError as e:
            sock.close()
            # errno None: "AF_UNIX path too long" (108 bytes at most), as final as EACCES or EROFS
            raise path_error(f"control.socket: cannot bind {path}: {e.strerror or e}", e.errno) from None
        finally:
            os.umask(old)
        gid = -1
        if self.config.socket_group:
            with contextlib.suppress(KeyError):
                gid = grp.getgrnam(self.config.socket_group).gr_gid
        if gid >= 0:
            try:
                os.chown(path, -1, gid)
            except OSError as e:
                # Not fatal (root still gets in), but the group's members cannot: say why.
                log.warning("cannot give control socket %s to group %s: %s; members of the group cannot "
                            "connect (the daemon needs CAP_CHOWN, or let systemd create it: flamed.socket)",
                            path, self.config.socket_group, e.strerror or e)
        os.chmod(path, self.config.socket_mode)
        # A burst of clients must queue (then be served or told "busy"), not get EAGAIN at connect.
        sock.listen(socket.SOMAXCONN)
        return sock

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._wake_fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self._wake_fd >= 0:
                os.close(self._wake_fd)
                self._wake_fd = -1
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self.listen_fd is None and self.path and self.owns_path():
            # Only our own socket file: if it was removed meanwhile, the path may
            # now be another daemon's socket, which must stay.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        deadline = time.monotonic() + timeout
        for t in list(self._clients):
            t.join(max(0.0, deadline - time.monotonic()))

    def owns_path(self) -> bool:
        """Is the socket file at :attr:`path` still the one this server bound?  False
        once it was removed or replaced (clients can no longer reach this server
        there; a reload binds it again).  Always true for a socket systemd passed."""
        if self.listen_fd is not None or self._ident is None or not self.path:
            return True
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    @property
    def active(self) -> int:
        return self._active

    # -- serving ---------------------------------------------------------
    @property
    def connections(self) -> int:
        """Connections open: waiting for their request line or being served."""
        return self._open

    def _reserve(self) -> int:
        return min(self.config.reserved_for_root, self.config.max_clients - 1)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        sock.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        sel.register(self._wake_fd, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._expire(sel, now)
                # No timeout but the earliest request deadline: stop() wakes the selector.
                wait: float | None = None
                if self._pending:
                    wait = max(0.0, min(p.deadline for p in self._pending.values()) - now)
                for key, _ in sel.select(wait):
                    if key.fd == self._wake_fd:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self._wake_fd)
                        continue  # stop(): the loop condition sees it
                    if key.fileobj is sock:
                        self._accept_ready(sel, sock)
                    else:
                        self._read_ready(sel, key.fd)
        finally:
            for p in list(self._pending.values()):
                self._drop_pending(sel, p)
                with contextlib.suppress(OSError):
                    p.conn.close()
            sel.close()

    def _accept_ready(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        for _ in range(64):  # then read the pending requests again: a burst must not starve them
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("control socket accept failed: %s", e.strerror or e)
                time.sleep(0.1)  # EMFILE and friends: do not spin (pending requests time out and free fds)
                return
            conn.setblocking(False)
            try:
                peer = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if not self.allowed(peer):
                log.info("control socket: refused uid %d gid %d (pid %d): not root, not in control.allowed_users "
                         "or control.allowed_groups", peer.uid, peer.gid, peer.pid)
                self.metrics.requests.labels(request="unknown", result="denied").inc()
                self._refuse(conn, f"permission denied for uid {peer.uid}: not in control.allowed_users "
                             "or control.allowed_groups", "denied")
                continue
            refusal = self._admit(peer)
            if refusal is not None:
                self.metrics.requests.labels(request="unknown", result="busy").inc()
                self._refuse(conn, refusal, "busy")
                continue
            p = _Pending(conn, peer, time.monotonic() + self.config.request_timeout)
            self._pending[conn.fileno()] = p
            sel.register(conn, selectors.EVENT_READ)

    def _admit(self, peer: Peer) -> str | None:
        """Count a new connection of ``peer``, or say why it is refused."""
        cfg = self.config
        with self._lock:
            if self._open >= cfg.max_connections:
                return (f"daemon busy: {cfg.max_connections} connections already open "
                        "(control.max_connections); retry later")
            if peer.uid != 0:
                if self._open >= cfg.max_connections - min(cfg.reserved_for_root, cfg.max_connections - 1):
                    return (f"daemon busy: the last {cfg.reserved_for_root} of control.max_connections "
                            f"({cfg.max_connections}) are kept for root; retry later")
                n = self._per_uid.get(peer.uid, 0)
                if cfg.max_connections_per_uid and n >= cfg.max_connections_per_uid:
                    return (f"daemon busy: uid {peer.uid} already has {n} connections open "
                            "(control.max_connections_per_uid); close some or retry later")
            self._open += 1
            self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        return None

    def _release(self, peer: Peer, served: bool) -> None:
        with self._lock:
            self._open -= 1
            n = self._per_uid.get(peer.uid, 0) - 1
            if n > 0:
                self._per_uid[peer.uid] = n
            else:
                self._per_uid.pop(peer.uid, None)
            if served:
                self._active -= 1
                self.metrics.clients.set(self._active)

    def _drop_pending(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        self._pending.pop(p.fd, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            sel.unregister(p.conn)
        self._release(p.peer, served=False)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        late = [p for p in self._pending.values() if p.deadline <= now]
        for p in late:
            self._drop_pending(sel, p)
            self.metrics.requests.labels(request="unknown", result="timeout").inc()
            self._refuse(p.conn, f"no complete request line within {self.config.request_timeout:g} s "
                         "(control.request_timeout); send one JSON line at once, such as "
                         "{\"request\": \"status\"}", "timeout")

    def _read_ready(self, sel: selectors.BaseSelector, fd: int) -> None:
        p = self._pending.get(fd)
        if p is None:
            return
        try:
            chunk = p.conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("control client went away: %s", e)
            self._drop_pending(sel, p)
            p.conn.close()
            return
        line: bytes | None = None
        error: ProtocolError | None = None
        if not chunk:
            if p.buf.strip():
                line = bytes(p.buf)  # EOF ends the line too (shutdown(SHUT_WR) clients)
            else:
                error = ProtocolError("empty request; " + EXPECTED_REQUEST, "bad_request")
        else:
            nl = chunk.find(b"\n")
            p.buf += chunk if nl < 0 else chunk[:nl]
            if len(p.buf) > MAX_REQUEST_BYTES:
                error = ProtocolError(f"request longer than {MAX_REQUEST_BYTES} bytes", "too_large")
            elif nl >= 0:
                line = bytes(p.buf)
        if line is None and error is None:
            return  # more to come
        self._drop_pending(sel, p)
        if error is not None:
            self.metrics.requests.labels(request="unknown", result=error.code).inc()
            self._refuse(p.conn, str(error), error.code)
            return
        assert line is not None
        self._dispatch(p.conn, p.peer, line)

    def _dispatch(self, conn: socket.socket, peer: Peer, line: bytes) -> None:
        cfg = self.config
        with self._lock:
            limit = cfg.max_clients if peer.uid == 0 else cfg.max_clients - self._reserve()
            full = self._active >= limit
            if not full:
                self._active += 1
                self._open += 1  # the serving thread releases it
                self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
                self.metrics.clients.set(self._active)
        if full:
            self.metrics.requests.labels(request=request_kind(line), result="busy").inc()
            self._refuse(conn, f"daemon busy: {cfg.max_clients} requests already being served "
                         "(control.max_clients)" + ("" if peer.uid == 0 else
                                                    f", {self._reserve()} of them kept for root")
                         + "; retry later", "busy")
            return
        t = threading.Thread(target=self._serve, args=(conn, peer, line), name="flamed-client", daemon=True)
        self._clients.add(t)
        t.start()

    def _refuse(self, conn: socket.socket, message: str, code: str) -> None:
        # Runs in the accept thread: never wait on the client.  A fresh socket's
        # buffer always holds one error line.
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(error_header(message, code))
        # Closing a Unix socket with the client's request still unread makes the kernel
        # reset the connection, and the client gets ECONNRESET instead of the error above:
        # consume what has already arrived first (without waiting).
        with contextlib.suppress(OSError):
            for _ in range(16):
                if not conn.recv(65536):
                    break
        with contextlib.suppress(OSError):
            conn.close()

    def _serve(self, conn: socket.socket, peer: Peer, line: bytes) -> None:
        client = Client(conn, peer, self.metrics)
        try:
            conn.setblocking(True)
            conn.settimeout(self.config.client_timeout)
            for chunk in self.handler(line, client):
                conn.sendall(chunk)
            client.count("ok")
        except ClientGone:
            log.debug("control client hung up before its answer")
            client.count("gone")
        except TimeoutError:
            log.debug("control client stopped reading (control.client_timeout)")
            client.count("gone")
        except OSError as e:
            log.debug("control client went away: %s", e)
            client.count("gone")
        except Exception:  # a bug must not kill the accept loop or reach the client as a traceback
            log.exception("control request failed")
            client.count("internal_error")
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            self._release(peer, served=True)
            self._clients.discard(threading.current_thread())

    def allowed(self, peer: Peer) -> bool:
        if peer.uid in self.allowed_uids:
            return True
        if peer.gid in self.allowed_gids:
            return True
        return any(g in self.allowed_gids for g in peer.groups)


class _Pending:
    """A connection whose request line has not fully arrived (owned by the accept thread)."""

    __slots__ = ("conn", "fd", "peer", "deadline", "buf")

    def __init__(self, conn: socket.socket, peer: Peer, deadline: float) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        self.peer = peer
        self.deadline = deadline
        self.buf = bytearray()
