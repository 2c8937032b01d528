"""The daemon's cgroup filter follows a restarted service (real cgroups, a real BPF daemon).

A "unit" is a cgroup ``<tree>/system.slice/demo.service`` of the v2 hierarchy
with a busy process in it; a busy process in ``other.service`` beside it must
never be sampled.  Restarting the unit the way systemd does (the process
dies, the cgroup is removed and made again: same path, new id) must not stop
the sampling of its new process, whether the filter names the cgroup by its
``/sys/fs/cgroup/...`` path (translated on a hybrid host) or by unit name.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest

from daemonproc import DaemonProc
from tests.faults.test_cgroup_labels import _pids_in
from tests.integration.test_cgroup_identity import Tree, tree  # noqa: F401 - the fixture

pytestmark = pytest.mark.bpf

UNIT = "demo.service"
LEAF = f"system.slice/{UNIT}"
OTHER = "system.slice/other.service"
#: Samples (at 99 Hz) a busy process must get before it counts as sampled.
ENOUGH = 10


def _busy(tree: Tree, leaf: str) -> subprocess.Popen[bytes]:
    return tree.spawn(leaf, ["sh", "-c", "while :; do :; done"])


def _samples_by_pid(d: DaemonProc) -> dict[int, int]:
    head, payload = d.request({"request": "snapshot", "seconds": 600, "format": "folded", "root": "pid"})
    assert head["ok"], head
    return _pids_in(payload)


def _wait_sampled(d: DaemonProc, pid: int) -> dict[int, int]:
    return d.wait_for(lambda: (s := _samples_by_pid(d)).get(pid, 0) >= ENOUGH and s, 60,
                      f"{ENOUGH} samples of pid {pid}", every=0.5)


@pytest.mark.parametrize("form", ["sysfs_path", "unit"])
def test_the_filter_follows_a_restarted_unit(require_bpf: None, daemon_factory: Any, tree: Tree,
                                             form: str) -> None:
    outside = _busy(tree, OTHER)
    if form == "sysfs_path":
        # What users copy from systemd's docs; on a hybrid host the directory is
        # /sys/fs/cgroup/unified/..., and the daemon must read it as that.
        inside = _busy(tree, LEAF)
        spec: dict[str, Any] = {"cgroups": [f"/sys/fs/cgroup{tree.path(LEAF)}"]}
    else:
        spec = {"units": [UNIT]}
    d: DaemonProc = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0, **spec})
    if form == "unit":
        # Not there when the daemon started: a warning, then it is sampled once it appears.
        assert re.search(rf"WARNING .*cgroup filter {UNIT}: no such cgroup", d.log()), d.log()[-3000:]
        inside = _busy(tree, LEAF)
    first_id = os.stat(tree.base / LEAF).st_ino
    _wait_sampled(d, inside.pid)
    assert d.metric("flamed_cgroup_filter_ids") >= 1

    # systemctl restart demo.service: same path, a new cgroup.
    tree.evict(inside)
    tree.remove(LEAF)
    again = _busy(tree, LEAF)
    new_id = os.stat(tree.base / LEAF).st_ino
    assert new_id != first_id
    samples = _wait_sampled(d, again.pid)
    log = d.log()
    path = tree.path(LEAF)
    # A drain between the rmdir and the mkdir sees a removal, then a creation.
    assert (f"cgroup {path} ({spec.get('cgroups', [UNIT])[0]}) re-created, now id {new_id} (was {first_id})" in log
            or (f"removed, was id {first_id}" in log and f"created, id {new_id}" in log)), log[-3000:]
    assert d.metric("flamed_cgroup_filter_changes_total") >= 1
    assert d.metric("flamed_cgroup_filter_ids") >= 1
    assert samples.get(outside.pid, 0) == 0, samples
    assert set(samples) <= {inside.pid, again.pid}, samples
    assert d.alive()


def test_the_library_sampler_refuses_a_cgroup_that_is_not_there(require_bpf: None, tree: Tree) -> None:
    """Outside the daemon (which waits for a unit to start), a missing cgroup is a typo: refused before the compile."""
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions
    from flamed.sampling.cgroups import CgroupError

    typo = f"/sys/fs/cgroup{tree.path('system.slice/demo.servcie')}"
    s = BpfSampler(BpfSamplerOptions(cgroups=frozenset({typo})))
    try:
        with pytest.raises(CgroupError) as e:
            s.start()
    finally:
        s.close()
    assert f"no cgroup {typo!r}" in str(e.value) and "check the name" in str(e.value)
