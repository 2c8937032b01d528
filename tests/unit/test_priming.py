"""The priming thread's first read of a new process image (BpfSampler without
BPF: the reports are fed in by hand, the processes are real).

A first read can fail while the process is still there: the image reported
was replaced by exec in the middle of the read (identity read before and
after differ).  Before it was tried again, about 1 in 200 short Python
processes started by a Python parent was never described to the program and
had no Python frame at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions
from flamed.sampling.pyframes import PythonFrames
from flamed.sampling.symbols import ProcessIdentity


class FlakySymbolizer:
    """``prepare`` fails the first ``fail`` times for every pid, as a read racing exec does."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls: dict[int, int] = {}
        self.primed: list[int] = []

    def prepare(self, pid: int) -> Any:
        n = self.calls[pid] = self.calls.get(pid, 0) + 1
        if n <= self.fail:
            return None
        return ProcessIdentity(pid, int(time.clock_gettime(time.CLOCK_BOOTTIME) * 100) - 1000, 0x400000, 0x7FFF0000), []

    def prime(self, pid: int, prepared: Any) -> None:
        self.primed.append(pid)

    def forget(self, pid: int) -> None:
        pass


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _sampler(sym: FlakySymbolizer, probed: list[int]) -> BpfSampler:
    frames = PythonFrames(probe=lambda pid: probed.append(pid), symbolizer_factory=lambda _p, _t: None)
    return BpfSampler(BpfSamplerOptions(frequency=99, python=True), symbolizer=sym,  # type: ignore[arg-type]
                      python_frames=frames)


def _run_due(s: BpfSampler, deadline_s: float = 2.0) -> None:
    end = time.monotonic() + deadline_s
    while s._processes._reprime and time.monotonic() < end:
        time.sleep(s._processes.PRIME_REREAD_S)
        s._processes._prime_again()


def test_a_failed_first_read_of_a_live_process_is_tried_again(child: subprocess.Popen[bytes]) -> None:
    sym, probed = FlakySymbolizer(fail=2), []
    s = _sampler(sym, probed)
    s._processes._new_images.append(child.pid)
    s._processes._prime_reported()
    assert probed == [], "described before its maps were read"
    _run_due(s)
    assert sym.calls[child.pid] == 3
    assert child.pid in sym.primed
    assert probed == [child.pid], "the Python description must follow the late first read"
    st = s._stats
    assert (st.primed_total, st.prime_missed_total) == (1, 0)


def test_retries_are_bounded_and_then_counted_as_missed(child: subprocess.Popen[bytes]) -> None:
    sym, probed = FlakySymbolizer(fail=1000), []
    s = _sampler(sym, probed)
    s._processes._new_images.append(child.pid)
    s._processes._prime_reported()
    _run_due(s)
    assert sym.calls[child.pid] == s._processes.PRIME_FIRST_TRIES
    assert not s._processes._reprime
    assert (s._stats.primed_total, s._stats.prime_missed_total) == (0, 1)
    assert probed == []
    # Still running: the next drain that samples it has it read (no report comes again).
    s._processes.sampled({child.pid})
    assert list(s._processes._late) == [child.pid]


def test_a_process_whose_hand_over_raises_does_not_drop_the_others_of_its_batch() -> None:
    """The reports read in one wake-up are a batch: a handler raising for one
    process must leave the processes reported after it read and handed on.
    Before, the exception left the loop and the rest of the batch was dropped
    (a short process then got no Python frames for its whole life)."""
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(3)]
    try:
        sym, probed = FlakySymbolizer(fail=0), []
        bad = kids[0].pid

        s = _sampler(sym, probed)
        m = s._processes
        feed = m._handlers[0]
        real = feed.attach

        def attach(tgid: int) -> None:
            if tgid == bad:
                raise RuntimeError("a hand-over that raises")
            real(tgid)

        feed.attach = attach  # type: ignore[method-assign]
        m._new_images.extend(k.pid for k in kids)
        m._prime_reported()
        assert probed == [k.pid for k in kids[1:]], "the processes reported after the failed one were dropped"
        assert s._stats.prime_failed_total == 1
        assert s._stats.primed_total == 3
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_a_process_in_the_middle_of_exec_is_alive_and_its_read_is_tried_again() -> None:
    """While exec replaces a process's memory, its stat shows start_code 0 and
    its maps no code, as a kernel thread's do.  A first read made then fails;
    taken for a kernel thread, the process was never read again (the program
    reports an image once) and a short CPython process had no Python frame
    for its whole life.  Caught here on real execs: the window is a fraction
    of a millisecond, polled from the parent right after fork."""
    from flamed.procstat import EXITED, read_stat
    from flamed.sampling import processes

    caught, wrong = 0, 0
    for _ in range(60):
        pid = os.fork()
        if pid == 0:  # pragma: no cover -- the child only sleeps and execs
            try:
                time.sleep(0.002)
                os.execv(sys.executable, [sys.executable, "-S", "-c", "pass"])
            finally:
                os._exit(127)
        try:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                f = read_stat(f"/proc/{pid}/stat")
                if not f or f[0] in EXITED:
                    break
                if int(f[23]) != 0:
                    continue
                alive = processes._alive(pid)
                g = read_stat(f"/proc/{pid}/stat")
                if g and g[0] not in EXITED and int(g[23]) == 0 and int(g[19]) == int(f[19]):
                    caught += 1  # still in the window after the check: it was asked then
                    wrong += not alive
        finally:
            os.waitpid(pid, 0)
        if caught >= 20:
            break
    if not caught:
        pytest.skip("no exec was caught in the middle (start_code 0) in 60 tries")
    assert wrong == 0, f"{wrong} of {caught} checks in the middle of exec took the process for gone or a kernel thread"



def test_an_exited_process_is_not_tried_again() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    sym, probed = FlakySymbolizer(fail=1000), []
    s = _sampler(sym, probed)
    s._processes._new_images.append(p.pid)
    s._processes._prime_reported()
    assert not s._processes._reprime
    assert sym.calls[p.pid] == 1
    assert s._stats.prime_missed_total == 1


def test_a_kernel_thread_is_not_tried_again() -> None:
    sym, probed = FlakySymbolizer(fail=1000), []
    s = _sampler(sym, probed)
    s._processes._new_images.append(2)  # kthreadd
    s._processes._prime_reported()
    assert not s._processes._reprime


# -- processes the priming thread never read: found by the drain -------------

def test_a_throttled_first_read_is_read_when_a_drain_samples_the_process(child: subprocess.Popen[bytes]) -> None:
    """A report refused for prime_rate is not lost for good: the next drain
    that samples the process queues it, and the handlers get it then."""
    sym, probed = FlakySymbolizer(fail=0), []
    s = _sampler(sym, probed)
    m = s._processes
    m._prime_tokens = -1000.0  # the bucket is empty for seconds: these reads are refused
    m._prime_refill = time.monotonic()
    m._new_images.append(child.pid)
    m._prime_reported()
    assert probed == [] and s._stats.prime_throttled_total == 1
    # Still over the rate at the first drain: left for the next one, not counted as late yet.
    m.sampled({child.pid})
    m._prime_late()
    assert probed == [] and s._stats.prime_late_total == 0
    m._prime_tokens = 1.0
    m.sampled({child.pid})
    m._prime_late()
    assert probed == [child.pid]
    assert (s._stats.prime_late_total, s._stats.primed_total) == (1, 1)
    # Read now: the drains after do not queue it again.
    m.sampled({child.pid})
    assert not m._late


def test_a_process_whose_report_was_never_sent_is_read_after_one_drain(child: subprocess.Popen[bytes]) -> None:
    """The program reports a (pid, comm) once while it is in its `seen` map: a
    process that reuses an earlier one's pid and comm sends no report."""
    sym, probed = FlakySymbolizer(fail=0), []
    s = _sampler(sym, probed)
    m = s._processes
    m.sampled({child.pid, 0})  # 0: the idle task, never a process
    assert list(m._late) == [child.pid]
    m._prime_late()
    assert probed == [child.pid] and s._stats.prime_late_total == 1


def test_a_report_that_came_after_the_drain_is_not_read_twice(child: subprocess.Popen[bytes]) -> None:
    sym, probed = FlakySymbolizer(fail=0), []
    s = _sampler(sym, probed)
    m = s._processes
    m.sampled({child.pid})  # sampled before its report was read
    m._new_images.append(child.pid)
    m._prime_reported()
    m._prime_late()
    assert probed == [child.pid] and sym.calls[child.pid] == 1
    assert s._stats.prime_late_total == 0


def test_a_pid_is_read_again_once_its_process_exited_or_went_unsampled(child: subprocess.Popen[bytes]) -> None:
    sym, probed = FlakySymbolizer(fail=0), []
    s = _sampler(sym, probed)
    m = s._processes
    m._new_images.append(child.pid)
    m._prime_reported()
    # The exit (proc connector) is settled after a drain: the pid is free for another process.
    m.forget(child.pid)
    m.settle()
    m.sampled({child.pid})
    assert list(m._late) == [child.pid]
    m._late.clear()
    m._prime_late()
    # Without an exit notice: forgotten once unsampled for HANDED_KEEP_DRAINS drains.
    m._new_images.append(child.pid)
    m._prime_reported()
    for _ in range(2 * m.HANDED_KEEP_DRAINS):
        m.sampled(set())
    m.sampled({child.pid})
    assert list(m._late) == [child.pid]


class RealIdentitySymbolizer(FlakySymbolizer):
    """``prepare`` reads the process's real identity, as the symbolizer does."""

    def __init__(self) -> None:
        super().__init__(fail=0)

    def prepare(self, pid: int) -> Any:
        from flamed.sampling.symbols import read_identity  # noqa: PLC0415

        ident = read_identity(pid)
        return None if ident is None else (ident, [])


@pytest.fixture
def reexec() -> Iterator[subprocess.Popen[bytes]]:
    """A Python process that execs the same interpreter again (same pid, same
    comm) when it reads a line; it says "ready" once up, before and after."""
    code = ("import os, sys\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "os.execv(sys.executable, [sys.executable, '-c', "
            "'import sys, time; print(\"ready\", flush=True); time.sleep(30)'])\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        yield p
    finally:
        p.kill()
        p.wait()


def _exec_now(p: subprocess.Popen[bytes]) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"ready\n"  # the new image runs


def test_a_process_that_execd_is_read_again_at_the_settle(reexec: subprocess.Popen[bytes]) -> None:
    """Told that a process exec'd (the watcher's exec notice), the manager drops
    what the handlers knew of it after the drain, and reads it again at once
    as its new image: before, it waited for a later drain to find it never
    read, a whole drain interval without Python frames or unwinding."""
    sym, probed = RealIdentitySymbolizer(), []
    s = _sampler(sym, probed)
    m = s._processes
    m._new_images.append(reexec.pid)
    m._prime_reported()
    assert probed == [reexec.pid]
    _exec_now(reexec)
    m.forget(reexec.pid)
    m.settle()
    assert list(m._late) == [reexec.pid]  # no drain sampled it since
    m._prime_late()
    assert probed == [reexec.pid, reexec.pid]
    m.sampled({reexec.pid})  # read already: not queued again
    assert not m._late


def test_an_exec_notice_after_the_new_image_was_read_drops_nothing(reexec: subprocess.Popen[bytes]) -> None:
    """The program reports the exec'd image at its first sample (its exec count
    is part of the image), so the priming thread may have read it before the
    exec notice comes: then nothing known of the process is stale, and the
    notice does not drop the new description."""
    sym, probed = RealIdentitySymbolizer(), []
    s = _sampler(sym, probed)
    m = s._processes
    m._new_images.append(reexec.pid)
    m._prime_reported()
    _exec_now(reexec)
    m._new_images.append(reexec.pid)  # the new image's report
    m._prime_reported()
    assert probed == [reexec.pid, reexec.pid]
    m.forget(reexec.pid)
    m.settle()
    m.sampled({reexec.pid})  # a drain after it: still known as read, not read a third time
    assert not m._late
    assert probed == [reexec.pid, reexec.pid]


def _report(m: Any, pid: int, exec_id: int | None) -> None:
    """A ``new_images`` report of ``pid`` (with its exec count, when the program knows it)."""
    m._new_images.append(pid)
    if exec_id is not None:
        m._reported_exec[pid] = exec_id
    m._prime_reported()


def test_a_thread_that_names_itself_is_not_read_again(child: subprocess.Popen[bytes]) -> None:
    """The program reports an image per (tgid, comm, exec count), the comm
    being the sampled thread's: a thread that names itself is reported again.
    The same exec count and identity as the last read is the same image: the
    handlers keep it (before, each report described the process anew).  A new
    exec count, or none known, is read."""
    sym, probed = RealIdentitySymbolizer(), []
    s = _sampler(sym, probed)
    m = s._processes
    _report(m, child.pid, 7)
    _report(m, child.pid, 7)  # another thread's name
    _report(m, child.pid, 7)
    assert probed == [child.pid] and s._stats.prime_renamed_total == 2
    assert child.pid in m._handed
    _report(m, child.pid, 8)  # an exec
    assert probed == [child.pid] * 2
    _report(m, child.pid, 8)
    assert probed == [child.pid] * 2 and s._stats.prime_renamed_total == 3
    _report(m, child.pid, None)  # the program does not know exec counts: every report is read
    _report(m, child.pid, None)
    assert probed == [child.pid] * 4


def test_a_report_of_another_image_under_the_same_exec_count_is_read(reexec: subprocess.Popen[bytes]) -> None:
    """An exec count that says "same image" while the identity changed (the
    count's low half wrapped, or the pid is another process's now) is read."""
    sym, probed = RealIdentitySymbolizer(), []
    s = _sampler(sym, probed)
    m = s._processes
    _report(m, reexec.pid, 3)
    _exec_now(reexec)
    _report(m, reexec.pid, 3)
    assert probed == [reexec.pid] * 2 and s._stats.prime_renamed_total == 0
