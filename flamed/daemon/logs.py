"""Logging: journald (structured, with priorities) under systemd, stderr otherwise."""

from __future__ import annotations

import logging
import os
import sys

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
