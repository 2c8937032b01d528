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

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]  # each test creates a virtualenv (ensurepip: a few seconds)

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


#: What setup.sh runs besides apt-get, npm and id, which the tests below replace.
TOOLS = ("dirname", "dpkg-query", "grep", "uname", "ls", "sort", "tail", "sed", "basename", "mkdir", "ln", "cat",
         "sha256sum", "cut")


def _fake_tools(root: Path, uid: int) -> Path:
    """A PATH of the real tools plus: ``id`` saying ``uid``; ``apt-get`` logging its
    calls (and refusing, as apt does, when not root), whose install of npm puts an
    ``npm`` here; no npm until then (Debian 12's nodejs does not bring one)."""
    bin_ = root / "fakebin"
    bin_.mkdir()
    for t in TOOLS:
        real = shutil.which(t)
        assert real is not None, t
        (bin_ / t).symlink_to(real)
    log = root / "apt.log"
    (bin_ / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bin_ / "apt-get").write_text(f"""#!/bin/sh
echo "$*" >> {log}
[ "$(id -u)" = 0 ] || {{ echo "E: Could not open lock file - open (13: Permission denied)" >&2; exit 100; }}
case " $* " in *" install "*" npm "*|*" install "*" npm")
    printf '#!/bin/sh\\nwhile [ "$1" != --prefix ]; do shift; done\\n'\\
'mkdir -p "$2/node_modules/speedscope" && echo {{}} > "$2/node_modules/speedscope/package.json"\\n' > {bin_}/npm
    /bin/chmod +x {bin_}/npm;;
esac
""")
    for f in ("id", "apt-get"):
        (bin_ / f).chmod(0o755)
    return bin_


def _installed_venv(root: Path) -> None:
    """A .venv setup.sh takes as complete: system site packages, its stamp, a flamed script."""
    import hashlib

    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = true\n")
    (venv / "bin" / "flamed").write_text("#!/bin/sh\n")
    (venv / "bin" / "flamed").chmod(0o755)
    data = (root / "packaging" / "requirements.txt").read_bytes() + (root / "pyproject.toml").read_bytes()
    (venv / ".flamed-installed").write_text(hashlib.sha256(data).hexdigest() + "\n")


@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "not-root"])
def test_npm_is_installed_with_the_other_debian_packages(checkout: Path, uid: int) -> None:
    """`setup.sh --test` without npm: it was an apt-get install of its own, after
    the root check and without `apt-get update`, so a user who was not root got
    apt's lock error instead of the list of what to install."""
    bin_ = _fake_tools(checkout, uid)
    _installed_venv(checkout)
    env = {"PATH": str(bin_), "HOME": str(checkout)}
    res = subprocess.run(["/bin/sh", str(checkout / "packaging" / "setup.sh"), "--test"], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    apt = (checkout / "apt.log").read_text().splitlines() if (checkout / "apt.log").exists() else []
    speedscope = checkout / "tests" / ".node" / "node_modules" / "speedscope" / "package.json"
    if uid == 0:
        assert res.returncode == 0, res.stderr
        assert apt[0] == "update -qq", apt
        assert apt[1].startswith("install ") and apt[1].split()[-1] == "npm", apt
        assert speedscope.is_file()
    else:
        assert res.returncode == 1, res.stderr
        assert apt == []
        assert "missing Debian packages:" in res.stderr and " npm; run this script as root" in res.stderr, res.stderr
        assert not speedscope.exists()
