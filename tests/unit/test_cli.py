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
