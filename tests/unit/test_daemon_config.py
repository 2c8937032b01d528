from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

import pytest

from flamed.cli import main
from flamed.daemon.config import DaemonConfig, config_from_dict, load_config
from flamed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_documented_config_is_exactly_the_defaults() -> None:
    # packaging/flamed.toml documents every key with its default: parsing it must
    # give the built-in defaults, and it must name every field of every table.
    cfg = load_config(str(ROOT / "packaging" / "flamed.toml"))
    assert dataclasses.replace(cfg, source=None) == DaemonConfig()
    raw = tomllib.loads((ROOT / "packaging" / "flamed.toml").read_text())
    for section in ("sampling", "output", "retention", "snapshot", "metrics", "control", "log", "pyroscope"):
        fields = {f.name for f in dataclasses.fields(getattr(DaemonConfig(), section))}
        assert set(raw[section]) == fields, section


def test_docs_list_every_key() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for section in ("sampling", "output", "retention", "snapshot", "metrics", "control", "log", "pyroscope"):
        for f in dataclasses.fields(getattr(DaemonConfig(), section)):
            assert f"`{f.name}`" in doc, f"{section}.{f.name} missing from docs/configuration.md"


def test_dev_config_is_valid_and_local() -> None:
    cfg = load_config(str(ROOT / "packaging" / "flamed.dev.toml"))
    assert cfg.output.state_dir == "./var/profiles"
    assert cfg.control.socket == "./var/flamed.sock"
    # its own port: `make run` beside an installed daemon (9752) must not fail to bind
    assert cfg.metrics.address == "127.0.0.1:9753"


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"sampling": {"frequency": 0}}, "sampling.frequency"),
        ({"sampling": {"frequency": 1000}}, "sampling.frequency"),
        ({"sampling": {"frequency": "19"}}, "sampling.frequency"),
        ({"sampling": {"frequency": True}}, "sampling.frequency"),
        ({"sampling": {"sampler": "perf"}}, "sampling.sampler"),
        ({"sampling": {"pids": [1, "x"]}}, "sampling.pids[1]"),
        ({"sampling": {"pids": 5}}, "sampling.pids"),
        ({"sampling": {"nope": 1}}, "sampling.nope"),
        ({"output": {"root_frame": "task"}}, "output.root_frame"),
        ({"output": {"compress": "yes"}}, "output.compress"),
        ({"output": {"state_dir": ""}}, "output.state_dir"),
        ({"output": {"rotate_interval": "fast"}}, "output.rotate_interval"),
        ({"retention": {"max_bytes": "12 parsecs"}}, "retention.max_bytes"),
        ({"retention": {"max_files": -1}}, "retention.max_files"),
        ({"retention": {"max_age": float("nan")}}, "retention.max_age"),
        ({"metrics": {"address": "localhost"}}, "metrics.address"),
        ({"metrics": {"address": "127.0.0.1:99999"}}, "metrics.address"),
        ({"metrics": {"address": "127.0.0.1:\u00b2"}}, "metrics.address"),  # isdigit() but not int()
        ({"control": {"socket_mode": 0o1777}}, "control.socket_mode"),
        ({"control": {"max_clients": 0}}, "control.max_clients"),
        ({"log": {"level": "loud"}}, "log.level"),
        ({"bogus": {}}, "bogus"),
        ({"output": 3}, "output"),
        ({"processors": {"python": 1}}, "processors.python"),
        ({"metrics": {"pprof_max_seconds": 0}}, "metrics.pprof_max_seconds"),
        ({"pyroscope": {"server_address": "pyroscope:4040"}}, "pyroscope.server_address"),
        ({"pyroscope": {"format": "json"}}, "pyroscope.format"),
        ({"pyroscope": {"max_queue": 0}}, "pyroscope.max_queue"),
        ({"pyroscope": {"tags": {"env": "a,b"}}}, "pyroscope.tags.env"),
        ({"pyroscope": {"tags": {"9x": "a"}}}, "pyroscope.tags.9x"),
        ({"pyroscope": {"tags": "env=prod"}}, "pyroscope.tags"),
    ],
)
def test_errors_name_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert str(e.value).startswith(key + ":") or str(e.value).startswith(key + " "), str(e.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"sampling": {"frequency": 1000}}, "sampling.frequency: 1000 is out of range [1, 999]"),
        ({"sampling": {"off_cpu_every": 0}}, "sampling.off_cpu_every: 0 is out of range [1, 4194304]"),
        ({"sampling": {"off_cpu_min_us": 4_000_000_000}},
         "sampling.off_cpu_min_us: 4000000000 is out of range [0, 3600000000]"),
        ({"sampling": {"stack_map_size": 32}}, "sampling.stack_map_size: 32 is out of range [64, 16777216]"),
        ({"sampling": {"drain_interval": 0.01}}, "sampling.drain_interval: 0.01 is out of range [0.05, 3600]"),
        ({"output": {"backlog_max_bytes": "2T"}},
         "output.backlog_max_bytes: 2199023255552 is out of range [0, 1099511627776]"),
        ({"control": {"socket_mode": 0o1777}}, "control.socket_mode: 0o1777 is out of range [0o0, 0o777]"),
    ],
)
def test_a_range_error_shows_the_numbers_as_written(raw: dict, message: str) -> None:
    """Whole numbers in full, not as 4.1943e+06, so the bound can be copied back into the file."""
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert str(e.value) == message


def test_cross_key_checks() -> None:
    with pytest.raises(ConfigError, match="output.rotate_interval"):
        config_from_dict({"sampling": {"drain_interval": 30}, "output": {"rotate_interval": 10}})


def test_pprof_window_must_fit_the_ring() -> None:
    with pytest.raises(ConfigError, match="metrics.pprof_max_seconds"):
        config_from_dict({"metrics": {"pprof_max_seconds": 900}})
    # off: the bound does not apply
    config_from_dict({"metrics": {"pprof": False, "pprof_max_seconds": 900}})


def test_pyroscope_table(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[pyroscope]\nserver_address = "http://p:4040"\ntimeout = "2s"\n'
                 '[pyroscope.tags]\nenv = "prod"\nrack = 7\n')
    cfg = load_config(str(f))
    assert cfg.pyroscope.server_address == "http://p:4040"
    assert cfg.pyroscope.timeout == 2.0
    assert dict(cfg.pyroscope.tags) == {"env": "prod", "rack": "7"}


def test_units_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[retention]\nmax_bytes = "2G"\nmax_age = "2d"\n[output]\nrotate_interval = "5m"\n'
                 '[control]\nallowed_users = [1000, "alice"]\n')
    cfg = load_config(str(f), overrides={"sampling.frequency": 99, "output.state_dir": "/x"})
    assert cfg.retention.max_bytes == 2 << 30
    assert cfg.retention.max_age == 2 * 86400
    assert cfg.output.rotate_interval == 300
    assert cfg.control.allowed_users == ("1000", "alice")
    assert cfg.sampling.frequency == 99 and cfg.output.state_dir == "/x"
    assert cfg.source == str(f)
    with pytest.raises(ConfigError, match="sampling.frequency"):
        load_config(str(f), overrides={"sampling.frequency": 5000})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling\nfrequency = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_cli_check_config_reports_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[output]\ncompress = 1\n")
    assert main(["daemon", "--config", str(bad), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "output.compress: expected true or false" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("pid", [-1, (1 << 22) + 1, 1 << 40])
def test_pids_out_of_range_name_the_element(pid: int) -> None:
    """A negative or impossible pid was accepted, and the BPF filter map's u32 key
    wrapped it to some other pid (-1: 4294967295), so nothing was sampled, silently."""
    with pytest.raises(ConfigError, match=rf"^sampling\.pids\[1\]: {pid} is out of range \[0, 4194304\]$"):
        config_from_dict({"sampling": {"pids": [1, pid]}})
    assert config_from_dict({"sampling": {"pids": [1, 4194304]}}).sampling.pids == (1, 4194304)


def test_byte_order_mark_is_named(tmp_path: Path) -> None:
    """A file saved with a BOM was 'not valid TOML: Invalid statement (at line 1, column 1)'."""
    cfg = tmp_path / "flamed.toml"
    cfg.write_bytes(b"\xef\xbb\xbf[sampling]\nfrequency = 10\n")
    with pytest.raises(ConfigError, match="starts with a UTF-8 byte order mark .* without BOM"):
        load_config(str(cfg))


@pytest.mark.parametrize("explicit", [True, False], ids=["--config", "default-path"])
def test_dangling_config_link_is_an_error_not_defaults(tmp_path: Path, explicit: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A config file that is a link to a file gone: the default path read as
    'no file, all defaults' and the daemon started on defaults, silently."""
    link = tmp_path / "flamed.toml"
    link.symlink_to(tmp_path / "moved.toml")
    if explicit:
        call = lambda: load_config(str(link))  # noqa: E731
    else:
        import flamed.daemon.config as config

        monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", str(link))
        call = lambda: load_config(None)  # noqa: E731
    with pytest.raises(ConfigError, match=rf"flamed\.toml: a symbolic link to '{tmp_path}/moved\.toml', "
                                          "which does not exist"):
        call()


def test_endless_config_file_is_refused_not_read_to_the_end(tmp_path: Path) -> None:
    """`--config /dev/zero` read until memory ran out (a MemoryError traceback,
    or the OOM killer); a device is refused now, and what is read of a regular
    file stops after 1 MiB."""
    import resource
    import subprocess
    import sys

    def limit() -> None:  # 1 GiB of address space: reading /dev/zero to the end would exceed it
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    r = subprocess.run([sys.executable, "-m", "flamed", "daemon", "--config", "/dev/zero", "--check-config"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, preexec_fn=limit, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "flamed daemon: error: /dev/zero: a character device, not a regular file; the config " \
                       "must be a regular file (it is read again at every reload, SIGHUP)\n"
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * (1 << 20) + b"\n")
    with pytest.raises(ConfigError, match="more than 1 MiB"):
        load_config(str(big))
    assert (ROOT / "packaging" / "flamed.toml").stat().st_size < 16 << 10


def test_a_fifo_config_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    """`--config fifo.toml --check-config` waited for ever in open() for a writer
    (and a reload did the same in the daemon's main loop, deaf to SIGTERM)."""
    import subprocess
    import sys

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    try:
        r = subprocess.run([sys.executable, "-m", "flamed", "daemon", "--config", str(fifo), "--check-config"],
                           capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:  # run() has killed it
        pytest.fail("--check-config on a FIFO did not return")
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"flamed daemon: error: {fifo}: a pipe (FIFO), not a regular file; the config must be "
                        "a regular file (it is read again at every reload, SIGHUP)\n")


def test_a_pipe_config_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`--config <(printf ...)` started, and the first SIGHUP read the pipe again,
    found it empty and reloaded every default (state dir, socket, metrics port)."""
    r, w = os.pipe()
    try:
        os.write(w, b"[sampling]\nfrequency = 49\nsampler = \"fake\"\n")
        os.close(w)
        w = -1
        path = f"/proc/self/fd/{r}"
        with pytest.raises(ConfigError, match=rf"^{path}: a pipe \(FIFO\), not a regular file;"):
            load_config(path)
        assert main(["daemon", "--config", path, "--check-config"]) == 2
        assert "a pipe (FIFO), not a regular file" in capsys.readouterr().err
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_config_that_is_a_device_socket_or_directory_is_named_as_such(tmp_path: Path) -> None:
    import socket

    sock = tmp_path / "s.toml"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        for path, kind in [("/dev/null", "a character device"), (str(sock), "a socket"),
                           (str(tmp_path), "a directory")]:
            with pytest.raises(ConfigError, match=rf"^{path}: {kind}, not a regular file;"):
                load_config(path)


def _check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    cfg = tmp_path / "flamed.toml"
    cfg.write_text(text)
    code = main(["daemon", "--config", str(cfg), "--check-config"])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_config_refuses_paths_the_daemon_would_refuse(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--check-config said ok, and the daemon then stopped at start with exit 2:
    a file where state_dir or the socket's directory goes, a dangling link, a
    file at the socket's path."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    sock = f'\n[control]\nsocket = "{tmp_path}/ok.sock"\n'
    cases = {
        f'[output]\nstate_dir = "{tmp_path}/afile/profiles"\n{sock}':
            f"output.state_dir: {tmp_path}/afile (in the path of {tmp_path}/afile/profiles) is a regular file, "
            "not a directory",
        f'[output]\nstate_dir = "{tmp_path}/dangling"\n{sock}':
            f"output.state_dir: {tmp_path}/dangling is a symbolic link to '{tmp_path}/gone', which does not exist",
        f'[output]\nstate_dir = "{tmp_path}/s"\n[control]\nsocket = "{tmp_path}/afile"\n':
            f"control.socket: {tmp_path}/afile exists and is not a socket",
        f'[output]\nstate_dir = "{tmp_path}/s"\n[control]\nsocket = "{tmp_path}/afile/flamed.sock"\n':
            f"control.socket: {tmp_path}/afile is a regular file, not a directory",
    }
    for text, message in cases.items():
        code, out, err = _check(tmp_path, text, capsys)
        assert code == 2, (text, out, err)
        assert err.count("\n") == 1 and message in err, (text, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dangling", "flamed.toml"]


def test_check_config_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Missing directories are fine (the daemon creates them) but --check-config leaves them missing."""
    code, out, err = _check(tmp_path, f'[output]\nstate_dir = "{tmp_path}/a/b"\n'
                                      f'[control]\nsocket = "{tmp_path}/run/flamed.sock"\n', capsys)
    assert (code, err) == (0, "") and out.endswith(": ok\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flamed.toml"]


def test_allowed_users_in_non_ascii_digits_are_names_not_ids() -> None:
    """'²' passes str.isdigit() but not int(): it is looked up as a name (none
    such, ignored as unknown names are), not a traceback at start."""
    from flamed.daemon.control import resolve_ids

    assert resolve_ids(["0", "\u00b2", "\u0663"], "user") == frozenset({0})


def test_password_file_is_read_by_check_config_and_bad_bytes_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--check-config said ok for a password file the start could not read, and a
    file that was not UTF-8 stopped the start with a UnicodeDecodeError traceback."""
    from flamed.daemon.pyroscope import read_password

    good = tmp_path / "pw"
    good.write_bytes(b"s3cret\nignored\n")
    good.chmod(0o600)
    binary = tmp_path / "pw.bin"
    binary.write_bytes(b"\xff\xfes3cret\n")
    base = f'[output]\nstate_dir = "{tmp_path}/s"\n[control]\nsocket = "{tmp_path}/c.sock"\n' \
           '[pyroscope]\nserver_address = "http://127.0.0.1:4040"\n'
    code, out, err = _check(tmp_path, base + f'basic_auth_password_file = "{good}"\n', capsys)
    assert (code, err) == (0, "") and out.endswith(": ok\n")
    assert read_password(str(good)) == "s3cret"
    # A file not there (yet: a secret provisioned later) exits 1, which systemd
    # restarts; one whose content is wrong is a configuration error, exit 2,
    # which the unit does not restart into again (RestartPreventExitStatus).
    for path, message, want in ((tmp_path / "missing", "cannot read", 1),
                                (binary, "not UTF-8 text (byte 0xff at offset 0)", 2),
                                (Path("/dev/zero"), "first line longer than 64 KiB", 2)):
        code, out, err = _check(tmp_path, base + f'basic_auth_password_file = "{path}"\n', capsys)
        assert code == want and out == "", (path, err)
        assert err.startswith("flamed daemon: error: pyroscope.basic_auth_password_file: ") \
            and str(path) in err and message in err and err.count("\n") == 1, err


def test_check_config_refuses_a_state_dir_on_a_read_only_file_system(tmp_path: Path) -> None:
    """A state_dir to be created on a read-only mount: the start stops with exit 2
    (EROFS), so --check-config says so too (in a private mount namespace, over a
    read-only tmpfs)."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) for a private read-only mount")
    ro = tmp_path / "ro"
    ro.mkdir()
    cfg = tmp_path / "flamed.toml"
    cfg.write_text(f'[output]\nstate_dir = "{ro}/profiles"\n[control]\nsocket = "{tmp_path}/c.sock"\n')
    script = 'mount -t tmpfs -o ro flamed-ro-test "$0" && exec "$@"'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(ro),
                        sys.executable, "-m", "flamed", "daemon", "--config", str(cfg), "--check-config"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"flamed daemon: error: output.state_dir: cannot create directory {ro}/profiles: "
                               "Read-only file system"), r.stderr
    assert not (ro / "profiles").exists()


@pytest.mark.parametrize("entry", ['"-1"', "-1", "99999999999", '"4294967295"', '""', '"a:b"', '"two words"',
                                   '"a/b"'])
def test_allowed_ids_that_name_no_one_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   entry: str) -> None:
    """[-1], [99999999999] and the like passed --check-config and were ignored at
    start with an INFO line: the user meant to be let in was refused silently."""
    base = f'[output]\nstate_dir = "{tmp_path}/s"\n[control]\nsocket = "{tmp_path}/c.sock"\n'
    for key in ("allowed_users", "allowed_groups"):
        code, _out, err = _check(tmp_path, base + f"{key} = [{entry}]\n", capsys)
        assert code == 2 and f"control.{key}" in err and "neither a name nor an id" in err, (key, entry, err)
    code, out, err = _check(tmp_path, base + 'allowed_users = [0, "4294967294", "alice", "web-1", "\u00b2"]\n',
                            capsys)
    assert (code, err) == (0, ""), err


def test_an_unknown_name_is_a_warning_the_default_group_missing_is_not() -> None:
    import logging

    from flamed.daemon.control import resolve_ids

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("flamed.daemon")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        assert resolve_ids(["nosuchuser-xyz"], "user") == frozenset()
        resolve_ids(["flamed"], "group")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    levels = {r.getMessage().split("named ")[1].split(" ")[0]: r.levelname for r in records
              if "on this system" in r.getMessage()}
    assert levels.get("'nosuchuser-xyz'") == "WARNING", levels
    assert levels.get("'flamed'", "INFO") == "INFO"  # absent here, or the package's group exists


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    return None


def test_a_state_dir_on_the_kernels_own_file_systems_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--check-config said ok for a state_dir under /proc or /sys, and the start then
    stopped with exit 2; under a cgroup file system mkdir even succeeds (it makes a
    cgroup) and only the first write failed.  Both refuse it now, naming the file
    system, and nothing is created."""
    from flamed.daemon.paths import PathError, ensure_directory

    sock = f'\n[control]\nsocket = "{tmp_path}/ok.sock"\n'
    for path, fstype in (("/proc/flamed-profiles", "proc"), ("/sys/flamed/profiles", "sysfs")):
        code, out, err = _check(tmp_path, f'[output]\nstate_dir = "{path}"\n{sock}', capsys)
        assert code == 2 and out == "", err
        assert f"output.state_dir: {path} is on a {fstype} file system" in err and err.count("\n") == 1, err
    cg = _cgroup2_mount()
    if cg is None:
        pytest.skip("no cgroup2 file system mounted here")
    target = f"{cg}/flamed-test-state-{os.getpid()}"
    with pytest.raises(PathError, match=r"is on a cgroup2 file system .* not files") as e:
        ensure_directory(target, "output.state_dir")
    assert e.value.exit_code == 2
    assert not os.path.exists(target)


def test_file_system_type_reads_the_mount_table(tmp_path: Path) -> None:
    from flamed.daemon.paths import file_system_type

    (tmp_path / "a b").mkdir()
    (tmp_path / "a b" / "c").mkdir()
    table = tmp_path / "mountinfo"
    esc = str(tmp_path).replace(" ", "\\040")
    table.write_text(
        "21 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        f"30 21 0:5 / {esc}/a\\040b rw shared:1 - tmpfs none rw\n"
        f"31 30 0:6 / {esc}/a\\040b/c rw - proc proc rw\n"
        f"32 30 0:7 / {esc}/a\\040b/c rw - sysfs sys rw\n"  # mounted later over the same place
        "garbage line\n")
    assert file_system_type(str(tmp_path), str(table)) == "ext4"
    assert file_system_type(str(tmp_path / "a b"), str(table)) == "tmpfs"
    assert file_system_type(str(tmp_path / "a b" / "c"), str(table)) == "sysfs"
    assert file_system_type(str(tmp_path), str(tmp_path / "none")) is None
