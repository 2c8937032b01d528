"""Fixtures shared by the whole suite. Plain helpers live in ``support.py``.

Tests that need root, BPF, perf events or py-spy use these fixtures (or
``support.need``). Under ``FLAMED_REQUIRE_BPF=1`` (set by ``.ci/run``) a
missing capability fails the test instead of skipping it, so CI cannot pass by
skipping.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import have_bcc, have_root, need, pyspy_path

#: Where every test may run beside another: no BPF, no daemon sampling the host,
#: nothing timed tightly against the machine's load.  Modules elsewhere opt in with
#: ``pytestmark = pytest.mark.concurrent`` (the offline toolkit; the fault tests whose
#: daemons run the fake sampler and mostly wait: pushes, full disks, idle clients).
_CONCURRENT_DIRS = ("unit", "fuzz")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``serial`` every test that is not ``concurrent`` (before ``-m`` selects):
    ``make test`` runs the concurrent ones on three workers, then the serial ones
    one at a time, so that no test that samples the host or times a daemon
    shares the machine with another test."""
    here = Path(__file__).parent
    for item in items:
        try:
            top = item.path.relative_to(here).parts[0]
        except ValueError:
            top = ""
        if top not in _CONCURRENT_DIRS and item.get_closest_marker("concurrent") is None:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session", autouse=True)
def _shared_bpf_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Samplers built in the test process with no ``bpf_cache_dir`` keep their
    compiled programs in one directory for the session, as ``flamed record``
    (~/.cache/flamed/bpf) and the daemon (/var/cache/flamed/bpf) do: a program
    is compiled once per session, not at every start (~100 starts, ~13
    distinct programs).  The tests of compiling itself (test_bpf_image.py)
    name their own empty directories, so they still compile."""
    import flamed.sampling.program as program

    shared = tmp_path_factory.mktemp("bpf-images")
    load = program.load_bpf

    def load_shared(source: str, cflags: Any, *, cache_dir: Path | None, isolated: bool) -> Any:
        return load(source, cflags, cache_dir=shared if cache_dir is None else cache_dir, isolated=isolated)

    program.load_bpf = load_shared  # type: ignore[assignment]
    try:
        yield
    finally:
        program.load_bpf = load  # type: ignore[assignment]


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


@pytest.fixture
def serve_browser(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium sized for ``flamed serve``'s page (timeline, graph, table)."""
    from cdp import Browser, chromium_path

    need(chromium_path() is not None, "chromium (Debian package chromium)")
    b = Browser(tmp_path / "chromium-profile", width=1200, height=1000)
    try:
        yield b
    finally:
        b.close()
