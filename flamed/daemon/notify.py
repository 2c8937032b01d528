"""sd_notify(3) through systemd-python, and the watchdog period.

Does nothing when ``$NOTIFY_SOCKET`` is unset (not under systemd).  The
watchdog is enabled when ``$WATCHDOG_USEC`` is set (and ``$WATCHDOG_PID``, if
set, is this process); the daemon pings at half that period from its main
loop, so a stuck loop stops the pings and systemd restarts it.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("flamed.daemon")


def _send_fallback(message: str) -> bool:
    # Only used when python3-systemd is missing: the protocol is one datagram.
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.sendto(message.encode(), addr)
    return True


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        try:
            from systemd import daemon as sd

            self._notify = sd.notify
        except ImportError:  # pragma: no cover - python3-systemd is a dependency of the package
            self._notify = None

    def notify(self, message: str) -> bool:
        if not self.enabled:
            return False
        try:
            if self._notify is not None:
                return bool(self._notify(message))
            return _send_fallback(message)
        except OSError as e:
            log.debug("sd_notify failed: %s", e)
            return False

    def ready(self, status: str) -> None:
        self.notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def reloading(self) -> None:
        import time

        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self, status: str = "stopping: writing the last window") -> None:
        self.notify(f"STOPPING=1\nSTATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or None when off."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2e6
