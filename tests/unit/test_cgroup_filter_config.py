"""``[sampling] cgroups`` and ``units``: one parser for --check-config and the daemon's start.

Every spec is given to the real ``flamed daemon --check-config`` and to the
real ``flamed daemon``: a spec either passes both or both refuse it with the
same message, exit status 2.  Accepted paths must name the same v2 cgroup on
a pure-v2 host and on a hybrid one (v2 at /sys/fs/cgroup/unified).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flamed.daemon.config import SamplingConfig
from flamed.daemon.samplers import bpf_options
from flamed.errors import ConfigError
from flamed.sampling.cgroups import HYBRID_UNIFIED, SYSFS_CGROUP, Hierarchy
from flamed.sampling.program import bpf_program
from support import ROOT

DEMO = "/system.slice/demo.service"
#: (key, spec) -> the v2 path it names (kind path), or the unit / id it names.
ACCEPTED: dict[tuple[str, str], str | int] = {
    ("cgroups", f"/sys/fs/cgroup{DEMO}"): DEMO,
    ("cgroups", f"/sys/fs/cgroup/unified{DEMO}"): DEMO,
    ("cgroups", DEMO): DEMO,
    ("cgroups", DEMO.lstrip("/")): DEMO,
    ("cgroups", "demo.service"): "demo.service",
    ("cgroups", "4242"): 4242,
    ("units", "demo.service"): "demo.service",
    ("units", "getty@.service"): "getty@.service",
}
#: (key, spec) -> a piece of the refusal, which must say what to write.
REFUSED: dict[tuple[str, str], str] = {
    ("cgroups", f"/sys/fs/cgroup/cpu{DEMO}"): f"where the same cgroup is /sys/fs/cgroup{DEMO}",
    ("cgroups", "demo"): "write demo.service for the unit",
    ("cgroups", "/proc/1/cgroup"): "write a unit (nginx.service)",
    ("cgroups", "/system.slice/../demo.service"): "without '.' or '..'",
    ("cgroups", " "): "write a unit",
    ("units", DEMO): "write e.g. nginx.service",
    ("units", "4242"): "paths or ids in cgroups",
}


def _config(tmp: Path, key: str, spec: str) -> Path:
    cfg = tmp / "flamed.toml"
    cfg.write_text(f"""
[sampling]
{key} = [{spec!r}]
[output]
state_dir = "{tmp / 'state'}"
[control]
socket = "{tmp / 'run' / 'flamed.sock'}"
[metrics]
address = ""
[log]
target = "stderr"
""".replace("'", '"'))
    return cfg


def _flamed(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flamed", "daemon", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), stdin=subprocess.DEVNULL)


def _error_line(stderr: str) -> str:
    return next((ln for ln in stderr.splitlines() if "error:" in ln), "")


@pytest.mark.parametrize(("key", "spec"), list(ACCEPTED))
def test_accepted_specs_pass_check_config_and_name_one_cgroup_on_both_layouts(tmp_path: Path, key: str,
                                                                              spec: str) -> None:
    r = _flamed("--check-config", "--config", str(_config(tmp_path, key, spec)))
    assert r.returncode == 0, r.stderr
    opts = bpf_options(SamplingConfig(**{key: (spec,)}))  # what the daemon's start builds its sampler from
    pure = opts.cgroup_specs(Hierarchy(Path(SYSFS_CGROUP), mount_point=SYSFS_CGROUP))
    hybrid = opts.cgroup_specs(Hierarchy(Path(HYBRID_UNIFIED), mount_point=HYBRID_UNIFIED, hybrid=True))
    assert [s.value for s in pure] == [s.value for s in hybrid] == [ACCEPTED[key, spec]]


@pytest.mark.parametrize(("key", "spec"), list(REFUSED))
def test_refused_specs_are_refused_alike_by_check_config_and_the_daemon(tmp_path: Path, key: str,
                                                                        spec: str) -> None:
    cfg = str(_config(tmp_path, key, spec))
    checked = _flamed("--check-config", "--config", cfg)
    started = _flamed("--config", cfg)
    assert checked.returncode == started.returncode == 2, (checked.stderr, started.stderr)
    message = _error_line(checked.stderr)
    assert message == _error_line(started.stderr)
    assert f"[sampling]: {key}: " in message and REFUSED[key, spec] in message, message
    with pytest.raises(ConfigError) as e:
        bpf_options(SamplingConfig(**{key: (spec,)}))
    assert str(e.value) in message


def test_units_and_cgroups_together_enable_one_kernel_filter() -> None:
    opts = bpf_options(SamplingConfig(cgroups=(f"/sys/fs/cgroup{DEMO}",), units=("nginx.service",)))
    assert opts.filters_cgroups and opts.cgroups_missing_ok
    assert [(s.kind, s.value) for s in opts.cgroup_specs()] == [("path", DEMO), ("unit", "nginx.service")]
    assert "-DFLAMED_FILTER_CGROUPS=1" in bpf_program(opts, fsbase_offset=-1).cflags
    assert not bpf_options(SamplingConfig()).filters_cgroups
