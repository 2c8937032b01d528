"""Who may talk to the daemon, and what a client can make it do.

* The control socket is 0660 root:GROUP; an unprivileged user outside the
  group is refused, a member is served -- and the peer's credentials
  (SO_PEERCRED, SO_PEERGROUPS) decide, not the path: with the socket file
  made world-writable the outsider still gets ``denied``.
* Metrics listen on loopback unless configured otherwise.
* No request names a path the daemon would write.
* Snapshot filter regexes are rejected or cheap, even against long frames.

Users are numeric uids without passwd entries (``setpriv --reuid``); the
group is created with groupadd and removed in ``finally``.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import need

pytestmark = [pytest.mark.bpf]

OUTSIDER_UID = 48431
MEMBER_UID = 48432

CLIENT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("CONNECT-ERROR", e.errno, e.strerror)
    sys.exit(0)
try:
    s.sendall(sys.argv[2].encode() + b"\n")
except OSError:
    pass  # refused before it read the request: the error is still waiting to be read
data = b""
while True:
    try:
        c = s.recv(65536)
    except ConnectionResetError:
        # The daemon refuses without waiting for the request; when the request lands after
        # its last read, closing resets the connection -- after the answer, which stays readable.
        if not data:
            print("RESET")
            sys.exit(0)
        break
    if not c:
        break
    data += c
print(data.split(b"\n", 1)[0].decode())
"""


@pytest.fixture
def test_group() -> Any:
    need(os.geteuid() == 0, "root (groupadd, setpriv)")
    need(shutil.which("groupadd") is not None and shutil.which("setpriv") is not None, "groupadd and setpriv")
    name = f"flamedsec{os.getpid() % 100000}"
    subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
    try:
        yield name, grp.getgrnam(name).gr_gid
    finally:
        subprocess.run(["groupdel", name], capture_output=True)


def as_user(uid: int, gid: int, groups: list[int], sock: str, request: str) -> str:
    """Run a tiny client under another identity; returns the header line or CONNECT-ERROR."""
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}"]
    cmd += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    cmd += ["--inh-caps=-all", "--bounding-set=-all", "--", "/usr/bin/python3", "-c", CLIENT, sock, request]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def public_dir() -> Any:
    """A directory every user can traverse (pytest's tmp_path is 0700): only the socket's mode and the daemon decide."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="flamed-sec-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_control_socket_peer_credentials_decide(daemon_factory: Any, test_group: tuple[str, int],
                                                public_dir: Path) -> None:
    gname, gid = test_group
    run = public_dir
    tmp_path = public_dir
    d = daemon_factory(sampling={"sampler": "fake", "drain_interval": 1.0},
                       control={"socket": str(run / "flamed.sock"), "socket_group": gname,
                                "allowed_groups": [gname], "socket_mode": 0o660})
    st = os.stat(d.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert (st.st_uid, st.st_gid) == (0, gid)
    status = json.dumps({"request": "status"})

    # The file mode is the first fence: an outsider cannot even connect.
    out = as_user(OUTSIDER_UID, OUTSIDER_UID, [], d.socket_path, status)
    assert out.startswith("CONNECT-ERROR 13"), out
    # A member (supplementary group) and a member by primary group are served.
    for uid, g, groups in ((MEMBER_UID, MEMBER_UID, [gid]), (MEMBER_UID, gid, [])):
        head = json.loads(as_user(uid, g, groups, d.socket_path, status))
        assert head["ok"] is True and head["status"]["pid"] == d.pid, head

    # The path does not decide: open the file to everyone, the daemon still refuses the outsider.
    os.chmod(d.socket_path, 0o666)
    head = json.loads(as_user(OUTSIDER_UID, OUTSIDER_UID, [], d.socket_path, status))
    assert head == {"ok": False, "code": "denied", "error": head["error"]}, head
    assert str(OUTSIDER_UID) in head["error"]
    # Even for requests that would write (flush) or read profiles (snapshot).
    for req in ({"request": "flush"}, {"request": "snapshot", "seconds": 5}):
        head = json.loads(as_user(OUTSIDER_UID, OUTSIDER_UID, [], d.socket_path, json.dumps(req)))
        assert head["code"] == "denied", head
    # A hard link elsewhere is the same socket, with the same check.
    alias = tmp_path / "alias.sock"
    os.link(d.socket_path, alias)
    head = json.loads(as_user(OUTSIDER_UID, OUTSIDER_UID, [], str(alias), status))
    assert head["code"] == "denied", head
    assert d.metric("flamed_control_requests_total", {"result": "denied"}) >= 4
    assert "refused uid %d" % OUTSIDER_UID in d.log()


def _listening_addresses(pid: int) -> list[tuple[str, int]]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out: list[tuple[str, int]] = []
    for table, fam in (("tcp", 4), ("tcp6", 6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A = LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            if fam == 4:
                addr = socket.inet_ntop(socket.AF_INET, bytes.fromhex(hexaddr)[::-1])
            else:
                raw = bytes.fromhex(hexaddr)
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out.append((addr, int(hexport, 16)))
    return out


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_metrics_bind_loopback_by_default(daemon_factory: Any) -> None:
    from flamed.daemon.config import DaemonConfig

    default = DaemonConfig().metrics.address
    assert default.startswith("127.0.0.1:"), default
    port = int(default.rsplit(":", 1)[1])
    with socket.socket() as probe:
        busy = probe.connect_ex(("127.0.0.1", port)) == 0
    if busy:
        pytest.skip(f"port {port} is in use by another daemon; the default address was checked in the config")
    d = daemon_factory(start=False, sampling={"sampler": "fake", "drain_interval": 1.0})
    del d.config["metrics"]  # the default, as shipped
    d.start()
    addrs = _listening_addresses(d.pid)
    assert addrs, "the daemon listens on no TCP socket"
    assert all(a in ("127.0.0.1", "::1") for a, _ in addrs), addrs
    assert (("127.0.0.1", port) in addrs), addrs
    shipped = (Path(__file__).resolve().parents[2] / "packaging" / "flamed.toml").read_text()
    assert 'address = "127.0.0.1:' in shipped


@pytest.mark.concurrent  # a fake-sampler daemon: may share the machine
def test_no_request_writes_a_client_chosen_path(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(sampling={"sampler": "fake", "drain_interval": 0.5}, output={"rotate_interval": 1.0})
    target = tmp_path / "client-chosen"
    tries = []
    for field in ("path", "file", "output", "o", "out", "dir", "state_dir", "socket", "config", "filename"):
        for kind in ("snapshot", "flush", "status"):
            raw = json.dumps({"request": kind, field: str(target)})
            from daemonproc import unix_request_raw

            head = json.loads(unix_request_raw(d.socket_path, raw.encode() + b"\n").split(b"\n", 1)[0])
            tries.append((kind, field, head.get("code")))
            assert head["ok"] is False and head["code"] == "bad_request", (kind, field, head)
    # Titles and formats travel into outputs, never into file names.
    head, payload = d.request({"request": "snapshot", "seconds": 2, "format": "svg", "title": f"../../{target}"})
    assert head["ok"]
    flushed = d.request({"request": "flush"})[0]
    assert flushed["file"] is None or Path(flushed["file"]).parent == d.state_dir
    assert not target.exists() and not any(tmp_path.glob("client-chosen*"))
    # Every file the daemon wrote is in its state directory.
    assert all(p.parent == d.state_dir for p in d.state_dir.iterdir())


# ---------------------------------------------------------------------------
# Regexes with bounded cost

LONG_NAME = "deep_" + "a" * 3000


@pytest.fixture
def long_symbol_binary(tmp_path: Path) -> Path:
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev) to build the C workload")
    src = tmp_path / "longsym.c"
    src.write_text(
        "volatile unsigned long sink;\n"
        f"__attribute__((noinline)) void {LONG_NAME}(void) {{ for (volatile int i = 0; i < 1000000; i++) sink += i; }}\n"
        f"int main(void) {{ for (long i = 0; i < 100000000L; i++) {LONG_NAME}(); return 0; }}\n"
    )
    out = tmp_path / "longsym"
    subprocess.run([str(gcc), "-O0", "-fno-omit-frame-pointer", "-o", str(out), str(src)], check=True, timeout=60)
    return out


PATHOLOGICAL = [
    "(a+)+$",  # exponential: nested repetition
    "(a|aa)*b",  # exponential: ambiguous alternation under a repeat
    "(a*)*b",
    "(.*a){12}",
    r"(\w+\s?)*$",
    "(a)\\1",  # backreference
    ".*.*.*.*.*.*.*.*=",  # polynomial, degree 8: no nesting, still unbounded in practice
    r"\w*\w*\w*\w*\w*!",
    "[a-z]*[a-z]*[a-z]*[a-z]*[a-z]*0",
]


def test_pathological_regexes_rejected_or_bounded(require_bpf: None, daemon_factory: Any,
                                                  long_symbol_binary: Path) -> None:
    wl = subprocess.Popen([str(long_symbol_binary)], start_new_session=True)
    try:
        d = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0}, control={"client_timeout": 5.0})
        # The long frame must be in the ring for the test to mean anything.
        d.wait_for(lambda: LONG_NAME.encode() in d.request({"request": "snapshot", "seconds": 5})[1], 20,
                   "the 3000-character frame in a snapshot")
        outcomes: dict[str, Any] = {}
        for rx in PATHOLOGICAL:
            for field in ("frame", "comm", "exclude_frame"):
                from daemonproc import unix_request_raw

                t0 = time.monotonic()
                try:
                    raw = unix_request_raw(d.socket_path, json.dumps(
                        {"request": "snapshot", "seconds": 5, field: rx}).encode() + b"\n", timeout=15)
                    head = json.loads(raw.split(b"\n", 1)[0])
                except (TimeoutError, socket.timeout):
                    head = {"ok": None, "code": "client-timeout"}
                dt = time.monotonic() - t0
                outcomes[f"{field}={rx}"] = (head.get("ok"), head.get("code"), round(dt, 2))
                assert dt < 10, f"{field}={rx!r} took {dt:.1f} s: regex cost is not bounded"
                assert head.get("ok") is False or head.get("ok") is True, (rx, head)
        # The daemon kept sampling while clients sent those.
        s = d.status()
        assert time.time_ns() - s["last_drain_ns"] < 3e9, "the drain stalled"
    finally:
        os.killpg(wl.pid, 9)
        wl.wait(10)
    from test_daemon_faults import record_figure

    record_figure("regex", outcomes)
