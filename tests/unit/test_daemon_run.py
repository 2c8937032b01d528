"""The daemon in-process with the fake sampler: drain totals, files, socket, metrics, processors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from flamed import outputs
from flamed.daemon.client import DaemonError, request
from flamed.daemon.core import Daemon
from flamed.daemon.fake import BUSY_PID, FakeSampler
from flamed.daemon.processors import WindowProcessor
from flamed.daemon.testing import fast_config, running_daemon
from flamed.errors import CapabilityError
from flamed.fileio import open_input
from flamed.folded import read_folded
from flamed.sampling.contract import Window

from support import have_root, need


def fake_factory(holder: list[FakeSampler], **kw: object):
    def make(cfg):  # type: ignore[no-untyped-def]
        s = FakeSampler(cfg.sampling.frequency, **kw)  # type: ignore[arg-type]
        holder.append(s)
        return s
    return make


def files_total(d: Path) -> tuple[int, int, int]:
    """(sum of weights in folded files, sum of sidecar samples, number of files)."""
    weight = samples = n = 0
    for f in sorted(d.glob("*.folded*")):
        if f.is_symlink():
            continue
        with open_input(f) as fh:
            weight += int(read_folded(fh).total())
        meta = json.loads(f.with_name(f.name.split(".folded")[0] + ".json").read_text())
        samples += meta["samples"]
        n += 1
    return weight, samples, n


def raw(path: str, data: bytes, *, shut: bool = True, timeout: float = 5.0) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def test_every_sample_lands_in_a_file_exactly_once(tmp_path: Path) -> None:
    samplers: list[FakeSampler] = []
    cfg = fast_config(tmp_path)
    with running_daemon(cfg, sampler_factory=fake_factory(samplers)) as d:
        deadline = time.monotonic() + 10
        while d.store.files_written < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    fake = samplers[0]
    assert fake.closed and fake.produced > 0
    weight, samples, n = files_total(tmp_path / "profiles")
    assert n >= 3
    # the last partial window was drained and written at stop
    assert weight == samples == fake.produced == d.totals["samples"]
    latest = tmp_path / "profiles" / "latest.folded"
    assert latest.is_symlink() and os.readlink(latest) == os.path.basename(d.store.last_written or "")


def test_snapshot_every_registered_format(tmp_path: Path) -> None:
    with running_daemon(fast_config(tmp_path), sampler_factory=fake_factory([])) as d:
        time.sleep(0.3)
        sock = str(tmp_path / "flamed.sock")
        served = 0
        for fmt in outputs.names():
            if not _writes_profiles(fmt):
                # a format that needs timestamped samples: a clean error, not a traceback
                with pytest.raises(DaemonError):
                    request(sock, {"request": "snapshot", "format": fmt})
                continue
            served += 1
            out = tmp_path / f"snap.{fmt}"
            with open(out, "wb") as f:
                head = request(sock, {"request": "snapshot", "seconds": 30, "format": fmt, "pid": BUSY_PID}, f)
            data = out.read_bytes()
            assert head["ok"] and head["format"] == fmt and head["length"] == len(data) > 0, fmt
            assert head["stacks"] == 3 and head["weight"] > 0, fmt
        with open(tmp_path / "snap.folded", "rb") as f:
            p = read_folded(f)
        assert {s[0] for s in p.stacks} == {f"fake-busy-{BUSY_PID}"}
        assert (f"fake-busy-{BUSY_PID}", "_start", "main", "busy_loop", "spin") in p.stacks
        # root and frame filters are applied by the daemon
        import io

        buf = io.BytesIO()
        request(sock, {"request": "snapshot", "frames": "kernel", "root": "comm", "comm": "idle"}, buf)
        assert buf.getvalue().split(b" ")[0] == b"fake-idle;entry_SYSCALL_64_[k];do_sys_poll_[k]"
        st = request(sock, {"request": "status"})["status"]
        assert st["sampler"] == "fake" and st["samples"] > 0 and st["socket"] == sock
        # Counted once the whole answer was sent: by the serving thread, maybe just after the client read it.
        deadline = time.monotonic() + 10
        while d.metrics.registry.get_sample_value("flamed_control_requests_total",
                                                  {"request": "snapshot", "result": "ok"}) != served + 1:
            assert time.monotonic() < deadline, "the snapshots to be counted"
            time.sleep(0.02)
        assert served >= 2


def _writes_profiles(fmt: str) -> bool:
    """Can ``fmt`` write an aggregated Profile (not only a sample stream)?"""
    import io

    from flamed.errors import FlamedError
    from flamed.model import Profile

    try:
        outputs.get(fmt).write(Profile({("a", "b"): 1}, start_ns=0, end_ns=1), io.BytesIO())
    except FlamedError:
        return False
    return True


def test_next_snapshot_covers_only_the_future(tmp_path: Path) -> None:
    import io

    with running_daemon(fast_config(tmp_path, sampling={"drain_interval": 1.0}, output={"rotate_interval": 5.0}),
                        sampler_factory=fake_factory([])):
        before = time.time_ns()
        buf = io.BytesIO()
        head = request(str(tmp_path / "flamed.sock"), {"request": "snapshot", "next": 0.6}, buf)
        after = time.time_ns()
        assert before - 250_000_000 <= head["start_ns"] and head["end_ns"] <= after
        # ~0.6 s at 100 Hz: the span is 0.6 s give or take one forced-drain spacing
        assert 0.5e9 <= head["end_ns"] - head["start_ns"] <= 1.0e9
        assert 40 <= head["weight"] <= 110


class SlowDrainSampler(FakeSampler):
    """A sampler whose drain takes a while after its window ends, as the BPF
    sampler's does on a busy host (the maps are read, then symbolized)."""

    DRAIN_SECONDS = 0.6

    def drain(self) -> Window:
        w = super().drain()
        time.sleep(self.DRAIN_SECONDS)
        return w


def test_a_short_seconds_snapshot_holds_the_window_drained_for_it(tmp_path: Path) -> None:
    """``seconds`` counts back from the request, not from the end of the drain it asks for:
    a drain longer than N seconds used to leave every window out (an empty answer)."""
    import io

    cfg = fast_config(tmp_path, sampling={"drain_interval": 5.0}, output={"rotate_interval": 60.0})
    with running_daemon(cfg, sampler_factory=lambda c: SlowDrainSampler(c.sampling.frequency)):
        time.sleep(0.5)
        for _ in range(2):  # the second one right after: its drain waits for the spacing, or is the first's
            before = time.time_ns()
            buf = io.BytesIO()
            head = request(str(tmp_path / "flamed.sock"), {"request": "snapshot", "seconds": 0.3}, buf)
            assert head["windows"] >= 1 and head["weight"] > 0 and buf.getvalue(), head
            # whole windows: the newest one ends after the request came (its forced drain)
            assert head["end_ns"] >= before - 250_000_000


def test_flush_rotates_now(tmp_path: Path) -> None:
    with running_daemon(fast_config(tmp_path, output={"rotate_interval": 60.0}),
                        sampler_factory=fake_factory([])) as d:
        time.sleep(0.25)
        head = request(str(tmp_path / "flamed.sock"), {"request": "flush"})
        assert head["file"] and Path(head["file"]).exists()
        assert d.store.files_written == 1



def test_the_heap_is_trimmed_after_the_file_a_drain_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain that ends a period writes the file, then trims the heap: the
    file's text, freed once written, goes back to the kernel at once, not at
    the next drain (docs/bpf.md, "the trim after the file")."""
    import flamed.daemon.loop as loop_mod  # noqa: PLC0415 - the names patched are the loop's

    events: list[str] = []
    orig_drain = loop_mod.DrainLoop.drain_once

    def drain_once(self, *a, **k):  # type: ignore[no-untyped-def]
        events.append("begin")
        try:
            return orig_drain(self, *a, **k)
        finally:
            events.append("end")

    monkeypatch.setattr(loop_mod.DrainLoop, "drain_once", drain_once)
    monkeypatch.setattr(loop_mod, "trim_heap", lambda: events.append("trim") or True)
    with running_daemon(fast_config(tmp_path, output={"rotate_interval": 60.0}),
                        sampler_factory=fake_factory([])) as d:
        orig_rotate = d.store.rotate

        def rotate(*a, **k):  # type: ignore[no-untyped-def]
            events.append("rotate")
            return orig_rotate(*a, **k)

        monkeypatch.setattr(d.store, "rotate", rotate)
        time.sleep(0.25)
        head = request(str(tmp_path / "flamed.sock"), {"request": "flush"})
        assert head["file"] and d.store.files_written == 1
    # The drains, each from its "begin" to its "end"; the flush's is the one that rotated.
    drains: list[list[str]] = []
    cur: list[str] | None = None
    for e in events:
        if e == "begin":
            cur = []
        elif e == "end":
            assert cur is not None
            drains.append(cur)
            cur = None
        elif cur is not None:  # a rotation outside a drain (the daemon's stop) is not the point here
            cur.append(e)
    rotated = [x for x in drains if "rotate" in x]
    assert rotated, events
    for x in rotated:
        assert "trim" in x[x.index("rotate"):], x


def test_bad_clients_get_errors_and_do_not_stall_others(tmp_path: Path) -> None:
    # the silent clients must hold their slots through the checks below, even on a loaded machine
    cfg = fast_config(tmp_path, control={"client_timeout": 8.0, "request_timeout": 8.0, "max_connections": 3})
    with running_daemon(cfg, sampler_factory=fake_factory([])) as d:
        sock = str(tmp_path / "flamed.sock")

        def err(data: bytes) -> dict:
            line = raw(sock, data).split(b"\n")[0]
            obj = json.loads(line)
            assert obj["ok"] is False and "Traceback" not in obj["error"]
            return obj

        assert err(b"{not json\n")["code"] == "bad_request"
        assert "unknown field" in err(b'{"request":"snapshot","color":"red"}\n')["error"]
        assert err(b"x" * (70 * 1024) + b"\n")["code"] == "too_large"
        assert err(b'{"request":"snapshot","frame":"(a+)+$"}\n')["code"] == "bad_request"
        assert err(b"\n")["code"] == "bad_request"
        # The daemon counts a connection until its thread has closed it, which on a
        # loaded machine may be after the client read the answer: start from none open.
        deadline = time.monotonic() + 10
        while d.control.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.control.connections == 0
        # two silent clients hold two of three connections; a third client is still served at once
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        for s in silent:
            s.connect(sock)
        assert request(sock, {"request": "status"})["ok"]
        for s in silent:  # served while both silent clients were still waiting for their timeout
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
            s.setblocking(True)
        # a fourth connection while three are open is told so.  First the
        # status request's connection must be gone (its thread closes it a
        # moment after the answer): counted instead of the third, it would let
        # the fourth be accepted before the third.
        deadline = time.monotonic() + 5
        while d.control.connections > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        third = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        third.connect(sock)
        while d.control.connections < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.control.connections == 3
        with pytest.raises(DaemonError) as e:
            request(sock, {"request": "status"})
        assert e.value.code == "busy"
        third.close()
        # the silent ones time out with an error, and the drain kept its schedule meanwhile
        for s in silent:
            s.settimeout(30)
            obj = json.loads(s.recv(4096).split(b"\n")[0])
            assert obj["code"] == "timeout"
            s.close()
        drains = d.metrics.registry.get_sample_value("flamed_drains_total")
        assert drains is not None and drains >= 8
        results = {s.labels["result"] for fam in d.metrics.registry.collect() for s in fam.samples
                   if s.name == "flamed_control_requests_total"}
        assert {"bad_request", "too_large", "busy", "timeout", "ok"} <= results


def test_metrics_over_http_pass_promtool_and_match_files(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool (Debian package prometheus)")
    samplers: list[FakeSampler] = []
    prof = tmp_path / "profiles"

    def written() -> tuple[int, int, int]:
        w, samples, n = files_total(prof)
        size = sum(f.stat().st_size for f in prof.iterdir() if not f.is_symlink() and f.name != ".flamed.lock")
        return n, size, samples

    with running_daemon(fast_config(tmp_path), sampler_factory=fake_factory(samplers)) as d:
        deadline = time.monotonic() + 10
        while d.store.files_written < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # drains (every 0.1 s) and rotations (every 0.5 s) go on while we look: the scrape
        # must lie between what the files held at a flush before it and at a flush after it
        request(str(tmp_path / "flamed.sock"), {"request": "flush"})
        before = written()
        with urllib.request.urlopen(f"http://{d.metrics_server.bound}/metrics", timeout=5) as r:
            text = r.read().decode()
        request(str(tmp_path / "flamed.sock"), {"request": "flush"})
        after = written()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    assert before[0] <= values["flamed_files_written_total"] == values["flamed_disk_files"] <= after[0] - 1
    assert before[1] <= values["flamed_disk_bytes"] <= after[1]
    assert before[2] <= values["flamed_samples_total"] <= after[2]
    assert 'flamed_build_info{python="%s",version="0.1.0"}' % __import__("platform").python_version() in values
    for name in ("flamed_drain_duration_seconds_count", "flamed_last_rotation_timestamp_seconds",
                 "flamed_drain_unique_stacks", "process_resident_memory_bytes"):
        assert name in values, name


def test_the_fake_samplers_tasks_are_no_real_process() -> None:
    """The fake sampler's invented tasks must never be a real process: with
    pids under pid_max, ``flamed record`` of a command that got one of them
    (a host just booted gives small pids) wrote the invented samples as the
    command's."""
    from flamed.daemon.fake import DEFAULT_STACKS, OFFCPU_STACKS

    ids = {i for tgid, tid, _c, _s in DEFAULT_STACKS for i in (tgid, tid)}
    ids |= {i for (tgid, tid, _c, _s), _share in OFFCPU_STACKS for i in (tgid, tid)}
    pid_max_limit = 1 << 22  # PID_MAX_LIMIT: the largest pid_max any 64-bit kernel takes
    assert min(ids) > pid_max_limit >= int(Path("/proc/sys/kernel/pid_max").read_text())


class TagPython(WindowProcessor):
    """Turns the events of watched pids into stacks with a Python frame on top."""

    name = "tag"

    def __init__(self, ctx, options) -> None:  # type: ignore[no-untyped-def]
        super().__init__(ctx, options)
        ctx.sampler.watch(BUSY_PID)
        self.seen = 0

    def process(self, window: Window) -> None:
        keep = []
        for ev in window.events:
            if ev.tid == BUSY_PID:
                key = (ev.tgid, ev.tid, ev.comm, ev.user_stack + ("work (app.py:3)",) + ev.kernel_stack)
                window.counts[key] = window.counts.get(key, 0) + 1
                self.seen += 1
            else:
                keep.append(ev)  # left for the daemon: counted with native frames
        window.events = keep


def test_processor_hook_and_leftover_events(tmp_path: Path) -> None:
    samplers: list[FakeSampler] = []
    with running_daemon(fast_config(tmp_path), sampler_factory=fake_factory(samplers),
                        processor_classes=[TagPython]) as d:
        time.sleep(0.5)
        proc = d.processors[0]
    weight, samples, _ = files_total(tmp_path / "profiles")
    assert weight == samples == samplers[0].produced
    assert isinstance(proc, TagPython) and proc.seen > 0
    stacks: dict = {}
    for f in (tmp_path / "profiles").glob("testhost-*.folded"):
        with open(f, "rb") as fh:
            read_folded(fh, profile=None).stacks and stacks.update(read_folded(open(f, "rb")).stacks)
    assert any("work (app.py:3)" in s for s in stacks)
    # the second thread's events were not claimed: still there, with their native frames
    assert (f"fake-busy-{BUSY_PID}", "_start", "main", "busy_loop", "hash_block") in stacks


def test_capability_error_refuses_to_start(tmp_path: Path) -> None:
    msg = "perf events not permitted: run as root or grant CAP_PERFMON"
    with pytest.raises(CapabilityError, match="CAP_PERFMON"):
        with running_daemon(fast_config(tmp_path), sampler_factory=fake_factory([], fail_start=msg)):
            pass
    assert not (tmp_path / "flamed.sock").exists()


def test_peer_credentials_decide(tmp_path: Path) -> None:
    need(have_root(), "root (to connect as another uid with setpriv)")
    setpriv = shutil.which("setpriv")
    need(setpriv is not None, "setpriv (util-linux)")
    # mode 0666 so the file permission does not decide: SO_PEERCRED must
    # pytest's tmp dirs are 0700: the socket goes where uid 65534 can reach it
    sockdir = Path(tempfile.mkdtemp(prefix="flamed-test-"))
    os.chmod(sockdir, 0o755)
    sock = str(sockdir / "flamed.sock")
    cfg = fast_config(tmp_path, control={"socket": sock, "socket_mode": 0o666, "allowed_users": (),
                                         "allowed_groups": ("4321",)})
    code = ("import sys; from flamed.daemon.client import request; "
            "print(request(sys.argv[1], {'request': 'status'})['ok'])")

    def as_user(uid: int, gid: int, groups: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([setpriv, f"--reuid={uid}", f"--regid={gid}", f"--groups={groups}" if groups else
                               "--clear-groups", sys.executable, "-c", code, sock],
                              capture_output=True, text=True, timeout=30, cwd="/")

    try:
        _check_peers(cfg, as_user)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def _check_peers(cfg, as_user) -> None:  # type: ignore[no-untyped-def]
    with running_daemon(cfg, sampler_factory=fake_factory([])) as d:
        denied = as_user(65534, 65534, "")
        assert denied.returncode != 0 and "permission denied for uid 65534" in denied.stderr
        member = as_user(65534, 65534, "4321")  # supplementary group only
        assert member.returncode == 0 and member.stdout.strip() == "True", member.stderr
        assert d.metrics.registry.get_sample_value("flamed_control_requests_total",
                                                   {"request": "unknown", "result": "denied"}) == 1


def test_disk_refusing_writes_keeps_windows_in_memory_and_serves_snapshots(tmp_path: Path) -> None:
    import io

    samplers: list[FakeSampler] = []
    cfg = fast_config(tmp_path, output={"rotate_interval": 60.0})
    prof = tmp_path / "profiles"
    # Periods end on the minute: a start just before one would close a first
    # period at once and make two backlog files where this checks for one.
    if time.time() % 60.0 > 50.0:
        time.sleep(60.5 - time.time() % 60.0)
    with running_daemon(cfg, sampler_factory=fake_factory(samplers)) as d:
        sock = str(tmp_path / "flamed.sock")
        # the state directory becomes unwritable: a file where the directory was (ENOTDIR/EEXIST)
        shutil.rmtree(prof)
        prof.write_text("not a directory")
        time.sleep(0.3)
        assert request(sock, {"request": "flush"})["file"] is None
        st = request(sock, {"request": "status"})["status"]
        assert st["write_error"] and st["backlog"]["files"] == 1
        buf = io.BytesIO()
        head = request(sock, {"request": "snapshot", "seconds": 30}, buf)
        assert head["weight"] > 0  # served from memory
        errors = sum(s.value for fam in d.metrics.registry.collect() for s in fam.samples
                     if s.name == "flamed_write_errors_total")
        assert errors >= 1
        # space returns: the next drain writes the backlog, oldest first
        prof.unlink()
        path = request(sock, {"request": "flush"})["file"]
        assert path is not None
        st = request(sock, {"request": "status"})["status"]
        assert st["write_error"] is None and st["backlog"]["files"] == 0
    weight, samples, n = files_total(prof)
    assert n >= 2 and weight == samples == samplers[0].produced


def test_flush_says_when_the_file_could_not_be_written(tmp_path: Path) -> None:
    """`flamed flush` (and `snapshot --flush`) while the state directory refuses writes: the
    period is closed but waits in memory.  It said "nothing to write yet" and exit 0."""
    from support import ROOT

    cfg = fast_config(tmp_path, output={"rotate_interval": 60.0})
    prof = tmp_path / "profiles"
    sock = str(tmp_path / "flamed.sock")

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flamed", *argv, "--socket", sock], capture_output=True,
                              text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    with running_daemon(cfg, sampler_factory=fake_factory([])):
        shutil.rmtree(prof)
        prof.write_text("not a directory")  # a file where the directory was: every write fails
        time.sleep(0.3)
        head = request(sock, {"request": "flush"})
        assert head["ok"] and head["file"] is None and "cannot write" in head["write_error"]
        for argv in (["flush"], ["snapshot", "--flush"]):
            time.sleep(0.3)  # a window to close
            r = cli(*argv)
            assert r.returncode == 1, (argv, r.stdout, r.stderr)
            assert r.stdout == ""
            assert r.stderr.startswith(f"flamed {argv[0]}: error: the daemon closed the file but could not write it: "
                                        f"cannot write {prof}/"), r.stderr
        # the directory is back: the backlog and this period are written, and flush names the file
        prof.unlink()
        r = cli("flush")
        assert r.returncode == 0 and Path(r.stdout.strip()).is_file(), (r.stdout, r.stderr)
        assert "write_error" not in request(sock, {"request": "flush"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_refuse_dns_rebinding_but_prometheus_scrapes(tmp_path: Path) -> None:
    """On loopback the metrics server answers only a loopback Host (a page whose name
    resolves to 127.0.0.1 could read /metrics and the stacks of /debug/pprof otherwise),
    and a real Prometheus still scrapes it as 127.0.0.1:PORT and localhost:PORT."""
    import http.client

    prometheus = shutil.which("prometheus")
    need(prometheus is not None, "prometheus (Debian package prometheus)")
    assert prometheus is not None
    samplers: list[FakeSampler] = []
    cfg = fast_config(tmp_path)
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, pprof=True))
    with running_daemon(cfg, sampler_factory=fake_factory(samplers)) as d:
        port = d.metrics_server.port
        assert port is not None
        allowed = (f"127.0.0.1:{port}", f"localhost:{port}", "localhost.", f"[::1]:{port}")
        for path in ("/metrics", "/debug/pprof/profile?seconds=1", "/debug/pprof/heap"):
            # (a profile takes its second: one loopback name asks for it, every other path is asked by each)
            ok_hosts = allowed[:1] if "profile" in path else allowed
            for host, want in (("evil.example", 403), (f"evil.example:{port}", 403),
                               (f"127.0.0.1.evil.example:{port}", 403), (f"127.evil.example:{port}", 403),
                               (f"[::1.evil.example]:{port}", 403), *((h, None) for h in ok_hosts)):
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                c.request("GET", path, headers={"Host": host})
                r = c.getresponse()
                body = r.read()
                c.close()
                if want == 403:
                    assert r.status == 403 and b"loopback host" in body, (path, host, r.status)
                    assert b"flamed_" not in body
                else:
                    assert r.status in (200, 404), (path, host, r.status, body[:200])
                    if path == "/metrics":
                        assert r.status == 200 and b"flamed_samples_total" in body
        # A real scrape: Prometheus names its targets 127.0.0.1:PORT and localhost:PORT.
        web = _free_port()
        conf = tmp_path / "prometheus.yml"
        conf.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                        "  - job_name: flamed\n    static_configs:\n"
                        f"      - targets: ['127.0.0.1:{port}', 'localhost:{port}']\n")
        proc = subprocess.Popen([prometheus, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            health: dict[str, tuple[str, str]] = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/targets", timeout=5) as r:
                        targets = json.loads(r.read())["data"]["activeTargets"]
                    health = {t["labels"]["instance"]: (t["health"], t["lastError"]) for t in targets}
                except OSError:
                    pass
                if len(health) == 2 and all(h != "unknown" for h, _ in health.values()):
                    break
                time.sleep(0.5)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert health == {f"127.0.0.1:{port}": ("up", ""), f"localhost:{port}": ("up", "")}, health


def test_metrics_listen_binds_beside_the_running_listener_and_takes_over_its_port_on_another_host() -> None:
    """A reload binds the new metrics address before closing the running one; the
    same port on another host (127.0.0.1:P -> 0.0.0.0:P) cannot be bound beside it,
    so the running listener gives it up, and gets it back if that bind fails."""
    from prometheus_client import CollectorRegistry

    from flamed.daemon.metrics import MetricsServer

    server = MetricsServer(CollectorRegistry())
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.start("127.0.0.1:0")
        port = server.port
        same = server.listen(f"127.1:{port}")  # the same socket address: nothing to bind
        assert same.server is None and server.serves(same)
        server.switch(same)
        assert server.bound == f"127.0.0.1:{port}" and server.address == f"127.1:{port}"
        other = server.listen(f"0.0.0.0:{port}")  # the running listener gave its port up for it
        assert other.replaced == f"127.1:{port}" and server.bound is None
        server.discard(other)  # a refused reload: served again where it was
        assert server.bound == f"127.0.0.1:{port}" and server.address == f"127.1:{port}"
        other = server.listen(f"0.0.0.0:{port}")
        server.switch(other)
        assert server.bound == f"0.0.0.0:{port}" and server.serves(other)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        with pytest.raises(OSError):
            server.listen(f"127.0.0.1:{blocker.getsockname()[1]}")  # in use: the running one untouched
        assert server.bound == f"0.0.0.0:{port}"
    finally:
        blocker.close()
        server.stop()
