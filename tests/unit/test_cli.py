from __future__ import annotations

import io
from pathlib import Path

import pytest

from flamed import __version__
from flamed.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flamed {__version__}"


def test_no_command_prints_help() -> None:
    out = io.StringIO()
    assert main([], stdout=out) == 2
    assert "COMMAND" in out.getvalue()


def test_unknown_command_is_one_line_error() -> None:
    err = io.StringIO()
    assert main(["no-such-command"], stderr=err) == 2
    assert "invalid choice" in err.getvalue()


def test_mistyped_option_prints_the_subcommands_usage() -> None:
    err = io.StringIO()
    assert main(["svg", "--colours", "java", "x.folded"], stderr=err) == 2
    text = err.getvalue()
    assert "usage: flamed svg " in text
    assert "unrecognized arguments: --colours" in text
    assert "usage: flamed [-h]" not in text


def test_help_lists_every_command_and_a_command_parses_alone() -> None:
    out = io.StringIO()
    assert main([], stdout=out) == 2
    for name in ("collapse", "svg", "diff", "record", "daemon", "flush"):
        assert name in out.getvalue()
    err = io.StringIO()
    assert main(["flush", "--no-such"], stderr=err) == 2
    assert "usage: flamed flush" in err.getvalue()


def _commands_with_jobs() -> list[str]:
    """Every subcommand that has a -j/--jobs option (each parsed with its options)."""
    from flamed.cli import build_parser
    from flamed.commands import discover

    found = []
    for cls in discover(None):
        parser = build_parser(argv=[cls.name])
        sub = next(a for a in parser._actions if a.dest == "command")
        p = sub.choices[cls.name]  # type: ignore[index]
        if any("--jobs" in a.option_strings for a in p._actions):
            found.append(cls.name)
    return found


def test_every_jobs_option_is_checked_by_argparse() -> None:
    assert {"collapse", "merge", "svg"} <= set(_commands_with_jobs())


@pytest.mark.parametrize("command", _commands_with_jobs())
@pytest.mark.parametrize("value", ["0", "-3", "2000", "x"])
def test_jobs_out_of_range_is_a_usage_error(tmp_path: Path, command: str, value: str) -> None:
    """`merge -j 0` and `merge -j -3` were taken silently; every --jobs is 1..1024,
    refused by name before any input is read, with nothing written."""
    folded = tmp_path / "in.folded"
    folded.write_text("main;work 3\n")
    out = tmp_path / "out.data"
    err = io.StringIO()
    assert main([command, "-j", value, str(folded), "-o", str(out)], stderr=err) == 2, err.getvalue()
    assert "argument -j/--jobs: expected a number of worker processes" in err.getvalue()
    assert not out.exists()
    ok = io.StringIO()
    assert main([command, "-j", "2", str(folded), "-o", str(out)], stderr=ok) == 0, ok.getvalue()
    assert out.exists()


def test_collapse_to_a_trace_is_refused_before_the_input_is_read(tmp_path: Path) -> None:
    """collapse sums samples; a trace keeps each one.  ``-o x.trace`` was refused
    only after the whole input had been collapsed, and --help offered ``trace``."""
    err = io.StringIO()
    big = tmp_path / "never-read.txt"  # does not exist: a refusal after reading would say "no such file"
    assert main(["collapse", str(big), "-o", str(tmp_path / "x.trace")], stderr=err) == 2
    assert "use 'flamed export --format trace' or 'flamed merge'" in err.getvalue()
    assert not (tmp_path / "x.trace").exists()
    err = io.StringIO()
    assert main(["collapse", "--output-format", "trace", str(big)], stderr=err) == 2
    assert "invalid choice: 'trace'" in err.getvalue()


def test_top_tree_and_collapse_read_pprof_and_speedscope_files(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`flamed record -o x.pb.gz`, then `flamed top x.pb.gz`: top, tree and
    collapse said "cannot tell the input format", though svg and export read
    those files.  They read them now (off-CPU time keeps its unit), beside
    collapsed inputs."""
    from flamed.model import Profile
    from flamed.outputs import get

    off = Profile(stacks={("app-1/1", "a", "b"): 1500, ("app-1/1", "a"): 500},
                  labels={"kind": "off_cpu", "unit": "microseconds"})
    cpu = Profile(stacks={("a", "b", "c"): 3, ("a", "b"): 2})
    for name, prof, fmt in (("off.pb.gz", off, "pprof"), ("cpu.speedscope.json", cpu, "speedscope")):
        with (tmp_path / name).open("wb") as f:
            get(fmt).write(prof, f)
    (tmp_path / "cpu.folded").write_text("a;b;c 3\na;b 2\n")

    def run(*args: str) -> str:
        code = main(list(args))
        out, err = capsys.readouterr()
        assert code == 0, err
        return out

    top = run("top", str(tmp_path / "off.pb.gz"))
    assert "total weight 2000 \u00b5s of off-CPU time" in top and " b\n" in top, top
    assert '"unit":"microseconds"' in run("tree", str(tmp_path / "off.pb.gz"))
    both = run("collapse", str(tmp_path / "cpu.speedscope.json"), str(tmp_path / "cpu.folded"))
    assert both.splitlines() == ["a;b 4", "a;b;c 6"], both
