"""Score stacks against py_truth.py's signatures (used by tests and bench).

A stack (root first) is a *signature sample* when its native or kernel frames
show one of the steps' signatures while the workload's ``worker`` runs (a
``worker`` or ``step_*`` Python frame, or no Python frame at all); it is
*right* when its innermost ``step_*`` Python frame is that step.

Signature code runs outside the steps too, and is not the steps' work:
libcrypto loaded by ``import hashlib`` (import machinery frames, no worker)
and OpenSSL's exit handlers (no Python frame, below ``__run_exit_handlers``).
A stack whose Python frames were lost or wrong still counts: it has no
Python frame, or a worker without the step.  The two failures are told
apart: *lost* signature samples have no Python frame at all (the walk
found no thread or frame: counted by the sampler's metrics, the samples
keep their native frames), *wrong* ones have Python frames that name
another step or none.  Tests bound them separately and print
``misattributed`` on failure, so a failing run says which stacks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_PY = re.compile(r"^(\S+) \(.*\.py:\d+\)$")
#: Any Python frame, frozen modules' (``<frozen importlib._bootstrap>:1149``) too.
_ANY_PY = re.compile(r"^(\S+) \(.*:\d+\)$")
SIGNATURES = {
    "step_hash": re.compile(r"libcrypto|_sha2|_sha256|sha256_block|SHA256"),
    "step_zlib": re.compile(r"libz\.so|deflate|zlib"),
    "step_write": re.compile(r"^(vfs_write|ksys_pwrite64|__x64_sys_pwrite64)_\[k\]$"),
}


@dataclass
class Score:
    samples: int = 0
    with_python: int = 0
    signature: int = 0
    right: int = 0
    #: signature samples without any Python frame
    lost: int = 0

    @property
    def accuracy(self) -> float:
        return self.right / self.signature if self.signature else 0.0

    @property
    def attributed_accuracy(self) -> float:
        """Right among the signature samples that have Python frames."""
        n = self.signature - self.lost
        return self.right / n if n else 0.0

    @property
    def lost_share(self) -> float:
        return self.lost / self.signature if self.signature else 0.0

    @property
    def python_share(self) -> float:
        return self.with_python / self.samples if self.samples else 0.0


def signature_of(stack: Sequence[str]) -> str | None:
    native = [f for f in stack if not _PY.match(f)]
    for step, rx in SIGNATURES.items():
        if any(rx.search(f) for f in native):
            return step
    return None


def innermost_step(stack: Sequence[str]) -> str | None:
    for f in reversed(stack):
        m = _PY.match(f)
        if m and m.group(1).startswith("step_"):
            return m.group(1)
    return None


def in_workload(stack: Sequence[str]) -> bool:
    """Could the steps' work be on this stack (see the module doc)?"""
    names = [m.group(1) for f in stack if (m := _ANY_PY.match(f))]
    if not names:
        return not any(f.startswith("__run_exit_handlers") for f in stack)
    return any(n == "worker" or n.startswith("step_") for n in names)


def score(stacks: Iterable[tuple[Sequence[str], int]]) -> Score:
    s = Score()
    for stack, n in stacks:
        s.samples += n
        if any(_PY.match(f) for f in stack):
            s.with_python += n
        sig = signature_of(stack)
        if sig is None or not in_workload(stack):
            continue
        s.signature += n
        if innermost_step(stack) == sig:
            s.right += n
        elif not any(_ANY_PY.match(f) for f in stack):
            s.lost += n
    return s


def misattributed(stacks: Iterable[tuple[Sequence[str], int]], limit: int = 8) -> list[str]:
    """The signature samples not under their step, as text for a failure message."""
    out = []
    for stack, n in stacks:
        sig = signature_of(stack)
        if sig is None or not in_workload(stack) or innermost_step(stack) == sig:
            continue
        out.append("%d x %s: %s" % (n, sig, ";".join(stack)[-500:]))
        if len(out) >= limit:
            break
    return out
