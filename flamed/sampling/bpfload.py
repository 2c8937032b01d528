"""What every bcc program of flamed shares: where its C source is found, and
how it is unloaded without bcc's noise.

Both programs (``profile.bpf.c`` for the sampler, ``pyspy_clock.bpf.c`` for
mixed mode) are looked up the same way, so an installed flamed (whose Python
package is not next to ``bpf/``) finds them all: ``$FLAMED_BPF_DIR``, the
source checkout, ``<prefix>/share/flamed/bpf``, ``/usr/share/flamed/bpf``.

Unloading (:func:`adopt`, :func:`close_bpf`): bcc's ``BPF.cleanup`` removes a
uprobe or kprobe by rewriting tracefs's ``uprobe_events``/``kprobe_events``
even when the probe was made with ``perf_event_open`` and never appeared
there. Where tracefs is not mounted (this machine, most containers) its C
library prints ``open(/sys/kernel/tracing/uprobe_events): ...``, the Python
side raises before it forgets the probe, and the ``atexit`` hook bcc registers
for every BPF object runs ``cleanup`` again: it closes the probe's fd a second
time (an fd number the process may have reused) and prints a traceback.
So flamed closes the probes itself, asks tracefs only when it is there, and
replaces bcc's hook with one that does the same.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("flamed.bpf")

#: Environment variable naming the directory of the BPF sources (the package's launcher sets it).
BPF_DIR_ENV = "FLAMED_BPF_DIR"


def bpf_dirs() -> list[Path]:
    """The directories searched for BPF sources, first match wins."""
    env = os.environ.get(BPF_DIR_ENV)
    out = [Path(env)] if env else []
    out += [
        Path(__file__).resolve().parents[2] / "bpf",  # the source checkout
        Path(sys.prefix) / "share" / "flamed" / "bpf",
        Path("/usr/share/flamed/bpf"),
    ]
    return out


def find_bpf_dir(name: str) -> Path:
    """The first directory of :func:`bpf_dirs` holding ``name``; the first one
    searched when none does (so the error that follows names where it looked first)."""
    dirs = bpf_dirs()
    for d in dirs:
        if (d / name).is_file():
            return d
    return dirs[0]


def find_bpf_source(name: str) -> Path:
    """Path of the BPF source file ``name`` (e.g. ``pyspy_clock.bpf.c``)."""
    return find_bpf_dir(name) / name


#: Where bcc's C library looks for tracefs (debugfs's mount point first, as bcc does).
TRACEFS_DIRS = (Path("/sys/kernel/debug/tracing"), Path("/sys/kernel/tracing"))

#: BPF object id -> the exit hook :func:`adopt` registered for it.
_exit_hooks: dict[int, Any] = {}


def _tracefs_lists(kind: str) -> bool:
    """Does the tracefs bcc would use have ``<kind>_events``?  Without it no probe can
    have been made through tracefs, so there is nothing to remove there."""
    for d in TRACEFS_DIRS:
        if d.is_dir():
            return (d / f"{kind}_events").exists()
    return False


class _ExitHook:
    """Registered with atexit instead of bcc's ``BPF.cleanup``: same work, no noise.
    (A class, not a closure, so unregistering one object's hook leaves the others.)"""

    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf

    def __call__(self) -> None:
        close_bpf(self.bpf)


def adopt(bpf: Any) -> Any:
    """Take over the exit cleanup of a freshly made ``bcc.BPF``; returns it."""
    atexit.unregister(bpf.cleanup)  # bound methods compare equal per object: removes only this one's
    hook = _ExitHook(bpf)
    _exit_hooks[id(bpf)] = hook
    atexit.register(hook)
    return bpf


def close_bpf(bpf: Any) -> None:
    """Detach and free everything a ``bcc.BPF`` holds, printing nothing; idempotent.

    Probes first, by their perf-event fds (each closed once), removing the
    tracefs event only where tracefs exists; then bcc's own ``cleanup`` for the
    rest (tracepoints, perf buffers, ring buffers, program fds), which then has
    no probe left to trip on.
    """
    hook = _exit_hooks.pop(id(bpf), None)
    if hook is not None:
        atexit.unregister(hook)
    atexit.unregister(bpf.cleanup)
    from bcc.libbcc import lib  # noqa: PLC0415 - bcc only where BPF is used

    for kind, table in (("uprobe", getattr(bpf, "uprobe_fds", {})), ("kprobe", getattr(bpf, "kprobe_fds", {}))):
        listed = _tracefs_lists(kind)
        for ev_name, fds in list(table.items()):
            # uprobe_fds: event -> fd; kprobe_fds: event -> {function: fd}
            for fd in (fds.values() if isinstance(fds, dict) else (fds,)):
                lib.bpf_close_perf_event_fd(fd)
            if listed:
                detach = lib.bpf_detach_uprobe if kind == "uprobe" else lib.bpf_detach_kprobe
                if detach(ev_name) < 0:
                    log.debug("could not remove %s event %s from tracefs", kind, ev_name)
            # bcc's own bookkeeping, which also keeps its count of open probes (a quota) right
            if kind == "uprobe":
                bpf._del_uprobe_fd(ev_name)
            else:
                for fn_name in list(fds):
                    bpf._del_kprobe_fd(ev_name, fn_name)
                del table[ev_name]
    try:
        bpf.cleanup()
    except Exception as e:  # noqa: BLE001 - bcc raises plain Exception; unloading must not fail a stop
        log.debug("bcc cleanup: %s", e)
