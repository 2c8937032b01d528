"""The real CLI started with stdin, stdout or stderr closed (`<&-`, `>&-`, `2>&-`).

A command that needs the closed stream says so in one line and exits non-zero;
one that does not need it (stdout closed, -o FILE given) just works.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.concurrent

FOLDED = b"main;a;b 3\nmain;a;c 2\nmain;d 1\n"
#: Run "$0 $@" with the given redirection applied by the shell, as a user would.
SHELL = 'exec "$0" "$@" {}'


@pytest.fixture
def folded(tmp_path: Path) -> Path:
    p = tmp_path / "in.folded"
    p.write_bytes(FOLDED)
    return p


def run(redirect: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    argv = ["sh", "-c", SHELL.format(redirect), sys.executable, "-m", "flamed", *args]
    # The shell closes the stream after subprocess connected it to a pipe.
    return subprocess.run(argv, capture_output=True, timeout=120, check=False)


def one_error_line(res: subprocess.CompletedProcess[bytes], command: str, *words: str) -> str:
    err = res.stderr.decode()
    assert res.returncode != 0, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"flamed {command}: error: ")
    for w in words:
        assert w in lines[0]
    return lines[0]


#: Every command that reads standard input (no INPUT, or '-').
STDIN_READERS = [
    ["collapse"],
    ["top"],
    ["tree"],
    ["svg"],
    ["export", "--format", "speedscope"],
    ["merge", "-"],
    ["diff", "-", "{folded}"],
]


@pytest.mark.parametrize("cmd", STDIN_READERS, ids=[c[0] for c in STDIN_READERS])
def test_closed_stdin_is_one_line_error(folded: Path, tmp_path: Path, cmd: list[str]) -> None:
    args = [a.format(folded=folded) for a in cmd] + ["-o", str(tmp_path / "out.txt")]
    res = run("<&-", *args)
    line = one_error_line(res, cmd[0], "standard input is closed", "input file")
    assert line.endswith("<stdin>: standard input is closed; name the input file instead")
    assert not (tmp_path / "out.txt").exists()


#: Every command that writes its result to standard output when no -o is given.
STDOUT_WRITERS = [
    ["collapse", "{folded}"],
    ["top", "{folded}"],
    ["tree", "{folded}"],
    ["svg", "{folded}"],
    ["export", "--format", "speedscope", "{folded}"],
    ["merge", "{folded}"],
    ["diff", "{folded}", "{folded}"],
    ["snapshot", "--socket", "{tmp}/no.sock"],
]


@pytest.mark.parametrize("cmd", STDOUT_WRITERS, ids=[c[0] for c in STDOUT_WRITERS])
def test_closed_stdout_is_one_line_error(folded: Path, tmp_path: Path, cmd: list[str]) -> None:
    args = [a.format(folded=folded, tmp=tmp_path) for a in cmd]
    res = run(">&-", *args)
    one_error_line(res, cmd[0], "standard output is closed", "-o FILE")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.folded"]  # nothing written instead


@pytest.mark.parametrize(
    "cmd",
    [["daemon", "--check", "--config", str(ROOT / "packaging" / "flamed.dev.toml")], ["daemon", "--print-bpf"]],
    ids=["daemon-check", "daemon-print-bpf"],
)
def test_closed_stdout_for_printing_commands(cmd: list[str]) -> None:
    res = run(">&-", *cmd)
    one_error_line(res, "daemon", "standard output is closed", ">FILE")


@pytest.mark.parametrize("cmd", STDOUT_WRITERS[:-1], ids=[c[0] for c in STDOUT_WRITERS[:-1]])
def test_closed_stdout_with_output_file_just_works(folded: Path, tmp_path: Path, cmd: list[str]) -> None:
    out = tmp_path / "out.data"
    args = [a.format(folded=folded, tmp=tmp_path) for a in cmd] + ["-o", str(out)]
    res = run(">&-", *args)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stderr == b""
    # Byte for byte what the same command writes with stdout open.
    ref = tmp_path / "ref.data"
    args[-1] = str(ref)
    assert subprocess.run([sys.executable, "-m", "flamed", *args], timeout=120, check=False).returncode == 0
    assert out.read_bytes() == ref.read_bytes() and len(out.read_bytes()) > 0


def test_closed_stderr_keeps_warnings_out_of_stdout(tmp_path: Path) -> None:
    empty = tmp_path / "empty.folded"
    empty.write_bytes(b"")
    res = run("2>&-", "collapse", str(empty))
    # "no samples in the input" is a warning for stderr; with stderr closed it
    # is lost, and must not end up among the output on stdout.
    assert res.returncode == 0
    assert res.stdout == b""


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("cmd", [["svg"], ["collapse", "--output-format", "json"], ["tree", "--indent"]],
                         ids=["svg", "collapse-json", "tree"])
def test_reader_going_away_early_ends_quietly(tmp_path: Path, cmd: list[str], unbuffered: str) -> None:
    """`flamed svg big.folded | head -c 10`: the reader closes the pipe after a
    few bytes; flamed stops, exits 0 and prints nothing (the broken pipe was
    swallowed inside the output's `with`, and svg went on to an
    UnboundLocalError traceback)."""
    import os

    big = tmp_path / "deep.folded"
    big.write_text(";".join(f"frame_{i}" for i in range(5000)) + " 7\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    proc = subprocess.Popen([sys.executable, "-m", "flamed", *cmd, str(big)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == "", err


#: Output argparse or a command prints through ``print`` (not a command's -o writer).
PRINTED = [
    ["--help"],
    ["--version"],
    ["svg", "--help"],
    ["daemon", "--check-config", "--config", str(ROOT / "packaging" / "flamed.dev.toml")],
]


@pytest.mark.parametrize("cmd", PRINTED, ids=["help", "version", "svg-help", "daemon-check"])
def test_printed_output_to_a_reader_gone_away_is_quiet(cmd: list[str]) -> None:
    """`flamed --help | head -0`: the pipe's reader is gone before flamed writes
    (closed here before the start, so the write always fails); exit 0 and
    nothing on stderr (it was a BrokenPipeError traceback)."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run([sys.executable, "-m", "flamed", *cmd], stdout=w, stderr=subprocess.PIPE,
                             timeout=120, check=False)
    finally:
        os.close(w)
    assert res.stderr.decode() == ""
    assert res.returncode == 0


@pytest.mark.parametrize("cmd", PRINTED, ids=["help", "version", "svg-help", "daemon-check"])
def test_printed_output_to_a_full_disk_is_one_line_error(cmd: list[str]) -> None:
    """`flamed --help >/dev/full`: one line naming standard output, exit 1 (it was an OSError traceback)."""
    with open("/dev/full", "wb") as full:
        res = subprocess.run([sys.executable, "-m", "flamed", *cmd], stdout=full, stderr=subprocess.PIPE,
                             timeout=120, check=False)
    command = "daemon" if cmd[0] == "daemon" else ""
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err
    lines = err.strip().splitlines()
    assert lines == [f"flamed{' ' + command if command else ''}: error: cannot write to standard output: "
                     "No space left on device"], err
