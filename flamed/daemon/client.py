"""The client side of the control socket, for ``flamed snapshot``, ``status`` and ``flush``."""

from __future__ import annotations

import json
import socket
from typing import Any, BinaryIO

from flamed.daemon.protocol import MAX_REQUEST_BYTES
from flamed.errors import FlamedError

DEFAULT_SOCKET = "/run/flamed/flamed.sock"


class DaemonError(FlamedError):
    """The daemon answered with an error."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _connect(path: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except FileNotFoundError:
        s.close()
        raise FlamedError(f"no daemon socket at {path}; is flamed running (systemctl status flamed)? "
                          "Use --socket to name another socket") from None
    except PermissionError:
        s.close()
        raise FlamedError(f"permission denied on {path}: run as root or as a member of the 'flamed' group") from None
    except ConnectionRefusedError:
        s.close()
        raise FlamedError(f"nothing listens on {path}: the daemon is not running") from None
    except OSError as e:
        s.close()
        raise FlamedError(f"cannot connect to {path}: {e.strerror or e}") from None
    return s


def _read_header(f: BinaryIO, path: str) -> dict[str, Any]:
    line = f.readline(MAX_REQUEST_BYTES * 4)
    if not line:
        raise FlamedError(f"the daemon at {path} closed the connection without answering")
    try:
        head = json.loads(line)
    except ValueError:
        raise FlamedError(f"the daemon at {path} sent a malformed answer: {line[:80]!r}") from None
    if not isinstance(head, dict):
        raise FlamedError(f"the daemon at {path} sent a malformed answer: {line[:80]!r}")
    if not head.get("ok"):
        raise DaemonError(f"the daemon refused: {head.get('error', 'unknown error')}", str(head.get("code", "")))
    return head


def request(path: str, req: dict[str, Any], out: BinaryIO | None = None, *, timeout: float = 30.0) -> dict[str, Any]:
    """Send ``req``; return the header; copy a payload (if any) to ``out``.

    ``timeout`` bounds each socket operation; a ``next`` snapshot adds its own duration.
    """
    wait = float(req.get("next") or 0)
    s = _connect(path, timeout + wait)
    try:
        try:
            s.sendall(json.dumps(req).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused before reading (busy, denied): its error line is still readable
        f = s.makefile("rb")
        try:
            head = _read_header(f, path)
            s.settimeout(timeout)
            length = head.get("length")
            if isinstance(length, int):
                left = length
                while left > 0:
                    chunk = f.read(min(left, 1 << 18))
                    if not chunk:
                        raise FlamedError(f"the daemon closed the connection after {length - left} of {length} bytes")
                    if out is not None:
                        out.write(chunk)
                    left -= len(chunk)
            return head
        finally:
            f.close()
    except TimeoutError:
        raise FlamedError(f"the daemon at {path} did not answer within {timeout:g} s") from None
    except OSError as e:
        raise FlamedError(f"connection to the daemon at {path} failed: {e.strerror or e}") from None
    finally:
        s.close()
