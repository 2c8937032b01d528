"""Logging: journald (structured, with priorities) under systemd, stderr otherwise."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_HANDLER_ATTR = "_flamed_daemon_handler"


def under_systemd() -> bool:
    """Started by systemd: it sets INVOCATION_ID, and JOURNAL_STREAM when stderr is the journal."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))


def setup_logging(level: str = "info", target: str = "auto") -> str:
    """Configure the ``flamed`` logger; returns the target used (``journal`` or ``stderr``)."""
    logger = logging.getLogger("flamed")
    for h in list(logger.handlers):
        if getattr(h, _HANDLER_ATTR, False):
            logger.removeHandler(h)
    use = target
    if target == "auto":
        use = "journal" if under_systemd() and os.path.exists("/run/systemd/journal/socket") else "stderr"
    handler: logging.Handler
    if use == "journal":
        try:
            from systemd.journal import JournalHandler

            handler = JournalHandler(SYSLOG_IDENTIFIER="flamed")
            handler.setFormatter(logging.Formatter("%(message)s"))
        except ImportError:
            use = "stderr"
    if use == "stderr":
        handler = logging.StreamHandler(sys.stderr)
        # systemd adds its own timestamps when stderr goes to the journal.
        fmt = "%(levelname)s %(message)s" if under_systemd() else "%(asctime)s flamed[%(process)d] %(levelname)s %(message)s"
        handler.setFormatter(logging.Formatter(fmt))
    setattr(handler, _HANDLER_ATTR, True)
    logger.addHandler(handler)
    logger.setLevel(LEVELS.get(level, logging.INFO))
    logger.propagate = False
    return use


@contextlib.contextmanager
def logs_past_fd2() -> Iterator[None]:
    """While this lasts, the ``flamed`` logger's handlers that write to fd 2 write to a
    duplicate of it instead.  The BPF program's load captures fd 2 (clang and libbpf
    report there) in a thread of its own during a reload, while the main loop goes on
    draining and logging: its lines must reach the log, not that capture."""
    moved: list[tuple[logging.StreamHandler[Any], Any]] = []
    dup: TextIO | None = None
    try:
        for h in logging.getLogger("flamed").handlers:
            if not isinstance(h, logging.StreamHandler):
                continue
            try:
                fd = h.stream.fileno()
            except (AttributeError, OSError, ValueError):
                continue
            if fd != 2:
                continue
            if dup is None:
                h.flush()
                dup = os.fdopen(os.dup(2), "w", encoding=getattr(h.stream, "encoding", None) or "utf-8",
                                errors="backslashreplace", buffering=1)
            moved.append((h, h.setStream(dup)))
        yield
    finally:
        for h, old in moved:
            h.setStream(old)
        if dup is not None:
            dup.close()
