"""Start-up costs what the command needs: which modules a command run imports.

Each case runs ``flamed`` in a fresh interpreter (an import in this test
process would hide a lazy one) and lists the modules loaded at exit.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"

#: Modules no command below needs: the process pool, protobuf (pprof), the
#: mixed-mode recorder and the daemon.
HEAVY = ("multiprocessing", "google.protobuf", "flamed.pyspy.mixed", "flamed.pyspy.supervisor", "flamed.daemon")

_PROBE = """
import json, sys
from flamed.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
print("\\nMODULES " + json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def _modules(args: list[str], cwd: Path) -> tuple[set[str], str]:
    p = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("MODULES "))
    return set(json.loads(line[len("MODULES ") :])), p.stdout


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.fixture()
def inputs(tmp_path: Path) -> Path:
    (tmp_path / "perf.txt").write_bytes(gzip.decompress((DATA / "perf" / "c-default.txt.gz").read_bytes()))
    (tmp_path / "a.folded").write_text("main;work 5\nmain;idle 2\n")
    (tmp_path / "b.folded").write_text("main;work 3\nmain;idle 4\n")
    return tmp_path


def test_version_imports_no_command(inputs: Path) -> None:
    mods, out = _modules(["--version"], inputs)
    assert out.startswith("flamed ")
    assert not [m for m in mods if m.startswith("flamed.commands")], "--version imported the commands"



@pytest.mark.parametrize(
    "args",
    [
        ["collapse", "perf.txt"],
        ["svg", "a.folded", "-o", "a.svg"],
        ["diff", "a.folded", "b.folded", "-o", "d.svg"],
        ["top", "perf.txt"],
        ["export", "--format", "speedscope", "a.folded", "-o", "a.speedscope.json"],
    ],
)
def test_small_commands_import_no_heavy_modules(inputs: Path, args: list[str]) -> None:
    mods, _ = _modules(args, inputs)
    assert _heavy(mods) == []
    # Only the command that runs is imported, not its siblings.
    others = {"flamed.commands.record", "flamed.commands.daemon", "flamed.commands.merge", "flamed.commands.status"}
    assert not (others & mods)


def test_pprof_still_imports_protobuf_when_written(inputs: Path) -> None:
    mods, _ = _modules(["export", "--format", "pprof", "a.folded", "-o", "a.pb.gz"], inputs)
    assert "google.protobuf" in mods
    assert (inputs / "a.pb.gz").stat().st_size > 0
