"""A real ``flamed daemon`` process for fault tests: start, talk to, hurt, always kill.

Every wait is bounded; :class:`DaemonProc.cleanup` (called by the fixture in
this directory's conftest.py, in ``finally``) kills the process group, so no
daemon, py-spy child or BPF program outlives a test even when it fails.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from flamed.folded import read_folded
from support import write_config

ROOT = Path(__file__).resolve().parents[2]
#: How long a BPF daemon may take to compile its program and answer (2 shared cores).
START_TIMEOUT = 90.0


def base_config(tmp: Path, **over: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A small, fast daemon: 99 Hz, 1 s windows, 2 s files, metrics on an ephemeral port."""
    cfg: dict[str, dict[str, Any]] = {
        "sampling": {"frequency": 99, "drain_interval": 1.0},
        "output": {"state_dir": str(tmp / "state"), "rotate_interval": 2.0},
        "metrics": {"address": "127.0.0.1:0"},
        "control": {"socket": str(tmp / "run" / "flamed.sock")},
        "log": {"target": "stderr", "level": "info"},
        # Mixed mode watches every Python process of the machine (other tests'
        # too): off unless a test is about it.
        "processors.python": {"enabled": False},
    }
    for table, kv in over.items():
        table = table.replace("__", ".")
        cfg.setdefault(table, {}).update(kv)
    return cfg


class DaemonProc:
    def __init__(self, tmp: Path, config: dict[str, dict[str, Any]], *, name: str = "daemon",
                 argv_prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.tmp = tmp
        self.config = config
        self.cfg_path = tmp / f"{name}.toml"
        self.log_path = tmp / f"{name}.log"
        self.argv_prefix = list(argv_prefix)
        self.env = env
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def state_dir(self) -> Path:
        return Path(self.config["output"]["state_dir"])

    @property
    def socket_path(self) -> str:
        return str(self.config["control"]["socket"])

    # -- lifecycle -------------------------------------------------------
    def start(self, wait: bool = True, timeout: float = START_TIMEOUT) -> DaemonProc:
        write_config(self.cfg_path, self.config)
        Path(self.socket_path).parent.mkdir(parents=True, exist_ok=True)
        self.log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in cleanup
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = self.argv_prefix + [sys.executable, "-m", "flamed", "daemon", "--config", str(self.cfg_path)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self.log_fh, stderr=self.log_fh, env=env, cwd=str(ROOT),
            start_new_session=True, preexec_fn=self.preexec_fn,
        )
        self.starts += 1
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode} before it was ready:\n{self.log()[-3000:]}")
            if os.path.exists(self.socket_path):
                try:
                    st = self.status(timeout=5)
                except Exception as e:  # noqa: BLE001 - not ready yet
                    last = e
                else:
                    # Another daemon on the same socket is not this one ready (a
                    # wrapper in argv_prefix may run the daemon under another pid).
                    if self.argv_prefix or st.get("pid") == self.proc.pid:
                        return st
                    last = AssertionError(f"the socket is answered by pid {st.get('pid')}, not this daemon")
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready within {timeout:g} s ({last}):\n{self.log()[-3000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit within {timeout:g} s:\n{self.log()[-3000:]}") from None

    def kill9(self) -> None:
        """SIGKILL the daemon only (its py-spy children must die by PDEATHSIG, not by us)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.proc is not None:
            # Whatever the daemon started in its session (py-spy, workloads) goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.log_fh.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- talking ---------------------------------------------------------
    def request(self, req: dict[str, Any], timeout: float = 30.0) -> tuple[dict[str, Any], bytes]:
        from flamed.daemon.client import request

        buf = io.BytesIO()
        head = request(self.socket_path, req, buf, timeout=timeout)
        return head, buf.getvalue()

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        head, _ = self.request({"request": "status"}, timeout=timeout)
        return head["status"]  # type: ignore[no-any-return]

    def metrics_text(self, timeout: float = 10.0) -> str:
        addr = self.status()["metrics"]
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as r:
            return r.read().decode()  # type: ignore[no-any-return]

    def metric(self, name: str, labels: dict[str, str] | None = None, text: str | None = None) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return metric_value(text if text is not None else self.metrics_text(), name, labels)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def wait_for(self, pred: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            if not self.alive():
                raise AssertionError(f"daemon died while waiting for {what}:\n{self.log()[-3000:]}")
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}:\n{self.log()[-2000:]}")


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group("name") != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group("labels") or ""))
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        total += float(m.group("value"))
    return total


# ---------------------------------------------------------------------------
# Checking a state directory


def profile_files(state: Path) -> list[Path]:
    return sorted(p for p in state.iterdir() if re.search(r"-\d{8}T\d{6}Z(?:-\d+)?\.folded(?:\.gz)?$", p.name)
                  and not p.is_symlink())


def check_state_dir(state: Path, *, allow_orphans: bool = False) -> dict[str, Any]:
    """Every file parses strictly and agrees with its sidecar; returns totals.

    Raises AssertionError naming the first file that is partial, corrupt,
    orphaned or inconsistent.
    """
    names = set(os.listdir(state))
    temps = sorted(n for n in names if n.endswith(".tmp"))
    files = profile_files(state)
    totals = {"files": 0, "weight": 0, "samples": 0, "lost": {}, "recovered": 0, "bytes": 0}
    for f in files:
        stem = re.sub(r"\.folded(\.gz)?$", "", f.name)
        side = state / (stem + ".json")
        try:
            meta = json.loads(side.read_text())
            raw = f.read_bytes()
        except FileNotFoundError:
            if not f.exists():
                continue  # a running daemon's retention deleted it since the listing
            raise AssertionError(f"{f.name} has no sidecar") from None
        assert meta["bytes"] == len(raw), f"{f.name}: {len(raw)} bytes, sidecar says {meta['bytes']}"
        assert meta["sha256"] == hashlib.sha256(raw).hexdigest(), f"{f.name}: content differs from its sidecar's sha256"
        data = gzip.decompress(raw) if f.name.endswith(".gz") else raw
        assert data == b"" or data.endswith(b"\n"), f"{f.name}: last line is cut"
        prof = read_folded(io.BytesIO(data), source=str(f), strict=True)
        weight = prof.total()
        totals["files"] += 1
        totals["bytes"] += len(raw) + side.stat().st_size
        if meta.get("recovered"):
            totals["recovered"] += 1
            continue
        assert meta["weight"] == weight, f"{f.name}: folded counts sum to {weight}, sidecar says {meta['weight']}"
        assert meta["stacks"] == len(prof.stacks) or meta["stacks"] == data.count(b"\n"), f"{f.name}: stack count"
        totals["weight"] += weight
        totals["samples"] += meta["samples"]
        for r, n in meta.get("lost", {}).items():
            totals["lost"][r] = totals["lost"].get(r, 0) + n
    def orphaned(names: set[str]) -> list[str]:
        """The sidecars in ``names`` without their file."""
        return [n for n in names if n.endswith(".json") and not n.startswith("latest")
                and not {n[: -len(".json")] + ".folded", n[: -len(".json")] + ".folded.gz"} & names]

    orphans = orphaned(names)
    if orphans and not allow_orphans:
        # A running daemon's retention deletes a file, then its sidecar: a listing
        # between the two sees an orphan for a moment.  One still there a moment later is not that.
        time.sleep(0.3)
        orphans = [n for n in orphaned(set(os.listdir(state))) if n in orphans]
    # A crash between the sidecar's rename and the file's leaves an orphan sidecar, which recovery removes.
    assert allow_orphans or not orphans, f"orphan sidecars {orphans}"
    totals["temps"] = temps
    totals["orphans"] = orphans
    return totals


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: 96k) mounted on the existing directory ``mnt``, unmounted after."""
    import pytest

    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (needs root): {r.stderr}")
    try:
        yield mnt
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@contextlib.contextmanager
def workload(code: str, n: int = 1) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` Python processes running ``code``; killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


BUSY = "import time\nend=time.time()+120\nwhile time.time()<end:\n    sum(i*i for i in range(5000))\n"


def unix_request_raw(path: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, half-close, read the whole answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
        return b"".join(chunks)
    finally:
        s.close()
