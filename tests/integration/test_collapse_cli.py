"""``flamed collapse`` end to end on real captures: goldens, parallel == serial, stdin, pty progress, live perf/bcc."""

from __future__ import annotations

import gzip
import io
import json
import os
import pty
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.cli import main
from support import DATA, golden, have_root, need

FLAMED = [sys.executable, "-m", "flamed"]
CAPTURES = sorted(
    [p for p in (DATA / "perf").iterdir() if p.name.endswith(".gz")]
    + sorted((DATA / "bcc").iterdir())
    + sorted((DATA / "pyspy").iterdir())
)


def run_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*FLAMED, *args], input=stdin, capture_output=True, timeout=120, check=False)


def collapse_to(tmp_path: Path, *args: str) -> tuple[bytes, str]:
    out = tmp_path / f"out-{abs(hash(args))}.folded"
    err = io.StringIO()
    rc = main(["collapse", *args, "-o", str(out)], stderr=err)
    assert rc == 0, err.getvalue()
    return out.read_bytes(), err.getvalue()


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_real_captures(tmp_path: Path, capture: Path) -> None:
    data, _ = collapse_to(tmp_path, "--jobs", "1", str(capture))
    name = capture.name.removesuffix(".gz").removesuffix(".txt")
    golden(DATA / "collapse" / f"{capture.parent.name}-{name}.folded", data)
    assert data, "a real capture collapses to something"
    # Every line is 'stack COUNT' with a positive integer count.
    for line in data.decode("utf-8", "surrogateescape").splitlines():
        stack, _, count = line.rpartition(" ")
        assert stack and count.isdigit() and int(count) > 0


def test_parallel_is_byte_identical_on_real_perf_data(tmp_path: Path) -> None:
    # All real perf captures in one input (several events, -F variants, 15 MB of system-wide
    # samples), cut into many chunks so both workers get work.
    big = tmp_path / "all.txt"
    with big.open("wb") as f:
        for p in sorted((DATA / "perf").glob("system-wide*.gz")) + [DATA / "perf" / "c-default.txt.gz"]:
            f.write(gzip.decompress(p.read_bytes()))
    serial, err1 = collapse_to(tmp_path, "--jobs", "1", "--pid", str(big))
    for jobs, chunk in (("2", "65536"), ("3", "1048576")):
        par, err2 = collapse_to(tmp_path, "--jobs", jobs, "--chunk-size", chunk, "--pid", str(big))
        assert par == serial, f"--jobs {jobs} --chunk-size {chunk} differs from --jobs 1"
        assert err2 == err1
    assert len(serial.splitlines()) > 1000
    # Tiny chunks (a sample or two each) on a smaller capture.
    small = DATA / "perf" / "multi-event.txt.gz"
    a, e1 = collapse_to(tmp_path, "--jobs", "1", "--tid", str(small))
    b, e2 = collapse_to(tmp_path, "--jobs", "2", "--chunk-size", "1024", "--tid", str(small))
    assert a == b and e1 == e2 and "kept event" in e1


def test_stdin_and_gzip_stdin() -> None:
    raw = gzip.decompress((DATA / "perf" / "dd.txt.gz").read_bytes())
    a = run_cli("collapse", "--jobs", "1", stdin=raw)
    b = run_cli("collapse", "--jobs", "2", stdin=(DATA / "perf" / "dd.txt.gz").read_bytes())
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.startswith(b"dd;")


def test_output_format_by_extension(tmp_path: Path) -> None:
    out = tmp_path / "tree.json"
    assert main(["collapse", str(DATA / "perf" / "dd.txt.gz"), "-o", str(out)]) == 0
    tree = json.loads(out.read_text())
    assert tree["name"] == "root" and tree["children"][0]["name"] == "dd"
    assert tree["value"] == sum(c["value"] for c in tree["children"])


def test_errors_are_one_line(tmp_path: Path) -> None:
    r = run_cli("collapse", str(tmp_path / "missing.txt"))
    assert r.returncode == 1
    assert r.stderr.decode().strip().count("\n") == 0 and "missing.txt: no such file" in r.stderr.decode()
    r = run_cli("collapse", "--format", "nope", str(DATA / "perf" / "hostile.txt"))
    assert r.returncode == 2
    bad = tmp_path / "bad.folded"
    bad.write_text("a;b 1\nno count here\n")
    r = run_cli("collapse", "--strict", "--format", "folded", str(bad))
    assert r.returncode == 1 and "bad.folded:2:" in r.stderr.decode() and b"Traceback" not in r.stderr
    r = run_cli("collapse", "--format", "folded", str(bad))
    assert r.returncode == 0 and "skipped 1 malformed line" in r.stderr.decode()


def test_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    one = (DATA / "perf" / "hostile.txt").read_bytes()
    with big.open("wb") as f:
        for _ in range(4_400_000 // len(one) + 1):
            f.write(one)
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(
            [*FLAMED, "collapse", "--jobs", "1", "--chunk-size", "65536", str(big), "-o", str(tmp_path / "o.folded")],
            stderr=slave,
            stdout=subprocess.DEVNULL,
        )
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        assert p.wait(timeout=60) == 0
    finally:
        os.close(master)
    assert b"MB/s" in seen and b"%" in seen, seen[-300:]
    # Not on a pipe:
    r = run_cli("collapse", "--jobs", "1", str(big), "-o", str(tmp_path / "o2.folded"))
    assert b"MB/s" not in r.stderr


def test_live_perf_record(tmp_path: Path) -> None:
    need(shutil.which("perf") is not None, "perf (Debian linux-perf)")
    need(have_root(), "root for perf record -a/-g with kernel stacks")
    data = tmp_path / "perf.data"
    rec = subprocess.run(
        ["perf", "record", "-q", "-g", "-F", "999", "-o", str(data), "--", "dd", "if=/dev/zero", "of=/dev/null", "bs=4k", "count=300000"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    need(rec.returncode == 0, f"perf record works here ({rec.stderr.decode()[-200:]})")
    script = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, timeout=60, check=True).stdout
    r = run_cli("collapse", "--pid", stdin=script)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode("utf-8", "surrogateescape").splitlines()
    assert lines and all(line.startswith("dd-") for line in lines)
    assert any("_[k]" in line for line in lines), "kernel frames annotated"
    total = sum(int(line.rsplit(" ", 1)[1]) for line in lines)
    samples = script.count(b"cpu-clock")
    assert samples > 0 and total > samples  # weighted by period (ns per sample)


@pytest.mark.slow
def test_live_bcc_profile(require_bpf: None, tmp_path: Path) -> None:
    tool = shutil.which("profile-bpfcc")
    need(tool is not None, "profile-bpfcc (Debian bpfcc-tools)")
    assert tool is not None
    work = subprocess.Popen([sys.executable, str(DATA / "capture" / "work.py"), "30"])
    try:
        r = subprocess.run([tool, "-F", "99", "-d", "-p", str(work.pid), "2"], capture_output=True, timeout=90, check=False)
    finally:
        work.kill()
        work.wait(timeout=10)
    assert r.returncode == 0, r.stderr[-500:]
    f = tmp_path / "bcc.txt"
    f.write_bytes(r.stdout)
    out, _ = collapse_to(tmp_path, str(f))
    lines = out.decode().splitlines()
    assert lines, r.stdout[:500]
    assert all(line.startswith("python") for line in lines)
