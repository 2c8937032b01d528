"""flamed/dump.py's reading of /proc, on a /proc tree written by the test:
thread order after the pid numbers wrapped, and a thread id given as -p."""

from __future__ import annotations

from pathlib import Path

import pytest

from flamed.dump import dump_process
from flamed.errors import UsageError


def _task(proc: Path, pid: int, tid: int, state: str = "S") -> None:
    d = proc / str(pid) / "task" / str(tid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{tid} (worker) {state} 1 {tid} {tid} 0 -1 0\n")
    (d / "comm").write_text("worker\n")
    (d / "wchan").write_text("do_nanosleep")


def _process(proc: Path, pid: int, tids: list[int]) -> None:
    for tid in tids:
        _task(proc, pid, tid)
    (proc / str(pid) / "maps").write_text("")
    (proc / str(pid) / "cmdline").write_bytes(b"worker\0")
    (proc / str(pid) / "status").write_text(f"Name:\tworker\nTgid:\t{pid}\nPid:\t{pid}\n")
    for tid in tids:
        if tid != pid:  # /proc/TID of a thread: its own status, the process's Tgid
            (proc / str(tid)).mkdir()
            (proc / str(tid) / "status").write_text(f"Name:\tworker\nTgid:\t{pid}\nPid:\t{tid}\n")


def test_the_main_thread_comes_first_after_the_pids_wrapped(tmp_path: Path) -> None:
    # A long-lived process (pid 32000) whose threads were started after the
    # pid numbers wrapped: their tids are below its own.
    _process(tmp_path, 32000, [32000, 17, 400, 31999])
    dump = dump_process(32000, tmp_path)
    assert [t.tid for t in dump.threads] == [32000, 17, 400, 31999]


def test_a_thread_id_is_not_taken_for_its_process(tmp_path: Path) -> None:
    _process(tmp_path, 500, [500, 501])
    with pytest.raises(UsageError, match=r"501 is a thread of process 500, not a process; give -p 500") as e:
        dump_process(501, tmp_path)
    assert e.value.exit_code == 2


def test_every_unmatched_python_thread_has_a_reason(tmp_path: Path) -> None:
    """A thread that started between the listing of tasks and the read of the
    interpreter was left unmatched with unmatched_reason null."""
    from flamed.dump import PyFrame, PyThread, _place

    _process(tmp_path, 500, [500, 501])
    dump = dump_process(500, tmp_path)
    frames = [PyFrame("work", "w.py", 1)]
    late, twice = PyThread(2, 777, frames), PyThread(3, 501, frames)
    _place(dump, tmp_path, 500, [PyThread(1, 500, frames), PyThread(4, 501, frames), late, twice],
           namespaced=False)
    assert [t.python is not None for t in dump.threads] == [True, True]
    assert dump.unmatched == [late, twice]
    assert dump.unmatched_reason is not None
    assert "not among those listed" in dump.unmatched_reason
    assert "task 501 holds more than one Python thread state" in dump.unmatched_reason
