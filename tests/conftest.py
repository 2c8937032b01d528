"""Shared test fixtures.

Tests that need root, BPF, perf events or py-spy call :func:`need`. Under
``FLAMED_REQUIRE_BPF=1`` (set by ``.ci/run``) a missing capability fails the
test instead of skipping it, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
ARTIFACTS = ROOT / "tests" / "artifacts"
REQUIRE = os.environ.get("FLAMED_REQUIRE_BPF") == "1"
#: Set FLAMED_BLESS=1 to rewrite golden files from the current output.
BLESS = os.environ.get("FLAMED_BLESS") == "1"


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


@pytest.fixture
def require_bpf() -> None:
    need(have_root(), "root (BPF and perf events need CAP_BPF/CAP_PERFMON)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")


@pytest.fixture
def require_pyspy() -> str:
    path = pyspy_path()
    need(path is not None, "py-spy binary (pip install py-spy)")
    need(have_root(), "root or CAP_SYS_PTRACE for py-spy")
    assert path is not None
    return path


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


# -- `from conftest import ...` with several conftest.py files -----------------
# pytest imports each conftest.py outside a package as the module "conftest", the
# last one loaded replacing the others in sys.modules (tests/faults has its own).
# Before a test module is imported, and before a test runs (some import inside the
# test), point "conftest" at the conftest.py nearest to that file.


def _nearest_conftest(config: pytest.Config, path: Path) -> object | None:
    best: tuple[int, object] | None = None
    for plugin in config.pluginmanager.get_plugins():
        f = getattr(plugin, "__file__", None)
        if not f or os.path.basename(f) != "conftest.py":
            continue
        d = Path(f).resolve().parent
        if (d == path or d in path.parents) and (best is None or len(d.parts) > best[0]):
            best = (len(d.parts), plugin)
    return best[1] if best else None


def _point_conftest_at(config: pytest.Config, path: Path) -> None:
    mod = _nearest_conftest(config, path.resolve())
    if mod is not None:
        sys.modules["conftest"] = mod  # type: ignore[assignment]


def pytest_collectstart(collector: pytest.Collector) -> None:
    if isinstance(collector, pytest.Module):
        _point_conftest_at(collector.config, Path(collector.path))


def pytest_runtest_setup(item: pytest.Item) -> None:
    _point_conftest_at(item.config, Path(item.path))
