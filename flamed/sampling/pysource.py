"""Which source gives a process its Python frames, and why: decided here only.

Three sources, in order of preference:

``bpf``
    the BPF program walks the interpreter itself (:mod:`flamed.sampling.pyframes`
    says whether it can: the walker's *verdict* on the process);
``pyspy``
    a py-spy child, its stacks joined by time (:mod:`flamed.pyspy`), for the
    processes the walker refused or for all of them;
``none``
    native and kernel frames only.

The *policy* is what the user chose (``[processors.python] source``, or
``flamed record`` with or without ``--pyspy``): ``auto`` (the walker, py-spy
for what it refuses), ``bpf`` (never py-spy) or ``pyspy`` (py-spy for all).

Every decision carries a reason, exported as the ``reason`` label of
``flamed_python_processes``:

* ``bpf``: ``walked``;
* why the walker did not take a process (its verdict): ``not_python``,
  ``gone``, ``unsupported_version``, ``refused``, ``probe_error``,
  ``invalid_layout``, ``no_fsbase``, ``never_ready``; ``bpf_walker_off`` when
  it is not running, ``undecided`` when it did not decide in time;
* with no reason from the walker (policy ``pyspy``): ``pyspy_chosen``, or
  ``pyspy_off`` / ``no_pyspy`` when py-spy is not to be used or not found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

Source = Literal["bpf", "pyspy", "none"]
Policy = Literal["auto", "bpf", "pyspy"]
POLICIES: tuple[Policy, ...] = ("auto", "bpf", "pyspy")

#: Does the BPF program read this process's Python frames itself?  ``(True,
#: "walked")``; ``(False, reason)``: no (py-spy may); ``(None, "")``: not
#: decided yet, ask again.
Claim = tuple[bool | None, str]
ClaimFn = Callable[[int], Claim]

WALKED = "walked"
WALKER_OFF = "bpf_walker_off"
NOT_PYTHON = "not_python"
#: Verdicts of the walker that are not (yet) a decision.
_UNDECIDED_VERDICTS = (None, "pending")


class Verdicts(Protocol):
    """What the walker (:class:`flamed.sampling.pyframes.PythonFrames`) says of a process."""

    def verdict(self, tgid: int) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Decision:
    source: Source
    reason: str


def refusal_code(reason: str) -> str:
    """The verdict code of a probe's refusal that names no code of its own."""
    r = reason.lower()
    if "not a cpython" in r:
        return "not_python"
    if "gone" in r:
        return "gone"
    if "no table" in r or "no frame layout" in r or "unsupported" in r or "not supported" in r:
        return "unsupported_version"
    return "refused"


def claim_of_verdict(verdict: str | None) -> Claim:
    """The walker's verdict on a process as a :data:`Claim`."""
    if verdict in _UNDECIDED_VERDICTS:
        return None, ""
    if verdict == "bpf":
        return True, WALKED
    return False, str(verdict)


def walker_claim(walker: Verdicts | None, tgid: int, installed: Callable[[int], bool],
                 describe: Callable[[int], object]) -> Claim:
    """The BPF sampler's claim on ``tgid`` (``BpfSampler.python_claim``).

    ``walker``: the sampler's PythonFrames, None when the walker is off;
    ``installed(tgid)``: does the program hold the process's description?
    ``describe(tgid)``: probe the process now and install its description
    when it is walkable (called when the walker has never been asked).
    """
    if walker is None:
        return False, WALKER_OFF
    if installed(tgid):
        return True, WALKED
    # Asked about a process someone found to be Python: a "not_python" kept
    # from an earlier image (a shell shim, `uv run`, an entrypoint script that
    # execs the interpreter) is stale, so the process is probed again.
    if walker.verdict(tgid) in (None, NOT_PYTHON):
        describe(tgid)
        if installed(tgid):
            return True, WALKED
    return claim_of_verdict(walker.verdict(tgid))


def claim_for(policy: str, sampler: object) -> ClaimFn | None:
    """How mixed mode asks ``sampler`` about each Python process under ``policy``.

    None: no process is claimed, every one goes the py-spy way (policy
    ``pyspy``, or ``auto`` without a walker).  Under ``bpf`` without a walker
    every process is refused as ``bpf_walker_off``.
    """
    if policy == "pyspy":
        return None
    claim: ClaimFn | None = getattr(sampler, "python_claim", None)
    if claim is not None and getattr(sampler, "python_frames", None) is not None:
        return claim
    if policy == "bpf":
        return lambda _pid: (False, WALKER_OFF)
    return None


def walker_wanted(policy: str) -> bool:
    """Should a sampler started for ``policy`` run the walker at all?"""
    return policy != "pyspy"


def pyspy_fallback(policy: str) -> bool:
    """May a process the walker does not take get py-spy?"""
    return policy != "bpf"


def decide(claim: Claim, *, fallback: bool, have_pyspy: bool) -> Decision | None:
    """Where a Python process's frames come from (None: not decided yet).

    ``claim``: the walker's claim, ``(False, "")`` when nobody claims
    processes; ``fallback``: :func:`pyspy_fallback` of the policy;
    ``have_pyspy``: a py-spy binary was found.
    """
    claimed, reason = claim
    if claimed is None:
        return None
    return _settle(claimed, reason, fallback, have_pyspy)


def decide_late(claim: Claim, *, fallback: bool, have_pyspy: bool) -> Decision:
    """:func:`decide` for a process whose claim was not decided in time:
    the walker does not take it (``undecided`` when it gave no reason)."""
    claimed, reason = claim
    return _settle(bool(claimed), reason or "undecided", fallback, have_pyspy)


def _settle(claimed: bool, reason: str, fallback: bool, have_pyspy: bool) -> Decision:
    if claimed:
        return Decision("bpf", WALKED)
    if not fallback:
        return Decision("none", reason or "pyspy_off")
    if not have_pyspy:
        return Decision("none", reason or "no_pyspy")
    return Decision("pyspy", reason or "pyspy_chosen")
