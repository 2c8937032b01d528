"""``flamed dump -p PID`` on real processes: hung CPython processes of each
build (main thread in ``stuck_handler``, a second thread asleep in ``nap``),
one inside its own PID namespace, a process that is not Python, and the
errors (no such process, not permitted)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cpython_support import need_debian_311, pyenv_python
from support import ROOT, have_root, need

from flamed.cli import main

WAIT_S = 30.0

SCRIPT = """\
import json, sys, threading, time

def nap():
    time.sleep(1000)  # NAP_LINE

def sleeper():
    nap()

def stuck_handler():
    threading.Event().wait()  # STUCK_LINE

t = threading.Thread(target=sleeper, name="sleeper", daemon=True)
t.start()
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"main": threading.get_native_id(), "sleeper": t.native_id}, f)
import os
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
stuck_handler()
"""


def _line_of(marker: str) -> int:
    return next(i for i, ln in enumerate(SCRIPT.splitlines(), 1) if marker in ln)


STUCK_LINE = _line_of("# STUCK_LINE")
NAP_LINE = _line_of("# NAP_LINE")


def _exe(which: str) -> Path:
    return need_debian_311() if which == "debian-3.11" else pyenv_python(which)


def _wait_for(cond: Callable[[], object], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def dump(pid: int, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(["dump", "-p", str(pid), *extra], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def thread_blocks(text: str) -> dict[int, str]:
    """tid -> the text of its ``Thread TID ...`` block."""
    out: dict[int, str] = {}
    for block in text.split("\n\n"):
        if block.startswith("Thread "):
            out[int(block.split()[1])] = block
    return out


@pytest.fixture
def script(tmp_path: Path) -> Path:
    # A path with a space: the frames carry co_filename as it is.
    p = tmp_path / "hung target.py"
    p.write_text(SCRIPT)
    return p


@contextmanager
def running(*argv: str) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` started; killed and reaped however the test ends."""
    proc = subprocess.Popen(list(argv))
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _frames_named(script: Path, main_tid: int, sleeper_tid: int) -> Callable[[], str | None]:
    """A poll: the dump's text once both threads are where the script parks them."""
    stuck = f"stuck_handler ({script}:{STUCK_LINE})"
    nap = f"nap ({script}:{NAP_LINE})"

    def check() -> str | None:
        rc, text, err = dump(main_tid)
        assert rc == 0, err
        blocks = thread_blocks(text)
        if stuck in blocks.get(main_tid, "") and nap in blocks.get(sleeper_tid, ""):
            return text
        return None

    return check


def _started(proc: subprocess.Popen[bytes], ready: Path) -> dict[str, int]:
    """The thread ids the target wrote once its threads were started."""
    _wait_for(lambda: ready.exists() or proc.poll() is not None, "the target to start its threads")
    assert proc.poll() is None, "the target exited"
    ids: dict[str, int] = json.loads(ready.read_text())
    return ids


@pytest.mark.parametrize("which", ["3.8", "3.11", "3.12", "3.13", "debian-3.11"])
def test_dump_names_the_hung_threads_frames(which: str, script: Path, tmp_path: Path) -> None:
    need(have_root(), "root (process_vm_readv of another process, kernel stacks)")
    exe = _exe(which)
    ready = tmp_path / "ready.json"
    with running(str(exe), str(script), str(ready)) as proc:
        ids = _started(proc, ready)
        assert ids["main"] == proc.pid
        text = _wait_for(_frames_named(script, proc.pid, ids["sleeper"]), "stuck_handler and nap in the dump")
        rc, raw, err = dump(proc.pid, "--json")
    assert rc == 0, err

    assert text.startswith(f"Process {proc.pid}: {exe} {script} {ready}\nPython {which.split('-')[-1]}")
    blocks = thread_blocks(text)
    assert set(blocks) == {proc.pid, ids["sleeper"]}
    main_block, sleeper_block = blocks[proc.pid], blocks[ids["sleeper"]]
    assert main_block.startswith(f"Thread {proc.pid} ({exe.name}) S (sleeping)")
    assert "stuck_handler" not in sleeper_block and "nap (" not in main_block
    # Innermost first: the sleep's caller before its caller's caller.
    assert sleeper_block.index("nap (") < sleeper_block.index("sleeper (")
    assert "  kernel:\n" in main_block and "no Python frames" not in text

    doc = json.loads(raw)
    assert doc["schema"] == 1 and doc["pid"] == proc.pid and doc["python_error"] is None
    assert doc["cmdline"] == [str(exe), str(script), str(ready)]
    assert doc["python"]["version"].startswith(which.split("-")[-1])
    by_tid = {t["tid"]: t for t in doc["threads"]}
    main_t = by_tid[proc.pid]
    assert main_t["state"] == "S" and main_t["state_name"] == "sleeping" and main_t["kernel"]
    frames = main_t["python"]["frames"]
    assert {"function": "stuck_handler", "file": str(script), "line": STUCK_LINE} in frames
    assert frames[-1]["function"] == "<module>"
    nap_frames = by_tid[ids["sleeper"]]["python"]["frames"]
    assert nap_frames[0] == {"function": "nap", "file": str(script), "line": NAP_LINE}
    if which != "3.8":
        assert main_t["python"]["native_thread_id"] == proc.pid
    assert doc["unmatched_python_threads"] == []


@pytest.mark.parametrize("which", ["3.8", "3.12"])
def test_dump_in_a_pid_namespace(which: str, script: Path, tmp_path: Path) -> None:
    need(have_root(), "root (unshare --pid, process_vm_readv)")
    need(shutil.which("unshare") is not None, "unshare (util-linux)")
    exe = _exe(which)
    ready = tmp_path / "ready.json"
    # Python is pid 1 of its namespace and ignores SIGTERM; killing unshare
    # ends it (--kill-child).
    with running("unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                 str(exe), str(script), str(ready)) as outer:
        ids = _started(outer, ready)
        assert ids["main"] == 1, "the target is not in a PID namespace of its own"
        children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
        assert len(children) == 1, children
        pid = int(children[0])
        sleeper = next(t for t in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")) if t != pid)
        _wait_for(_frames_named(script, pid, sleeper), "stuck_handler and nap in the namespaced dump")
        rc, raw, err = dump(pid, "--json")
    assert rc == 0, err
    doc = json.loads(raw)
    assert doc["unmatched_python_threads"] == []
    if which != "3.8":
        # The interpreter holds the namespace's tids; the dump shows the host's.
        by_tid = {t["tid"]: t for t in doc["threads"]}
        assert by_tid[pid]["python"]["native_thread_id"] == 1


LEADER_GONE_SCRIPT = """\
import ctypes, json, os, sys, threading, time

def nap():
    time.sleep(1000)  # NAP_LINE

t = threading.Thread(target=nap, name="sleeper")
t.start()
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"main": threading.get_native_id(), "sleeper": t.native_id}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
ctypes.CDLL(None).pthread_exit(None)
"""


@pytest.mark.parametrize("which", ["3.8", "3.12"])
def test_dump_when_the_main_thread_has_exited(which: str, tmp_path: Path) -> None:
    """The main thread called pthread_exit() and is a zombie; another thread
    still runs Python.  /proc/PID/maps and /proc/PID/mem of the process then
    read as empty: the dump reads them through the live thread, and shows its
    frames instead of calling the process gone."""
    need(have_root(), "root (process_vm_readv of another process, kernel stacks)")
    exe = _exe(which)
    script = tmp_path / "leader_gone.py"
    script.write_text(LEADER_GONE_SCRIPT)
    ready = tmp_path / "ready.json"
    nap = f"nap ({script}:{next(i for i, ln in enumerate(LEADER_GONE_SCRIPT.splitlines(), 1) if 'NAP_LINE' in ln)})"
    with running(str(exe), str(script), str(ready)) as proc:
        ids = _started(proc, ready)

        def leader_gone() -> bool:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return fields[0] == "Z"

        _wait_for(leader_gone, "the main thread to exit")

        def napping() -> str | None:
            rc, text, err = dump(proc.pid)
            assert rc == 0, err
            return text if nap in thread_blocks(text).get(ids["sleeper"], "") else None

        text = _wait_for(napping, "nap in the dump of the live thread")
        rc, raw, err = dump(proc.pid, "--json")
    assert rc == 0, err
    assert "no Python frames" not in text, text
    assert text.startswith(f"Process {proc.pid}: {exe} {script} {ready}\n"), text
    blocks = thread_blocks(text)
    assert blocks[proc.pid].startswith(f"Thread {proc.pid} ({exe.name}) Z (zombie)"), text
    doc = json.loads(raw)
    assert doc["python_error"] is None and doc["python"]["version"].startswith(which)
    by_tid = {t["tid"]: t for t in doc["threads"]}
    assert by_tid[ids["sleeper"]]["python"]["frames"][0]["function"] == "nap"


SUBINTERPRETER_SCRIPT = """\
import os, sys, threading
try:
    import _interpreters as interpreters  # 3.13
except ImportError:
    import _xxsubinterpreters as interpreters  # 3.8-3.12
sub = interpreters.create()  # a thread state of the main thread in the new interpreter

def stuck_handler():
    threading.Event().wait()  # STUCK_LINE

with open(sys.argv[1] + ".tmp", "w") as f:
    f.write("{}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
stuck_handler()
"""


@pytest.mark.parametrize("which", ["3.8", "3.12", "3.13"])
def test_dump_of_a_process_with_a_subinterpreter_reads_the_main_interpreter(which: str, tmp_path: Path) -> None:
    """A process that made a subinterpreter: ``interpreters.head`` is the new
    interpreter, whose only thread state (the main thread's, made by
    ``create()``) has no frame.  The dump reads the main interpreter's
    threads; before, the main thread read ``(no Python frame)`` (3.8-3.12)
    or nothing (3.13)."""
    need(have_root(), "root (process_vm_readv of another process, kernel stacks)")
    exe = _exe(which)
    script = tmp_path / "with_subinterpreter.py"
    script.write_text(SUBINTERPRETER_SCRIPT)
    ready = tmp_path / "ready.json"
    line = next(i for i, ln in enumerate(SUBINTERPRETER_SCRIPT.splitlines(), 1) if "STUCK_LINE" in ln)
    stuck = f"stuck_handler ({script}:{line})"
    with running(str(exe), str(script), str(ready)) as proc:
        _started(proc, ready)

        def stuck_named() -> str | None:
            rc, text, err = dump(proc.pid)
            assert rc == 0, err
            return text if stuck in thread_blocks(text).get(proc.pid, "") else None

        try:
            _wait_for(stuck_named, "stuck_handler in the main thread's dump", timeout=10)
        except AssertionError:
            raise AssertionError(f"main thread without its frames:\n{dump(proc.pid)[1]}") from None
        rc, raw, err = dump(proc.pid, "--json")
    assert rc == 0, err
    doc = json.loads(raw)
    main_t = next(t for t in doc["threads"] if t["tid"] == proc.pid)
    assert [f["function"] for f in main_t["python"]["frames"][-2:]] == ["stuck_handler", "<module>"]
    assert doc["unmatched_python_threads"] == []


#: A name of 1,100 ASCII characters, and one of 300 characters stored 4 bytes each
#: (U+20000, a CJK ideograph, is a letter: an identifier may hold it).
LONG_ASCII = "g" + "y" * 1099
LONG_WIDE = "h" + "\U00020000" * 299

LONG_NAMES_SCRIPT = f"""\
import os, sys, threading

def {LONG_ASCII}(ev):
    ev.wait()  # ASCII_LINE

def {LONG_WIDE}(ev):
    ev.wait()  # WIDE_LINE

ev = threading.Event()
t = threading.Thread(target={LONG_WIDE}, args=(ev,), daemon=True)
t.start()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write('{{"sleeper": %d}}' % t.native_id)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
{LONG_ASCII}(ev)
"""


@pytest.mark.parametrize("which", ["3.8", "3.12", "debian-3.11"])
def test_dump_names_a_function_whose_name_is_longer_than_the_read_limit(which: str, tmp_path: Path) -> None:
    """A name longer than the symbolizer reads of a string (1,024 bytes) is
    shown by its beginning and ``...``, with its file and line; before, the
    frame was ``[unknown python code 0x...]``.  The limit is in bytes: 300
    characters of 4 bytes pass it too."""
    need(have_root(), "root (process_vm_readv of another process, kernel stacks)")
    exe = _exe(which)
    script = tmp_path / "long_names.py"
    script.write_text(LONG_NAMES_SCRIPT, encoding="utf-8")
    ready = tmp_path / "ready.json"
    lines = LONG_NAMES_SCRIPT.splitlines()
    ascii_line = next(i for i, ln in enumerate(lines, 1) if "ASCII_LINE" in ln)
    wide_line = next(i for i, ln in enumerate(lines, 1) if "WIDE_LINE" in ln)
    with running(str(exe), str(script), str(ready)) as proc:
        sleeper = _started(proc, ready)["sleeper"]

        def both_parked() -> dict[int, list[dict[str, Any]]] | None:
            rc, raw, err = dump(proc.pid, "--json")
            assert rc == 0, err
            by_tid = {t["tid"]: (t["python"] or {}).get("frames", []) for t in json.loads(raw)["threads"]}
            ok = all(len(by_tid.get(tid, [])) >= 2 for tid in (proc.pid, sleeper))
            return by_tid if ok and by_tid[proc.pid][-1]["function"] == "<module>" else None

        by_tid = _wait_for(both_parked, "both threads parked in the long-named functions", timeout=10)
    main_frame = next(f for f in by_tid[proc.pid] if f["file"] == str(script))
    assert main_frame == {"function": LONG_ASCII[:1024] + "...", "file": str(script), "line": ascii_line}
    wide_frame = next(f for f in by_tid[sleeper] if f["file"] == str(script))
    assert wide_frame == {"function": LONG_WIDE[:256] + "...", "file": str(script), "line": wide_line}


OLD_SCRIPT = """\
import os, sys, threading, time

def nap():
    time.sleep(1000)  # NAP_LINE

def stuck_handler():
    threading.Event().wait()  # STUCK_LINE

t = threading.Thread(target=nap, name="sleeper")
t.daemon = True
t.start()
open(sys.argv[1] + ".tmp", "w").close()
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
stuck_handler()
"""


@pytest.mark.parametrize("which", ["2.7", "3.7"])
def test_dump_of_an_interpreter_flamed_cannot_read_uses_pyspy(which: str, tmp_path: Path,
                                                               require_pyspy: str) -> None:
    """No layout for 2.7 or 3.7: their frames come from py-spy's dump, matched to
    the tasks through their pthread ids; without py-spy, the reason says so."""
    need(have_root(), "root (py-spy reads another process)")
    exe = _exe(which)
    script = tmp_path / "old target.py"
    script.write_text(OLD_SCRIPT)
    ready = tmp_path / "ready"
    lines = OLD_SCRIPT.splitlines()
    stuck = f"stuck_handler ({script}:{next(i for i, ln in enumerate(lines, 1) if '# STUCK_LINE' in ln)})"
    nap = f"nap ({script}:{next(i for i, ln in enumerate(lines, 1) if '# NAP_LINE' in ln)})"
    with running(str(exe), str(script), str(ready)) as proc:
        _wait_for(lambda: ready.exists() or proc.poll() is not None, "the target to start its thread")
        assert proc.poll() is None, "the target exited"
        sleeper = next(t for t in sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task")) if t != proc.pid)

        def parked() -> str | None:
            rc, text, err = dump(proc.pid)
            assert rc == 0, err
            blocks = thread_blocks(text)
            return text if stuck in blocks.get(proc.pid, "") and nap in blocks.get(sleeper, "") else None

        text = _wait_for(parked, "stuck_handler and nap in the dump")
        rc, raw, err = dump(proc.pid, "--json")
        rc2, without, err2 = dump(proc.pid, "--pyspy-binary", str(tmp_path / "no-py-spy"))
    assert rc == 0 and rc2 == 0, err + err2
    assert f"\nPython {which} (" in text and "frames read by py-spy)" in text
    doc = json.loads(raw)
    assert doc["python"]["version"] == which and doc["python"]["read_by"] == "py-spy"
    assert doc["python_error"] is None and doc["unmatched_python_threads"] == []
    by_tid = {t["tid"]: t for t in doc["threads"]}
    assert [f["function"] for f in by_tid[sleeper]["python"]["frames"]][0] == "nap"
    assert by_tid[proc.pid]["python"]["frames"][-1]["function"] == "<module>"
    assert f"CPython {which}: no frame layout" in without and "py-spy, which reads it, was not found" in without
    assert "stuck_handler" not in without


def test_dump_of_a_37_process_in_a_pid_namespace_uses_pyspy(tmp_path: Path, require_pyspy: str) -> None:
    """py-spy reads a 3.7 process inside its own PID namespace by its host pid;
    its threads, named by pthread id, land on their host tasks."""
    need(have_root(), "root (unshare --pid, py-spy)")
    need(shutil.which("unshare") is not None, "unshare (util-linux)")
    exe = _exe("3.7")
    script = tmp_path / "old target.py"
    script.write_text(OLD_SCRIPT)
    ready = tmp_path / "ready"
    with running("unshare", "--pid", "--fork", "--kill-child", "--mount-proc", str(exe), str(script),
                 str(ready)) as outer:
        _wait_for(lambda: ready.exists() or outer.poll() is not None, "the target to start its thread")
        assert outer.poll() is None, "the target exited"
        children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
        assert len(children) == 1, children
        pid = int(children[0])
        sleeper = next(t for t in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")) if t != pid)

        def parked() -> dict[str, Any] | None:
            rc, raw, err = dump(pid, "--json")
            assert rc == 0, err
            doc: dict[str, Any] = json.loads(raw)
            by_tid = {t["tid"]: t for t in doc["threads"]}
            frames = [f["function"] for f in (by_tid.get(sleeper, {}).get("python") or {}).get("frames", [])]
            return doc if frames[:1] == ["nap"] else None

        doc = _wait_for(parked, "nap under the sleeper's host tid")
    assert doc["python"]["read_by"] == "py-spy" and doc["unmatched_python_threads"] == []
    by_tid = {t["tid"]: t for t in doc["threads"]}
    assert "stuck_handler" in [f["function"] for f in by_tid[pid]["python"]["frames"]]


def test_dump_of_a_thread_id_names_its_process(script: Path, tmp_path: Path) -> None:
    """/proc/TID exists for every thread: -p TID is refused (exit 2) with the
    process to give, rather than the whole process shown as "Process TID"."""
    ready = tmp_path / "ready.json"
    with running(sys.executable, str(script), str(ready)) as proc:
        ids = _started(proc, ready)
        rc, text, err = dump(ids["sleeper"])
    assert rc == 2, text
    assert f"{ids['sleeper']} is a thread of process {proc.pid}, not a process; give -p {proc.pid}" in err
    assert text == ""


def test_dump_of_a_process_that_is_not_python() -> None:
    need(have_root(), "root (kernel stacks)")
    with running("sleep", "1000") as proc:
        _wait_for(lambda: Path(f"/proc/{proc.pid}/comm").read_text() == "sleep\n", "sleep to exec")

        def asleep() -> str | None:
            rc, text, err = dump(proc.pid)
            assert rc == 0, err
            return text if f"Thread {proc.pid} (sleep) S (sleeping)" in text else None

        text = _wait_for(asleep, "sleep to be asleep")
        rc, raw, err = dump(proc.pid, "--json")
    assert text.startswith(f"Process {proc.pid}: sleep 1000\nno Python frames: not a CPython process")
    blocks = thread_blocks(text)
    assert list(blocks) == [proc.pid]
    assert "  kernel:\n" in blocks[proc.pid]
    assert rc == 0, err
    doc = json.loads(raw)
    assert doc["python"] is None and doc["python_error"].startswith("not a CPython process")
    assert [(t["tid"], t["name"], t["state"], t["python"]) for t in doc["threads"]] == [(proc.pid, "sleep", "S", None)]


def test_dump_of_no_such_process() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=30)
    rc, out, err = dump(proc.pid)
    assert (rc, out) == (1, "")
    assert err == f"flamed dump: error: no such process: {proc.pid}\n"


def test_dump_not_permitted() -> None:
    need(have_root(), "root (to start a process another user may not read)")
    setpriv = shutil.which("setpriv")
    need(setpriv is not None, "setpriv (util-linux)")
    assert setpriv is not None
    with running("sleep", "1000") as proc:
        res = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups",
                              sys.executable, "-m", "flamed", "dump", "-p", str(proc.pid)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 3, res.stderr
    assert res.stdout == ""
    assert "run as root or grant CAP_SYS_PTRACE" in res.stderr



def test_dump_refused_despite_cap_sys_ptrace_does_not_say_run_as_root() -> None:
    """Root in a user namespace of its own holds CAP_SYS_PTRACE there, and not over
    a process outside it: "run as root" was the advice given to root."""
    need(have_root(), "root (unshare --user)")
    unshare = shutil.which("unshare")
    need(unshare is not None, "unshare (util-linux)")
    assert unshare is not None
    with running("sleep", "1000") as proc:
        res = subprocess.run([unshare, "--user", "--map-root-user", sys.executable, "-m", "flamed", "dump",
                              "-p", str(proc.pid)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 3, res.stderr
    assert "refused even with CAP_SYS_PTRACE" in res.stderr and "user namespace" in res.stderr, res.stderr
    assert "run as root" not in res.stderr


HOSTILE = """\
import ctypes, json, os, sys, threading
libc = ctypes.CDLL(None)
named = threading.Event()

def rename():
    libc.prctl(15, b"ev\\x1b[31mRED\\x07", 0, 0, 0)  # PR_SET_NAME: any bytes but NUL
    named.set()
    threading.Event().wait()

t = threading.Thread(target=rename, daemon=True)
t.start()
named.wait()
ns = {}
exec(compile("def f(ready):\\n    os.rename(ready + '.tmp', ready)\\n    threading.Event().wait()\\n",
             "/tmp/\\x1b]0;owned\\x07\\nThread 1 (fake).py", "exec"), {"os": os, "threading": threading}, ns)
with open(sys.argv[1] + ".tmp", "w") as fh:
    json.dump({"main": threading.get_native_id(), "renamed": t.native_id}, fh)
ns["f"](sys.argv[1])
"""


def test_dump_text_shows_hostile_names_escaped(tmp_path: Path) -> None:
    """Thread names, code paths and the command line are the target's, which
    any user controls: the text dump shows their escape sequences, BELs and
    newlines as \\xNN, so the terminal of whoever runs it acts on none and no
    fake line appears; --json keeps them as they are."""
    need(have_root(), "root (process_vm_readv of another process)")
    exe = _exe("3.11")
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    ready = tmp_path / "ready.json"
    with running(str(exe), str(script), str(ready), "arg\x1b[2J\nThread 1 (fake)") as proc:
        ids = _started(proc, ready)

        def hostile_frame_shown() -> str | None:
            text = dump(proc.pid)[1]
            return text if "owned" in text else None

        text = _wait_for(hostile_frame_shown, "the hostile frame in the dump")
        rc, raw, err = dump(proc.pid, "--json")
    assert rc == 0, err
    assert not any(ord(c) < 0x20 and c != "\n" or ord(c) == 0x7F for c in text), repr(text)
    assert text.splitlines()[0].endswith("arg\\x1b[2J\\x0aThread 1 (fake)")
    assert f"Thread {ids['renamed']} (ev\\x1b[31mRED\\x07)" in text
    assert "/tmp/\\x1b]0:owned\\x07 Thread 1 (fake).py" in text  # a frame's ; and newline: : and space
    assert not any(ln.startswith("Thread 1 (fake)") for ln in text.splitlines())
    doc = json.loads(raw)
    assert {t["tid"]: t["name"] for t in doc["threads"]}[ids["renamed"]] == "ev\x1b[31mRED\x07"
