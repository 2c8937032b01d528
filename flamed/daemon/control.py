"""The Unix control socket: accept, authenticate by peer credentials, serve.

One accept thread; one thread per client, at most ``max_clients`` at once
(more get a ``busy`` error and are closed).  Every read and every send has
the per-client timeout, so a client that sends nothing, sends slowly or stops
reading costs one thread for at most that long and never holds a lock the
drain needs.  The request handler (the daemon) runs in the client's thread.

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
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flamed.daemon.config import ControlConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.protocol import MAX_REQUEST_BYTES, ProtocolError, error_header
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
        if n.isdigit():
            out.add(int(n))
            continue
        try:
            out.add(pwd.getpwnam(n).pw_uid if kind == "user" else grp.getgrnam(n).gr_gid)
        except KeyError:
            log.info("control.allowed_%ss: no %s named %r on this system; ignored", kind, kind, n)
    return frozenset(out)


#: handler(line, peer) -> iterable of byte chunks to send (header line first)
Handler = Callable[[bytes, Peer], Iterable[bytes]]


class ControlServer:
    def __init__(self, config: ControlConfig, handler: Handler, metrics: DaemonMetrics,
                 *, listen_fd: int | None = None) -> None:
        self.handler = handler
        self.metrics = metrics
        self.listen_fd = listen_fd
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._active = 0
        self._lock = threading.Lock()
        self._clients: set[threading.Thread] = set()
        self.path: str | None = None
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
            log.info("control socket %s (mode %o)", self.path, self.config.socket_mode)
        sock.settimeout(0.5)  # the accept loop checks for stop twice a second
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._accept_loop, name="flamed-control", daemon=True)
        self._thread.start()

    def _bind(self, path: str) -> socket.socket:
        d = os.path.dirname(path) or "."
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
        except OSError as e:
            raise FlamedError(f"cannot create {d} for the control socket: {e.strerror}; "
                              "set control.socket or --socket to a writable place") from None
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise FlamedError(f"{path} exists and is not a socket; remove it or choose another control.socket")
            # A live daemon answers on it; a stale socket from a crash does not.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(0.5)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)
            else:
                raise FlamedError(f"another daemon is listening on {path}; stop it or choose another control.socket")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bind under a restrictive umask so the socket is never briefly world-connectable.
        old = os.umask(0o177)
        try:
            sock.bind(path)
        except OSError as e:
            sock.close()
            raise FlamedError(f"cannot bind control socket {path}: {e.strerror}") from None
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
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self.listen_fd is None and self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        deadline = time.monotonic() + timeout
        for t in list(self._clients):
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def active(self) -> int:
        return self._active

    # -- serving ---------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("control socket accept failed: %s", e.strerror or e)
                time.sleep(0.1)  # EMFILE and friends: do not spin
                continue
            with self._lock:
                full = self._active >= self.config.max_clients
                if not full:
                    self._active += 1
                    self.metrics.clients.set(self._active)
            if full:
                self.metrics.requests.labels(request="unknown", result="busy").inc()
                self._refuse(conn, f"daemon busy: {self.config.max_clients} clients already connected "
                             "(control.max_clients); retry later", "busy")
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="flamed-client", daemon=True)
            self._clients.add(t)
            t.start()

    def _refuse(self, conn: socket.socket, message: str, code: str) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(0.2)
            conn.sendall(error_header(message, code))
        # Closing a Unix socket with the client's request still unread makes the kernel
        # reset the connection, and the client gets ECONNRESET instead of the error above:
        # consume what has already arrived first (without waiting: this may run in the accept loop).
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            for _ in range(16):
                if not conn.recv(65536):
                    break
        with contextlib.suppress(OSError):
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.config.client_timeout)
            peer = peer_credentials(conn)
            if not self.allowed(peer):
                log.info("control socket: refused uid %d gid %d (pid %d): not root, not in control.allowed_users "
                         "or control.allowed_groups", peer.uid, peer.gid, peer.pid)
                self.metrics.requests.labels(request="unknown", result="denied").inc()
                self._refuse(conn, f"permission denied for uid {peer.uid}: not in control.allowed_users "
                             "or control.allowed_groups", "denied")
                return
            try:
                line = self._read_line(conn)
            except ProtocolError as e:
                self.metrics.requests.labels(request="unknown", result=e.code).inc()
                self._refuse(conn, str(e), e.code)
                return
            for chunk in self.handler(line, peer):
                conn.sendall(chunk)
        except TimeoutError:
            log.debug("control client timed out")
        except OSError as e:
            log.debug("control client went away: %s", e)
        except Exception:  # a bug must not kill the accept loop or reach the client as a traceback
            log.exception("control request failed")
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._active -= 1
                self.metrics.clients.set(self._active)
            self._clients.discard(threading.current_thread())

    def _read_line(self, conn: socket.socket) -> bytes:
        buf = bytearray()
        deadline = time.monotonic() + self.config.client_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"no complete request line within {self.config.client_timeout:g} s", "timeout")
            conn.settimeout(left)
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                raise ProtocolError(f"no complete request line within {self.config.client_timeout:g} s",
                                    "timeout") from None
            if not chunk:
                if buf.strip():
                    return bytes(buf)  # EOF ends the line too (shutdown(SHUT_WR) clients)
                raise ProtocolError("empty request", "bad_request")
            nl = chunk.find(b"\n")
            if nl >= 0:
                buf += chunk[:nl]
                if len(buf) > MAX_REQUEST_BYTES:
                    raise ProtocolError(f"request longer than {MAX_REQUEST_BYTES} bytes", "too_large")
                conn.settimeout(self.config.client_timeout)
                return bytes(buf)
            buf += chunk
            if len(buf) > MAX_REQUEST_BYTES:
                raise ProtocolError(f"request longer than {MAX_REQUEST_BYTES} bytes", "too_large")

    def allowed(self, peer: Peer) -> bool:
        if peer.uid in self.allowed_uids:
            return True
        if peer.gid in self.allowed_gids:
            return True
        return any(g in self.allowed_gids for g in peer.groups)
