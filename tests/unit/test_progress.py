"""flamed.progress: the named phases after the reading, and the line's absence off a terminal.

The phases are drawn once they have run half a second; here that delay and the
redraw interval are set to 0 so every phase shows whatever the machine's speed,
on a stream that says it is a terminal.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

import flamed.progress as progress
from flamed.cli import main


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def folded(tmp_path: Path) -> Path:
    rng = random.Random(5)
    path = tmp_path / "in.folded"
    lines = [
        ";".join(["app"] + [f"f{rng.randrange(40)}" for _ in range(rng.randrange(1, 12))]) + f" {rng.randrange(1, 9)}"
        for _ in range(3_000)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "PHASE_DELAY", 0.0)
    monkeypatch.setattr(progress, "REDRAW", 0.0)
    monkeypatch.setattr(progress, "PROGRESS_MIN_BYTES", 0)


@pytest.mark.parametrize(
    ("args", "phases"),
    [
        (["svg"], ["svg: layout ", " boxes", "svg: drawing [", " boxes"]),
        (["top", "--jobs", "1"], ["top: counting [", " stacks"]),
        (["tree", "--jobs", "1"], ["tree: building the tree [", "tree: writing ", " nodes"]),
        (["export", "--format", "pprof"], ["export: samples [", " stacks"]),
    ],
)
def test_phases_after_the_reading_are_named_with_a_count(
    args: list[str], phases: list[str], folded: Path, tmp_path: Path, eager: None
) -> None:
    term = Terminal()
    shown_out = tmp_path / "tty.out"
    assert main([*args, str(folded), "-o", str(shown_out)], stderr=term) == 0
    text = term.getvalue()
    assert f"{args[0]}: [" in text and " MB " in text  # the reading, by bytes
    for p in phases:
        assert p in text, text[-400:]
    assert text.endswith("\r\x1b[K")  # cleared at the end
    assert progress.active() is None

    # Off a terminal: nothing drawn, the same bytes written.
    plain = io.StringIO()
    plain_out = tmp_path / "plain.out"
    assert main([*args, str(folded), "-o", str(plain_out)], stderr=plain) == 0
    assert plain.getvalue() == ""
    assert shown_out.read_bytes() == plain_out.read_bytes()


def test_small_inputs_draw_nothing(folded: Path, tmp_path: Path) -> None:
    term = Terminal()
    assert main(["svg", str(folded), "-o", str(tmp_path / "o.svg")], stderr=term) == 0
    assert term.getvalue() == ""  # under PROGRESS_MIN_BYTES: no line, even on a terminal


class InterruptedTerminal(Terminal):
    """A terminal whose n-th flush is where Ctrl-C lands: the bar's text is already
    in the stream, the write has not returned."""

    def __init__(self, on_flush: int) -> None:
        super().__init__()
        self.flushes = 0
        self.on_flush = on_flush

    def flush(self) -> None:
        self.flushes += 1
        if self.flushes == self.on_flush:
            raise KeyboardInterrupt


@pytest.mark.parametrize("on_flush", [1, 2, 3])
def test_ctrl_c_inside_a_redraw_still_clears_the_line(
    on_flush: int, folded: Path, tmp_path: Path, eager: None
) -> None:
    term = InterruptedTerminal(on_flush)
    out = tmp_path / "out.svg"
    assert main(["svg", str(folded), "-o", str(out)], stderr=term) == 130
    text = term.getvalue()
    # The bar was drawn, then cleared, then the one message on a line of its own.
    assert "svg: [" in text
    assert text.endswith("\r\x1b[Kflamed svg: interrupted\n"), text[-200:]
    assert not out.exists()
    assert progress.active() is None
