"""The BPF load captures fd 2 (clang and libbpf report there); the daemon's log
lines said meanwhile must still reach its log, not the capture."""

from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT

_SCRIPT = r"""
import json, logging, os, sys
from flamed.daemon.logs import setup_logging
from flamed.sampling.program import _with_captured_stderr

setup_logging("info", "stderr")

def load():
    logging.getLogger("flamed.sampling.bpfimage").warning("compiled-program cache untrusted")
    os.write(2, b"clang: a note\n")
    return 7

res, text, err = _with_captured_stderr(load)
print(json.dumps({"result": res, "captured": text, "error": repr(err) if err else None}))
"""


def test_a_warning_said_during_a_captured_load_reaches_the_log() -> None:
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       check=False)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["result"] == 7 and got["error"] is None
    assert "clang: a note" in got["captured"]  # what the load wrote to fd 2 is captured
    assert "untrusted" not in got["captured"], got
    assert "WARNING compiled-program cache untrusted" in p.stderr, p.stderr  # the log has it
    assert "clang: a note" not in p.stderr
