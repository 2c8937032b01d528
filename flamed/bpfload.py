"""What every bcc program of flamed shares: where its C source is found.

Both programs (``profile.bpf.c`` for the sampler, ``pyspy_clock.bpf.c`` for
mixed mode) are looked up the same way, so an installed flamed (whose Python
package is not next to ``bpf/``) finds them all: ``$FLAMED_BPF_DIR``, the
source checkout, ``<prefix>/share/flamed/bpf``, ``/usr/share/flamed/bpf``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Environment variable naming the directory of the BPF sources (the package's launcher sets it).
BPF_DIR_ENV = "FLAMED_BPF_DIR"


def bpf_dirs() -> list[Path]:
    """The directories searched for BPF sources, first match wins."""
    env = os.environ.get(BPF_DIR_ENV)
    out = [Path(env)] if env else []
    out += [
        Path(__file__).resolve().parent.parent / "bpf",  # the source checkout
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
