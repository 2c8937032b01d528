"""The unit's promises hold for the real program.

The daemon is started the way systemd would start systemd/flamed.service --
its CapabilityBoundingSet, AmbientCapabilities, SecureBits, NoNewPrivileges
and User= translated to ``setpriv`` -- and must sample a Python workload and
run py-spy on it.  Then each capability is removed in turn: the daemon must
either refuse to start or report the degradation, naming the capability.  A
capability whose removal changes nothing observable is not needed: the test
says so (and the figure goes to docs/reliability.md).

systemd is not PID 1 here, so setpriv is the faithful stand-in: same kernel
calls (prctl bounding set, securebits, capset, ambient raise, NNP) before
execve.  ``systemd-analyze security --offline=true`` scores the unit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cpython_support import need_pyenv
from support import SCALE, need
from daemonproc import DaemonProc, base_config
from test_daemon_faults import record_figure

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "flamed.service"


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """``[Service]`` settings; repeated keys accumulate, an empty assignment resets (systemd's rule)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or "=" not in line:
            continue
        k, v = line.split("=", 1)
        k, v = k.strip(), v.strip()
        if not v:
            out[k] = []
        else:
            out.setdefault(k, []).extend(v.split())
    return out


def _cap_names(values: list[str]) -> list[str]:
    return [v.lower().removeprefix("cap_") for v in values if v.upper().startswith("CAP_")]


def setpriv_argv(settings: dict[str, list[str]], drop: str | None = None) -> list[str]:
    """The setpriv command line that gives a process what the unit gives ExecStart."""
    bounding = [c for c in _cap_names(settings.get("CapabilityBoundingSet", [])) if c != drop]
    ambient = [c for c in _cap_names(settings.get("AmbientCapabilities", [])) if c != drop and c in bounding]
    argv = ["setpriv", "--bounding-set=-all" + "".join(f",+{c}" for c in bounding)]
    if ambient:
        caps = "".join(f",+{c}" for c in ambient)
        argv += [f"--inh-caps=-all{caps}", f"--ambient-caps=-all{caps}"]
    else:
        argv += ["--inh-caps=-all"]
    bits = []
    for b in settings.get("SecureBits", []):
        bits.append("+" + b.replace("-", "_"))
    if bits:
        argv.append("--securebits=" + ",".join(bits))
    if (settings.get("NoNewPrivileges") or ["no"])[-1] in ("yes", "true", "1"):
        argv.append("--no-new-privs")
    user = (settings.get("User") or [""])[-1]
    if user and user != "root":
        import pwd

        pw = pwd.getpwnam(user)
        argv += [f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]
    return argv + ["--"]


WORK = r"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"capwork", 0, 0, 0)
end = time.time() + 120
def capwork_hot():
    s = 0
    for i in range(20000):
        s += i * i
    return s
while time.time() < end:
    capwork_hot()
    os.stat("/")
"""


@contextlib.contextmanager
def _conditions_for(cap: str) -> Iterator[dict[str, Any]]:
    """The situation in which ``cap`` matters, set up for the run and undone after it."""
    if cap == "syslog":
        path = Path("/proc/sys/kernel/kptr_restrict")
        old = path.read_text().strip()
        path.write_text("1")
        try:
            yield {}
        finally:
            path.write_text(old)
    elif cap == "chown":
        gname = f"flamedcap{os.getpid() % 100000}"
        subprocess.run(["groupadd", "--system", gname], check=True, capture_output=True)
        try:
            yield {"control": {"socket_group": gname, "allowed_groups": [gname]}}
        finally:
            subprocess.run(["groupdel", gname], capture_output=True)
    else:
        yield {}


def run_with(tmp: Path, name: str, argv_prefix: list[str], observe: float = 8.0, **over: Any) -> dict[str, Any]:
    """Start the daemon under ``argv_prefix`` with mixed mode on a Python workload; what happened."""
    wl = subprocess.Popen([sys.executable, "-c", WORK], start_new_session=True)
    cfg = base_config(tmp / name, sampling={"frequency": 99, "drain_interval": 1.0},
                      processors__python={"enabled": True, "source": "pyspy", "window_s": 2.0,
                                          "include_comm": "^capwork$"}, **over)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    d = DaemonProc(tmp / name, cfg, argv_prefix=argv_prefix)
    res: dict[str, Any] = {"name": name}
    try:
        d.start(wait=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and d.alive() and not os.path.exists(d.socket_path):
            time.sleep(0.1)
        if not d.alive():
            res.update(started=False, rc=d.proc.returncode if d.proc else None, log=d.log())
            return res
        d.wait_ready(60)
        caps = re.search(r"CapEff:\s*([0-9a-f]+)", Path(f"/proc/{d.pid}/status").read_text())
        res["cap_eff"] = caps.group(1) if caps else None
        # Wait for py-spy to finish a window on the workload (or fail), bounded.
        t_end = time.monotonic() + observe + 20
        st: dict[str, Any] = {}
        while time.monotonic() < t_end:
            st = d.status()
            py = st.get("processors", {}).get("python", {})
            if py.get("pyspy_completed", 0) >= 1 and py.get("join_matched", 0) > 0:
                break
            if any(v for k, v in py.items() if k.startswith("pyspy_failed_")) and time.monotonic() > t_end - 20:
                break
            if time.monotonic() > t_end - 20 and "no CAP_" in d.log():
                break  # the daemon named a capability it lacks and starts no py-spy: nothing more will come
            time.sleep(0.5)
        head, payload = d.request({"request": "snapshot", "seconds": 30, "pid": wl.pid, "format": "folded"})
        res.update(started=True, status=st, python=st.get("processors", {}).get("python", {}),
                   workload_weight=head["weight"], workload_frames=payload.decode(errors="replace"),
                   socket_group=os.stat(d.socket_path).st_gid)
    finally:
        d.cleanup()
        os.killpg(wl.pid, 9)
        wl.wait(10)
        res["log"] = d.log()
    return res


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    need(os.geteuid() == 0, "root")
    need(shutil.which("setpriv") is not None, "setpriv (util-linux)")
    try:
        import bcc  # noqa: F401
    except Exception:
        need(False, "bcc")
    return run_with(tmp_path_factory.mktemp("caps"), "full", setpriv_argv(unit_settings()))


def test_unit_capabilities_sample_and_run_pyspy(full_run: dict[str, Any]) -> None:
    r = full_run
    assert r["started"], f"the daemon does not start with the unit's privileges:\n{r['log'][-2000:]}"
    assert r["workload_weight"] > 0, "the Python workload was not sampled"
    py = r["python"]
    assert py.get("pyspy_completed", 0) >= 1, py
    assert py.get("pyspy_failed_permission", 0) == 0, py
    assert "capwork_hot" in r["workload_frames"], "no Python frame of the workload (py-spy did not join)"


#: What removing each capability must produce: a refusal to start, or a log line, naming it.
ALL_CAPS = ["bpf", "perfmon", "sys_ptrace", "sys_resource", "syslog", "chown"]
CORE = ["perfmon", "sys_ptrace"]  # CI: one refusal, one degradation; FLAMED_FAULT_SCALE=1 runs all


@pytest.mark.parametrize("cap", ALL_CAPS if SCALE >= 1 else CORE)
def test_each_capability_is_needed_and_named(cap: str, full_run: dict[str, Any],
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    settings = unit_settings()
    bounding = _cap_names(settings.get("CapabilityBoundingSet", []))
    if cap not in bounding:
        pytest.skip(f"CAP_{cap.upper()} is not in the unit's bounding set")
    with _conditions_for(cap) as extra_cfg:
        r = run_with(tmp_path_factory.mktemp(f"no-{cap}"), f"no-{cap}", setpriv_argv(settings, drop=cap),
                     **extra_cfg)
        if cap == "chown" and r["started"]:
            # Observable effect: the socket keeps root's group, members of the group cannot connect.
            import grp

            if r["socket_group"] != grp.getgrnam(extra_cfg["control"]["socket_group"]).gr_gid:
                r["workload_frames"] += "\n[socket not given to its group]"
    name = f"CAP_{cap.upper()}"
    if cap == "syslog" and r["started"] and not re.search(r"\w_\[k\]", r["workload_frames"].replace("[unknown]_[k]", "")):
        r["workload_frames"] = r["workload_frames"].replace("capwork_hot", "capwork_hot (kernel frames unsymbolized)")
    effect: str
    if not r["started"]:
        effect = "refuses to start"
        assert name in r["log"], f"without {name} the daemon fails without naming it:\n{r['log'][-1500:]}"
    else:
        py = r["python"]
        named = name in r["log"]
        if "[socket not given to its group]" in r["workload_frames"]:
            effect = "control socket not given to its group (members cannot connect)"
        elif "(kernel frames unsymbolized)" in r["workload_frames"]:
            effect = "kernel frames unsymbolized (kernel.kptr_restrict=1)"
        elif py.get("pyspy_failed_permission", 0) > 0:
            effect = "py-spy refused (counted as permission failures)"
        elif "capwork_hot" not in r["workload_frames"]:
            effect = "no Python frames"
        else:
            effect = "no observable effect"
        _effects[cap] = {"effect": effect, "named_in_log": named}
        record_figure("capabilities", _effects)
        assert effect != "no observable effect", (
            f"{name} is in the unit's CapabilityBoundingSet, but the daemon samples and runs py-spy without it: "
            "drop it from systemd/flamed.service (or document the kernel where it is needed)")
        if not named:
            # A known gap, kept visible in the summary (docs/reliability.md lists it): the daemon
            # degrades without saying which capability is missing.
            pytest.xfail(f"without {name}: {effect}, but no log line names {name}")
        return
    _effects[cap] = {"effect": effect}
    record_figure("capabilities", _effects)


_effects: dict[str, Any] = {}


# ---------------------------------------------------------------------------
# systemd-analyze security

#: Why each item systemd-analyze still marks exposed is needed (docs/reliability.md has the same table).
EXPOSURE_REASONS = {
    "SystemCallFilter=~@resources": "bcc raises RLIMIT_MEMLOCK (setrlimit) for BPF maps",
    "SystemCallFilter=~@privileged": "chown of the control socket to its group",
    "SystemCallFilter=~@debug": "perf_event_open (sampling), ptrace and process_vm_readv (py-spy)",
    "RootDirectory=/RootImage=": "symbols are read from every binary on the host",
    "User=/DynamicUser=": "uid 0 owns tracefs (uprobe_events) and reads every process's binaries; capabilities are bounded",
    "ProtectKernelLogs=": "ProtectKernelLogs=yes would drop CAP_SYSLOG, which names kernel frames under kptr_restrict=1",
    "CapabilityBoundingSet=~CAP_BPF": "the BPF sampler",
    "PrivateMounts=": "the daemon reads /proc/PID/root of every process for symbols",
    "CapabilityBoundingSet=~CAP_(CHOWN|FSETID|SETFCAP)": "CAP_CHOWN: give the control socket to group flamed",
    "ProtectKernelTunables=": "bcc registers uprobes through tracefs (/sys/kernel/tracing/uprobe_events)",
    "RestrictAddressFamilies=~AF_NETLINK": "proc connector (process exec/exit events for mixed mode)",
    "RestrictAddressFamilies=~AF_UNIX": "control socket, journald, sd_notify",
    "RestrictAddressFamilies=~AF_(INET|INET6)": "Prometheus metrics endpoint (loopback by default)",
    "ProtectHome=": "read-only: binaries under /home are symbolized",
    "CapabilityBoundingSet=~CAP_SYS_PTRACE": "py-spy reads Python processes; /proc/PID/maps of other users",
    "CapabilityBoundingSet=~CAP_SYS_(NICE|RESOURCE)": "CAP_SYS_RESOURCE: RLIMIT_MEMLOCK for BPF maps on kernels < 5.11",
    "ProtectProc=": "every process is profiled: /proc must show them all",
    "ProcSubset=": "/proc/kallsyms and /proc/sys are read",
    "PrivateNetwork=": "the metrics endpoint must be reachable by Prometheus",
    "PrivateUsers=": "processes of every user are profiled",
    "CapabilityBoundingSet=~CAP_SYSLOG": "kernel symbol addresses when kernel.kptr_restrict=1",
    "DeviceAllow=": "PrivateDevices' default set (char-rtc read)",
    "IPAddressDeny=": "localhost allowed for the metrics endpoint",
    "UMask=": "profile files are meant to be read by unprivileged users (flamegraph.pl)",
}


def test_systemd_analyze_security_exposure_and_every_exposed_item_justified(tmp_path: Path) -> None:
    need(shutil.which("systemd-analyze") is not None, "systemd-analyze (Debian systemd)")
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNIT)],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    m = re.search(r"Overall exposure level for flamed\.service: ([0-9.]+)", out)
    assert m, out[-2000:]
    exposure = float(m.group(1))
    exposed = []
    for line in out.splitlines():
        if line.startswith("✗"):
            parts = re.split(r"\s{2,}", line[1:].strip())
            exposed.append({"item": parts[0], "what": parts[1] if len(parts) > 2 else "", "weight": parts[-1]})
    unexplained = [e["item"] for e in exposed if e["item"] not in EXPOSURE_REASONS]
    record_figure("systemd_security", {"exposure": exposure, "exposed": [
        dict(e, reason=EXPOSURE_REASONS.get(e["item"], "?")) for e in exposed]})
    assert exposure <= 5.0, out[-3000:]
    assert not unexplained, f"exposed items without a documented reason: {unexplained}"


# ---------------------------------------------------------------------------
# CAP_CHECKPOINT_RESTORE: an interpreter replaced while it runs


@contextlib.contextmanager
def _replaced_interpreter(tmp: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The capwork workload run by pyenv's 3.12 from a copy of its libpython,
    deleted once it runs, as a package upgrade replaces a running service's
    libraries: its maps then name ``libpython3.12.so.1.0 (deleted)``, which
    only /proc/PID/map_files opens.  (A replaced executable opens as
    /proc/PID/exe, without the capability: tests/unit/test_probe_replaced.py.)"""
    prefix = need_pyenv("3.12")
    lib = tmp / "libpython3.12.so.1.0"
    shutil.copy2(prefix / "lib" / lib.name, lib)
    wl = subprocess.Popen([str(prefix / "bin" / "python3.12"), "-c", WORK],
                          env=dict(os.environ, LD_LIBRARY_PATH=str(tmp)), start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "capwork" not in Path(f"/proc/{wl.pid}/comm").read_text():
            time.sleep(0.02)
        lib.unlink()
        assert f"{lib} (deleted)" in Path(f"/proc/{wl.pid}/maps").read_text()
        yield wl
    finally:
        os.killpg(wl.pid, 9)
        wl.wait(10)


def _record_under(argv_prefix: list[str], pid: int, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*argv_prefix, sys.executable, "-m", "flamed", "record", "--no-daemon", "-p", str(pid),
                           "-d", "2", "-r", "99", "-o", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)


def test_unit_capabilities_read_an_interpreter_replaced_while_it_runs(tmp_path: Path) -> None:
    """With the unit's capabilities, a process whose interpreter was replaced
    on disk keeps its Python frames (the file is read through
    /proc/PID/map_files); without CAP_CHECKPOINT_RESTORE it has none, and a
    warning names the capability."""
    need(os.geteuid() == 0, "root")
    need(shutil.which("setpriv") is not None, "setpriv (util-linux)")
    settings = unit_settings()
    assert "checkpoint_restore" in _cap_names(settings.get("CapabilityBoundingSet", []))
    with _replaced_interpreter(tmp_path) as wl:
        full = _record_under(setpriv_argv(settings), wl.pid, tmp_path / "full.folded")
        without = _record_under(setpriv_argv(settings, drop="checkpoint_restore"), wl.pid, tmp_path / "without.folded")
    assert full.returncode == 0, full.stderr
    lines = (tmp_path / "full.folded").read_text().splitlines()
    total = sum(int(ln.rsplit(" ", 1)[1]) for ln in lines)
    hot = sum(int(ln.rsplit(" ", 1)[1]) for ln in lines if "capwork_hot (<string>:" in ln)
    assert total >= 50 and hot / total >= 0.8, (hot, total, lines[:3], full.stderr[-1500:])
    assert "CAP_CHECKPOINT_RESTORE" not in full.stderr, full.stderr
    assert without.returncode == 0, without.stderr
    text = (tmp_path / "without.folded").read_text()
    assert "capwork_hot" not in text, text[:500]
    assert re.search(r"cannot open \S+ \(deleted\) of pid \d+: it was deleted or replaced since it was mapped .*"
                     r"needs CAP_CHECKPOINT_RESTORE", without.stderr), without.stderr[-2000:]
    assert "1 mapped file(s) could not be opened" in without.stderr, without.stderr[-2000:]
