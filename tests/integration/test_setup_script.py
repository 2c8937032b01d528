"""packaging/setup.sh (what `make run` and `make test` call first) on a copy of
the checkout: a .venv left half-built or made by hand is re-made, and a
package index it cannot reach is one clear error, not a loop of the same failure.

The copy holds only what the script reads (packaging/, pyproject.toml); pip
is pointed at an index nobody listens on, so nothing is downloaded and the
run ends at the first install, after the venv checks these tests are about.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.slow  # each test creates a virtualenv (ensurepip: a few seconds)

#: An index on the discard port: connection refused at once, no retries, no config files' extra sources.
NO_INDEX = {"PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
            "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("setup.sh builds the venv from /usr/bin/python3")
    root = tmp_path / "flamed"
    shutil.copytree(ROOT / "packaging", root / "packaging")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def setup_sh(root: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | NO_INDEX
    return subprocess.run(["sh", str(root / "packaging" / "setup.sh")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=240, check=False)


def pip_runs(venv: Path) -> bool:
    res = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"],
                         capture_output=True, timeout=60, check=False)
    return res.returncode == 0


def test_venv_with_a_broken_pip_is_recreated(checkout: Path) -> None:
    """A venv cut short while ensurepip ran: a python whose pip cannot run. It
    was kept, and every run failed on `No module named pip._internal...`."""
    venv = checkout / ".venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=240)
    shutil.rmtree(next(venv.glob("lib/python3*/site-packages/pip")) / "_internal" / "cli")
    assert not pip_runs(venv)

    res = setup_sh(checkout)

    assert "is incomplete (its pip does not run); re-creating it" in res.stderr, res.stderr
    assert pip_runs(venv)
    # Nothing could be installed: one clear error that says what to check and that a re-run resumes.
    assert res.returncode == 1
    assert "setup: error: pip could not install" in res.stderr and "requirements.txt" in res.stderr
    assert "is the package index reachable? (PIP_INDEX_URL=http://127.0.0.1:9/)" in res.stderr
    assert "run this again" in res.stderr
    assert not (venv / ".flamed-installed").exists()


def test_venv_without_system_site_packages_is_recreated(checkout: Path) -> None:
    """A .venv made by hand (`python3 -m venv .venv`) never sees Debian's bcc;
    it was kept because its python runs."""
    venv = checkout / ".venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=240)

    res = setup_sh(checkout)

    assert "does not use the system site packages (bcc would not import); re-creating it" in res.stderr, res.stderr
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg
    # Debian's modules (python3-bpfcc's bcc, python3-systemd) are on the venv's path.
    probe = "import sys; print('/usr/lib/python3/dist-packages' in sys.path)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.strip() == "True"
