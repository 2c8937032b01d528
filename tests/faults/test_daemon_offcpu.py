"""The daemon's off-CPU profiles, end to end with the fake sampler: files, snapshot, pull, push, config.

The fake sampler invents off-CPU time in fixed shares of each window's wall
time (flamed.daemon.fake.OFFCPU_STACKS), so every figure below has a known
value; the real program is test_daemon_offcpu_bpf.py's.
"""

from __future__ import annotations

import email.parser
import gzip
import io
import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemonproc import ROOT, check_state_dir
from support import write_config
from test_fleet_push import Ingest

from flamed.daemon.client import DaemonError
from flamed.daemon.fake import OFFCPU_STACKS
from flamed.folded import read_folded
from flamed.outputs import profile_pb2 as pb
from flamed.outputs.pprof import read_pprof

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]

IDLE_SHARE = OFFCPU_STACKS[0][1]  # fake-idle's share of wall time off the CPU, in poll


class OffcpuIngest(Ingest):
    """The push tests' ingest server, also decoding off-CPU bodies (pprof, one sample type of time)."""

    def record(self, path: str, headers: dict[str, str], body: bytes) -> None:
        from urllib.parse import parse_qs, urlsplit

        q = {k: v[0] for k, v in parse_qs(urlsplit(path).query).items()}
        ctype = headers.get("content-type", "")
        if q.get("format") != "pprof" or not ctype.startswith("multipart/form-data"):
            return super().record(path, headers, body)
        msg = email.parser.BytesParser().parsebytes(f"Content-Type: {ctype}\r\n\r\n".encode() + body)
        raw = {p.get_param("name", header="content-disposition"): p.get_payload(decode=True)
               for p in msg.get_payload()}["profile"]
        prof = pb.Profile()
        prof.ParseFromString(gzip.decompress(raw))
        types = [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type]
        if ("samples", "count") in types:
            return super().record(path, headers, body)
        r = {"path": urlsplit(path).path, "q": q, "headers": headers, "types": types,
             "weight": sum(s.value[0] for s in prof.sample),
             "labels": {prof.string_table[lb.key] for s in prof.sample for lb in s.label}}
        bad = [f"off-CPU {k}" for k in ("name", "from", "until", "spyName") if k not in q]
        bad += [f"off-CPU request with {k}" for k in ("sampleRate", "units") if k in q]
        with self.lock:
            self.requests.append(r)
            self.problems += bad


def files_of(state: Path, kind: str) -> list[Path]:
    pat = r"^offcpu-.+-\d{8}T\d{6}Z(-\d+)?\.folded$" if kind == "offcpu" else r"^(?!offcpu-).+-\d{8}T\d{6}Z(-\d+)?\.folded$"
    return sorted(p for p in state.iterdir() if re.match(pat, p.name) and not p.is_symlink())


def test_offcpu_windows_go_to_their_own_files_snapshot_pull_and_push(tmp_path: Path, daemon_factory: Any) -> None:
    srv = OffcpuIngest()
    try:
        d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0, "off_cpu": True},
                           output={"rotate_interval": 2.0, "root_frame": "comm"},
                           pyroscope={"server_address": f"http://127.0.0.1:{srv.port}", "application_name": "web",
                                      "retry_max_backoff": 1.0})
        d.wait_for(lambda: len(files_of(d.state_dir, "offcpu")) >= 2, 30, "two off-CPU files")
        st = d.status()
        assert st["offcpu"]["enabled"] and st["offcpu"]["latest"], st["offcpu"]
        # snapshot --kind offcpu: microseconds in folded, the unit in the header
        head, body = d.request({"request": "snapshot", "kind": "offcpu", "seconds": 3, "root": "comm"})
        assert head["kind"] == "offcpu" and head["unit"] == "microseconds", head
        snap = read_folded(io.BytesIO(body)).stacks
        idle = sum(w for s, w in snap.items() if s[0] == "fake-idle" and s[-1] == "[off-cpu: blocked]")
        span_us = (head["end_ns"] - head["start_ns"]) / 1000
        assert idle == pytest.approx(IDLE_SHARE * span_us, rel=0.01), (idle, span_us)
        # ... and the CPU snapshot is what it always was: samples, no off-CPU frame
        head_cpu, body_cpu = d.request({"request": "snapshot", "seconds": 3})
        assert head_cpu["kind"] == "cpu" and head_cpu["unit"] == "samples"
        assert b"off-cpu" not in body_cpu and head_cpu["weight"] > 0
        # pprof snapshot: nanoseconds, sample type off_cpu
        _h, pp = d.request({"request": "snapshot", "kind": "offcpu", "seconds": 3, "format": "pprof"})
        prof = pb.Profile()
        prof.ParseFromString(gzip.decompress(pp))
        assert [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type] == \
            [("off_cpu", "nanoseconds")]
        # the pull endpoint
        with urllib.request.urlopen(f"http://{st['metrics']}/debug/pprof/offcpu?seconds=2", timeout=30) as resp:
            pulled = read_pprof(resp.read())
        assert pulled.labels["kind"] == "off_cpu" and pulled.labels["unit"] == "nanoseconds"
        assert pulled.total() == pytest.approx(sum(s for _k, s in OFFCPU_STACKS) * 2e9, rel=0.35), pulled.total()
        d.wait_for(lambda: sum(1 for r in srv.requests if "types" in r) >= 3, 30, "three off-CPU pushes")
        shown = subprocess.run([sys.executable, "-m", "flamed", "status", "--socket", d.socket_path],
                               capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert re.search(r"^off-cpu +[\d.]+ s recorded .*latest .*offcpu-.*/debug/pprof/offcpu", shown.stdout, re.M), \
            shown.stdout
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
    finally:
        srv.close()
    assert not srv.problems, srv.problems
    state = d.state_dir
    cpu, off = files_of(state, "cpu"), files_of(state, "offcpu")
    host = json.loads((state / (cpu[0].name[:-len(".folded")] + ".json")).read_text())["host"]
    # CPU files keep their names and content: HOST-TS.folded of samples
    assert cpu and all(p.name.startswith(f"{host}-") for p in cpu)
    for p in cpu:
        assert b"off-cpu" not in p.read_bytes()
    # off-CPU files: one per period beside the CPU one, microseconds, the unit in the sidecar
    assert {p.name.removeprefix("offcpu-") for p in off} == {p.name for p in cpu}
    total_us = 0
    for p in off:
        meta = json.loads(p.with_suffix(".json").read_text())
        assert meta["kind"] == "offcpu" and meta["unit"] == "microseconds", meta
        prof = read_folded(io.BytesIO(p.read_bytes()), strict=True)
        assert meta["weight"] == prof.total()
        assert abs(meta["weight"] - meta["weight_ns"] / 1000) <= len(prof.stacks), meta
        idle_us = sum(w for s, w in prof.stacks.items() if s[0] == "fake-idle")
        span_us = (meta["end_ns"] - meta["start_ns"]) / 1000
        assert idle_us == pytest.approx(IDLE_SHARE * span_us, rel=0.01, abs=2), (p.name, idle_us, span_us)
        total_us += meta["weight"]
    assert (state / "latest-offcpu.folded").resolve() == off[-1]
    assert (state / "latest.folded").resolve() == cpu[-1]
    # push: off-CPU windows as their own profile type, same name; sent nanoseconds = the files' microseconds
    pushed = [r for r in srv.requests if "types" in r]
    assert pushed and all(r["types"] == [("offcpu", "nanoseconds")] for r in pushed)
    assert all(r["q"]["name"] == f"web{{host={host}}}" and r["q"]["format"] == "pprof" for r in pushed)
    assert all({"pid", "comm", "host"} <= r["labels"] for r in pushed if r["weight"])
    assert sum(r["weight"] for r in pushed) / 1000 == pytest.approx(total_us, rel=0.001)
    assert any("types" not in r for r in srv.requests)  # the CPU windows still go as before
    # the state directory checks out whole (both kinds parse and match their sidecars)
    check_state_dir(state)
    # flamed push (backfill) sends the off-CPU files as the daemon pushes their windows
    again = OffcpuIngest()
    try:
        r = subprocess.run([sys.executable, "-m", "flamed", "push", "--server", f"http://127.0.0.1:{again.port}",
                            "--application-name", "web", *map(str, off)], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    finally:
        again.close()
    assert r.returncode == 0, r.stderr
    assert not again.problems, again.problems
    assert len(again.requests) == len(off)
    assert all(q["types"] == [("offcpu", "nanoseconds")] for q in again.requests)
    assert sum(q["weight"] for q in again.requests) == total_us * 1000


def test_offcpu_off_gives_clear_errors(tmp_path: Path, daemon_factory: Any) -> None:
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0})
    with pytest.raises(DaemonError) as refused:
        d.request({"request": "snapshot", "kind": "offcpu", "seconds": 2})
    assert refused.value.code == "not_recorded" and "off_cpu = true in [sampling]" in str(refused.value)
    with pytest.raises(DaemonError) as refused:
        d.request({"request": "snapshot", "kind": "wall", "seconds": 2})
    assert refused.value.code == "bad_request" and "'kind' must be one of cpu, offcpu" in str(refused.value)
    addr = d.status()["metrics"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{addr}/debug/pprof/offcpu?seconds=1", timeout=30)
    assert e.value.code == 404 and b"off_cpu = true" in e.value.read()
    assert not [p for p in d.state_dir.iterdir() if p.name.startswith("offcpu-")]
    # the CLI says it too, and exits non-zero
    r = subprocess.run([sys.executable, "-m", "flamed", "snapshot", "--socket", d.socket_path, "--kind", "offcpu"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and "does not record off-CPU time" in r.stderr, r.stderr


@pytest.mark.parametrize(("key", "value", "message"), [
    ("off_cpu_min_us", -1, "sampling.off_cpu_min_us: -1 is out of range [0, 3600000000]"),
    ("off_cpu_every", 0, "sampling.off_cpu_every: 0 is out of range [1, 4194304]"),
    ("off_cpu", "yes", "sampling.off_cpu: expected true or false, got string 'yes'"),
])
def test_offcpu_config_errors_name_the_key(tmp_path: Path, key: str, value: Any, message: str) -> None:
    cfg = tmp_path / "flamed.toml"
    write_config(cfg, {"sampling": {"sampler": "fake", key: value}})
    r = subprocess.run([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg), "--check-config"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_reload_turns_offcpu_on_and_off(tmp_path: Path, daemon_factory: Any) -> None:
    d = daemon_factory(sampling={"sampler": "fake", "frequency": 99, "drain_interval": 1.0},
                       output={"rotate_interval": 1.0})
    d.wait_for(lambda: len(files_of(d.state_dir, "cpu")) >= 1, 30, "a CPU file")
    assert not files_of(d.state_dir, "offcpu") and not d.status()["offcpu"]["enabled"]
    d.config["sampling"]["off_cpu"] = True
    write_config(d.cfg_path, d.config)
    d.signal(signal.SIGHUP)
    d.wait_for(lambda: len(files_of(d.state_dir, "offcpu")) >= 2, 30, "off-CPU files after the reload")
    assert d.status()["offcpu"]["enabled"]
    d.config["sampling"]["off_cpu"] = False
    write_config(d.cfg_path, d.config)
    d.signal(signal.SIGHUP)
    d.wait_for(lambda: not d.status()["offcpu"]["enabled"], 30, "off-CPU off after the second reload")
    with pytest.raises(DaemonError):
        d.request({"request": "snapshot", "kind": "offcpu", "seconds": 2})
    n = len(files_of(d.state_dir, "offcpu"))
    cpu = len(files_of(d.state_dir, "cpu"))
    d.wait_for(lambda: len(files_of(d.state_dir, "cpu")) >= cpu + 2, 30, "two more CPU files")
    assert len(files_of(d.state_dir, "offcpu")) <= n + 1  # at most the period the reload was in
    assert d.metric("flamed_config_reloads_total", {"result": "ok"}) == 2
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    check_state_dir(d.state_dir)
