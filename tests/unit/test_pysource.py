"""Which source gives a process its Python frames (flamed/sampling/pysource.py)."""

from __future__ import annotations

from flamed.sampling import pysource
from flamed.sampling.pysource import Decision, claim_for, decide, decide_late, walker_claim


class _Walker:
    """A PythonFrames stand-in: a verdict per pid, set by describe()."""

    def __init__(self, on_describe: dict[int, str]) -> None:
        self.verdicts: dict[int, str] = {}
        self.on_describe = on_describe
        self.installed: set[int] = set()
        self.described: list[int] = []

    def verdict(self, tgid: int) -> str | None:
        return self.verdicts.get(tgid)

    def describe(self, tgid: int) -> None:
        self.described.append(tgid)
        v = self.on_describe.get(tgid)
        if v is not None:
            self.verdicts[tgid] = v
            if v == "bpf":
                self.installed.add(tgid)


def _claim(w: _Walker | None, tgid: int) -> pysource.Claim:
    if w is None:
        return walker_claim(None, tgid, lambda _t: False, lambda _t: None)
    return walker_claim(w, tgid, w.installed.__contains__, w.describe)


def test_walker_claim_probes_a_process_never_asked_about() -> None:
    w = _Walker({1: "bpf", 2: "unsupported_version", 3: "pending"})
    assert _claim(w, 1) == (True, "walked")
    assert _claim(w, 2) == (False, "unsupported_version")
    assert _claim(w, 3) == (None, "")
    assert _claim(w, 4) == (None, "")  # describe() said nothing
    assert w.described == [1, 2, 3, 4]
    # asked before: not probed again
    assert _claim(w, 2) == (False, "unsupported_version")
    assert w.described == [1, 2, 3, 4]
    assert _claim(None, 1) == (False, "bpf_walker_off")


def test_decide_by_claim_policy_and_pyspy() -> None:
    assert decide((None, ""), fallback=True, have_pyspy=True) is None
    assert decide((True, "walked"), fallback=False, have_pyspy=False) == Decision("bpf", "walked")
    assert decide((False, "invalid_layout"), fallback=True, have_pyspy=True) == Decision("pyspy", "invalid_layout")
    assert decide((False, "invalid_layout"), fallback=False, have_pyspy=True) == Decision("none", "invalid_layout")
    assert decide((False, ""), fallback=True, have_pyspy=True) == Decision("pyspy", "pyspy_chosen")
    assert decide((False, ""), fallback=True, have_pyspy=False) == Decision("none", "no_pyspy")
    assert decide((False, ""), fallback=False, have_pyspy=True) == Decision("none", "pyspy_off")
    # not decided in time
    assert decide_late((None, ""), fallback=True, have_pyspy=True) == Decision("pyspy", "undecided")
    assert decide_late((False, ""), fallback=False, have_pyspy=True) == Decision("none", "undecided")
    assert decide_late((True, "walked"), fallback=True, have_pyspy=True) == Decision("bpf", "walked")


class _Sampler:
    def __init__(self, walker: bool) -> None:
        self.python_frames = object() if walker else None

    def python_claim(self, tgid: int) -> pysource.Claim:
        return True, "walked"


def test_claim_for_each_policy() -> None:
    on, off = _Sampler(True), _Sampler(False)
    assert claim_for("pyspy", on) is None
    assert claim_for("auto", on) == on.python_claim
    assert claim_for("bpf", on) == on.python_claim
    assert claim_for("auto", off) is None
    refuse = claim_for("bpf", off)
    assert refuse is not None and refuse(7) == (False, "bpf_walker_off")
    assert claim_for("auto", object()) is None  # a sampler without a walker at all
    assert [pysource.pyspy_fallback(p) for p in pysource.POLICIES] == [True, False, True]
    assert [pysource.walker_wanted(p) for p in pysource.POLICIES] == [True, True, False]


def test_refusal_code() -> None:
    assert pysource.refusal_code("not a CPython process (no _PyRuntime ...)") == "not_python"
    assert pysource.refusal_code("the process is gone") == "gone"
    assert pysource.refusal_code("CPython 3.14 is not supported") == "unsupported_version"
    # the probe's refusal of a version without a layout table (2.7, 3.6, 3.7: py-spy's)
    assert pysource.refusal_code("/x/libpython3.7m.so.1.0: CPython 3.7: no frame layout for this version "
                                 "(supported: 3.8, ...)") == "unsupported_version"
    assert pysource.refusal_code("cannot read _Py_DebugOffsets") == "refused"
