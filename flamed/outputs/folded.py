"""Folded stacks, the text flamegraph.pl reads."""

from __future__ import annotations

from typing import BinaryIO

from flamed.folded import write_folded
from flamed.model import Profile
from flamed.outputs.base import OutputFormat, OutputOptions


class FoldedFormat(OutputFormat):
    name = "folded"
    extensions = (".folded", ".txt", ".collapsed")
    description = "folded stacks: 'a;b;c COUNT' per line, sorted"

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        write_folded(profile, out)
