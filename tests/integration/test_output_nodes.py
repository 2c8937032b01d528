"""``-o PATH`` keeps what PATH is: FIFOs, devices and sockets are written in
place, a symlink stays a link, only regular files are replaced atomically.

Every test runs the real CLI in a subprocess against a real node.
"""

from __future__ import annotations

import os
import shlex
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import have_root, need

FLAMED = [sys.executable, "-m", "flamed"]
FOLDED = b"main;a;b 3\nmain;a;c 2\nmain;d 1\n"
#: Every command that writes -o PATH from a folded input, with what its output starts with.
COMMANDS: list[tuple[list[str], bytes]] = [
    (["collapse"], b"main;a;b 3\n"),
    (["svg"], b"<?xml"),
    (["top"], b"SELF"),
    (["tree"], b"{"),
    (["merge"], b"main;a;b 3\n"),
    (["export", "--format", "speedscope"], b"{"),
    (["diff", "--format", "table"], b""),
]


@pytest.fixture
def folded(tmp_path: Path) -> Path:
    p = tmp_path / "in.folded"
    p.write_bytes(FOLDED)
    return p


def cli_args(cmd: list[str], folded: Path, out: str) -> list[str]:
    inputs = [str(folded), str(folded)] if cmd[0] == "diff" else [str(folded)]
    return FLAMED + cmd + inputs + ["-o", out]


def run(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, capture_output=True, timeout=120, check=False)


def serve(path: Path, accept: Callable[[], bytes]) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(accept()), daemon=True)
    t.start()
    return t, got


def read_fifo_during(fifo: Path, args: list[str]) -> tuple[subprocess.CompletedProcess[bytes], bytes]:
    """Run the CLI writing to ``fifo`` while a thread reads it; returns what was read.

    The read end is opened non-blocking before the CLI starts, so neither side
    waits for the other to open, and the reader ends when the pipe is empty and
    has no writer left *after* the CLI exited (or never opened it: the bug).
    """
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    chunks: list[bytes] = []
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def reader() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            exited = proc.poll() is not None
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:  # a writer is there, nothing written yet
                time.sleep(0.01)
                continue
            if b:
                chunks.append(b)
            elif exited:
                return
            else:
                time.sleep(0.01)  # no writer yet

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        t.join(timeout=120)
        os.close(fd)
    assert not t.is_alive()
    return subprocess.CompletedProcess(args, proc.returncode, out, err), b"".join(chunks)


@pytest.mark.parametrize("cmd,head", COMMANDS, ids=[c[0][0] for c in COMMANDS])
def test_fifo_is_written_in_place_and_stays_a_fifo(tmp_path: Path, folded: Path, cmd: list[str], head: bytes) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    res, data = read_fifo_during(fifo, cli_args(cmd, folded, str(fifo)))
    assert res.returncode == 0, res.stderr.decode()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced"
    assert data.startswith(head) and len(data) > 0
    assert sorted(os.listdir(tmp_path)) == ["in.folded", "out.fifo"]  # no temp file left


def test_fifo_gets_exactly_the_file_output(tmp_path: Path, folded: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    res, data = read_fifo_during(fifo, cli_args(["collapse"], folded, str(fifo)))
    assert res.returncode == 0, res.stderr.decode()
    reg = tmp_path / "reg.folded"
    assert run(cli_args(["collapse"], folded, str(reg))).returncode == 0
    assert data == reg.read_bytes() == FOLDED


@pytest.mark.parametrize("cmd,head", COMMANDS, ids=[c[0][0] for c in COMMANDS])
def test_private_char_device_stays_a_device(tmp_path: Path, folded: Path, cmd: list[str], head: bytes) -> None:
    need(have_root(), "root (mknod of a character device)")
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    res = run(cli_args(cmd, folded, str(node)))
    assert res.returncode == 0, res.stderr.decode()
    st = os.lstat(node)
    assert stat.S_ISCHR(st.st_mode), "the device node was replaced by a regular file"
    assert st.st_rdev == os.makedev(1, 3)
    assert sorted(os.listdir(tmp_path)) == ["in.folded", "null"]


def test_real_dev_null_stays_intact(tmp_path: Path, folded: Path) -> None:
    need(have_root(), "root (the bug only destroys /dev/null as root)")
    # The same write on a private node first: when that node is not kept, the
    # real /dev/null would not be either, and must not be touched.
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    assert run(cli_args(["svg"], folded, str(node))).returncode == 0
    assert stat.S_ISCHR(os.lstat(node).st_mode), "a device node is replaced: not trying /dev/null"
    before = os.lstat("/dev/null")
    res = run(cli_args(["svg"], folded, "/dev/null"))
    assert res.returncode == 0, res.stderr.decode()
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == os.makedev(1, 3)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert not [n for n in os.listdir("/dev") if n.startswith(".null.")]


def test_symlink_is_kept_and_its_target_replaced_atomically(tmp_path: Path, folded: Path) -> None:
    real_dir = tmp_path / "real"
    link_dir = tmp_path / "links"
    real_dir.mkdir()
    link_dir.mkdir()
    target = real_dir / "profile.folded"
    target.write_bytes(b"old\n")
    old_ino = target.stat().st_ino
    link = link_dir / "latest.folded"
    link.symlink_to(Path("..") / "real" / "profile.folded")  # relative, as people make them
    chain = link_dir / "current.folded"
    chain.symlink_to("latest.folded")  # a link to the link
    res = run(cli_args(["collapse"], folded, str(chain)))
    assert res.returncode == 0, res.stderr.decode()
    assert chain.is_symlink() and os.readlink(chain) == "latest.folded"
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "real", "profile.folded")
    assert target.read_bytes().startswith(b"main;a;b 3\n")
    assert target.stat().st_ino != old_ino, "the target was rewritten in place, not replaced"
    assert sorted(os.listdir(real_dir)) == ["profile.folded"]
    assert sorted(os.listdir(link_dir)) == ["current.folded", "latest.folded"]


def test_dangling_symlink_creates_its_target(tmp_path: Path, folded: Path) -> None:
    link = tmp_path / "out.svg"
    link.symlink_to("made.svg")
    res = run(cli_args(["svg"], folded, str(link)))
    assert res.returncode == 0, res.stderr.decode()
    assert link.is_symlink()
    assert (tmp_path / "made.svg").read_bytes().startswith(b"<?xml")


def test_unix_socket_is_written_to(tmp_path: Path, folded: Path) -> None:
    path = tmp_path / "out.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    srv.settimeout(120)

    def accept() -> bytes:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(120)
            parts = []
            while b := conn.recv(65536):
                parts.append(b)
            return b"".join(parts)

    t, got = serve(path, accept)
    try:
        res = run(cli_args(["collapse"], folded, str(path)))
        t.join(timeout=120)
    finally:
        srv.close()
    assert res.returncode == 0, res.stderr.decode()
    assert not t.is_alive()
    assert got == [FOLDED]
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_directory_is_an_error_not_replaced(tmp_path: Path, folded: Path) -> None:
    d = tmp_path / "out"
    d.mkdir()
    res = run(cli_args(["collapse"], folded, str(d)))
    assert res.returncode == 1
    assert res.stderr.decode().strip() == f"flamed collapse: error: cannot write {d}: is a directory, expected a file"
    assert d.is_dir() and os.listdir(d) == []


@pytest.mark.parametrize("name", ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"])
@pytest.mark.parametrize("cmd,head", COMMANDS[:2])
def test_stdout_redirected_to_append_file_is_appended_to(
    tmp_path: Path, folded: Path, cmd: list[str], head: bytes, name: str
) -> None:
    """``flamed ... -o /dev/stdout >> app.log`` adds to app.log, as any command writing stdout does."""
    log = tmp_path / "app.log"
    log.write_bytes(b"previous log\n")
    expected = run(cli_args(cmd, folded, "-"))
    assert expected.returncode == 0 and expected.stdout.startswith(head), expected.stderr
    with open(log, "ab") as out:
        res = subprocess.run(cli_args(cmd, folded, name), stdout=out, stderr=subprocess.PIPE, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert log.read_bytes() == b"previous log\n" + expected.stdout
    assert stat.S_ISREG(os.lstat(log).st_mode)


@pytest.mark.parametrize("name", ["/dev/stdout", "/proc/$$/fd/1", "/dev/fd/5", "/proc/thread-self/fd/5"])
def test_descriptor_is_written_at_its_offset(tmp_path: Path, folded: Path, name: str) -> None:
    """``{ echo HEADER; flamed ... -o /dev/stdout; echo FOOTER; } > log`` keeps HEADER and FOOTER."""
    log = tmp_path / "log"
    log.write_bytes(b"old content, longer than what is written over it. " * 10)
    expected = run(cli_args(["collapse"], folded, "-")).stdout
    # The shell execs the CLI (same pid, for /proc/$$) with fd 5 a copy of its stdout.
    cli = shlex.join(cli_args(["collapse"], folded, "NAME")[:-1])
    script = f'exec {cli} "{name}" 5>&1'
    fd = os.open(log, os.O_WRONLY)  # no O_APPEND, no O_TRUNC: writes go at the offset
    try:
        os.write(fd, b"HEADER\n")
        res = subprocess.run(["sh", "-c", script], stdout=fd, stderr=subprocess.PIPE, timeout=120, check=False)
        assert res.returncode == 0, res.stderr
        os.write(fd, b"FOOTER\n")
    finally:
        os.close(fd)
    data = log.read_bytes()
    assert data.startswith(b"HEADER\n" + expected + b"FOOTER\n"), data[:200]
    assert stat.S_ISREG(os.lstat(log).st_mode)


def test_descriptor_not_open_is_an_error(tmp_path: Path, folded: Path) -> None:
    res = run(cli_args(["collapse"], folded, "/dev/fd/9"))
    assert res.returncode == 1 and b"descriptor 9" in res.stderr and b"Traceback" not in res.stderr, res.stderr
