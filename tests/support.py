"""Helpers shared by the test modules: paths, capability checks, golden files.

Import them with ``from support import ...`` (``tests/`` is on ``sys.path``
because it holds the root conftest.py).

Tests that need root, BPF, perf events or py-spy call :func:`need`. Under
``FLAMED_REQUIRE_BPF=1`` (set by ``.ci/run``) a missing capability fails the
test instead of skipping it, so CI cannot pass by skipping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
ARTIFACTS = ROOT / "tests" / "artifacts"
REQUIRE = os.environ.get("FLAMED_REQUIRE_BPF") == "1"
#: Set FLAMED_BLESS=1 to rewrite golden files from the current output.
BLESS = os.environ.get("FLAMED_BLESS") == "1"
#: Scale of the fault runs: 1.0 is the issue's figure (20 kills, 1,000 churn
#: processes...); CI uses the default, a bench run raises it.
SCALE = float(os.environ.get("FLAMED_FAULT_SCALE", "0.25"))


def ctrl_c_deliverable() -> None:
    """``preexec_fn`` of a process a test sends SIGINT to: SIGINT as a terminal
    delivers it.  A suite started in the background by a non-interactive shell
    (``sh -c '... &'``) has SIGINT ignored, which every child inherits, and
    Python then never raises KeyboardInterrupt: the Ctrl-C tests would test the
    harness."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def toml_value(v: Any) -> str:
    """``v`` (bool, number, string or a list of them) as a TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(v)


def write_config(path: Path, tables: dict[str, dict[str, Any]]) -> None:
    """A daemon config file of ``tables`` (``{"sampling": {...}, "processors.python": {...}}``)."""
    lines: list[str] = []
    for table, kv in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in kv.items()]
        lines.append("")
    path.write_text("\n".join(lines))


def priming_counters(stats: Any) -> str:
    """How the sampler's reads of new processes went (the counters of the daemon's
    priming metric), for a failure's message: a process that was never read has no
    Python frames and no unwinding."""
    from flamed.daemon.sampler_stats import PRIMING_RESULTS

    return " ".join(f"{k}={getattr(stats, k)}" for _, k in PRIMING_RESULTS)


def need(condition: bool, what: str) -> None:
    """Skip (or fail under FLAMED_REQUIRE_BPF=1) when ``condition`` is false."""
    if condition:
        return
    if REQUIRE:
        pytest.fail(f"required capability missing: {what}", pytrace=False)
    pytest.skip(f"missing: {what}")


def have_root() -> bool:
    return os.geteuid() == 0


def have_bcc() -> bool:
    try:
        import bcc  # noqa: F401
    except Exception:
        return False
    return True


def pyspy_path() -> str | None:
    venv_bin = Path(sys.executable).parent / "py-spy"
    if venv_bin.exists():
        return str(venv_bin)
    return shutil.which("py-spy")


def golden(path: Path, actual: bytes) -> None:
    """Compare ``actual`` with the golden file ``path`` (rewrite it under FLAMED_BLESS=1)."""
    if BLESS or not path.exists():
        if not BLESS and REQUIRE:
            pytest.fail(f"golden file {path} missing; run with FLAMED_BLESS=1 to create it")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(actual)
        return
    expected = path.read_bytes()
    assert actual == expected, f"output differs from {path}; rerun with FLAMED_BLESS=1 if the change is intended"


def scaled(n: int, minimum: int = 1) -> int:
    """``n`` scaled by FLAMED_FAULT_SCALE, at least ``minimum``."""
    return max(minimum, int(round(n * SCALE)))


#: One line of flamed's own log on stderr (flamed/daemon/logs.py): time, flamed[pid], level, message.
FLAMED_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} flamed\[\d+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
#: A warning that something flamed needs is not where it looked (a file the package lacks...).
MISSING_WARNING = re.compile(r"(WARNING|ERROR).*(No such file|cannot read|not found|unavailable|missing)")


def foreign_lines(stderr: str, own: re.Pattern[str] = FLAMED_LOG_LINE) -> list[str]:
    """The lines of ``stderr`` flamed did not write as its own messages: bcc's C
    library and Python's atexit tracebacks print there too, and must not."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not own.match(ln)]


def wait_daemon_answers(sock: str | os.PathLike[str], proc: "subprocess.Popen[Any]",
                        timeout: float = 90.0) -> dict[str, Any]:
    """Wait until the daemon ``proc`` answers a status request on ``sock``; its status.

    The socket file exists from ``bind()`` on, before the daemon listens (and
    accepts), so its path is no sign of readiness: only an answer is.  Raises
    AssertionError when the daemon exits first or does not answer in time.
    """
    from flamed.daemon.client import request  # noqa: PLC0415 - tests that never start a daemon skip it

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None and not proc.stderr.closed else ""
            raise AssertionError(f"daemon exited {proc.returncode} before it answered: {err}")
        if os.path.exists(sock):
            try:
                return request(str(sock), {"request": "status"}, timeout=2.0)["status"]  # type: ignore[no-any-return]
            except Exception as e:  # noqa: BLE001 - bound but not listening yet, or still starting
                last = e
        time.sleep(0.05)
    raise AssertionError(f"the daemon did not answer on {sock} within {timeout:g} s (last: {last})")
