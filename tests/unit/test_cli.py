from __future__ import annotations

import io

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
