"""The protocol every output format implements."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO, ClassVar

from flamed.errors import UsageError
from flamed.model import Profile, Sample


@dataclass(frozen=True)
class OutputOptions:
    """Options shared by renderers; each format reads the ones it knows.

    title: graph title (default: format's own, e.g. "Flame Graph").
    subtitle: second line under the title (default: none).
    width: image width in px (default 1200).
    minwidth: prune frames narrower than this many px (default 0.1).
    countname: unit of the weights in tooltips (default "samples").
    inverted: draw an icicle graph (default False).
    flamechart: keep input/time order instead of sorting frames (default False).
    palette: color scheme name (default "hot"; "mixed" colors kernel/native/python).
    hash: color by a hash of the name, stable across graphs (default False).
    palette_file: file that maps names to colors, read and extended (default None).
    frame_height: height of a row of boxes in px (default 16; flamegraph.pl's --height).
    font_size: label size in px (default 12).
    font_type: label font family (default Verdana).
    font_width: average glyph width as a share of the font size, to fit labels (default 0.59).
    nametype: what the names are, before the hovered name in the details line (default "Function:").
    bgcolors: background: yellow, blue, green, grey (gradients) or #rrggbb (flat);
        default by palette, as flamegraph.pl.
    negate: differentials: swap the hues (red shrank, blue grew).
    random: colors drawn at random (per name, so one name keeps one color in a graph).
    notes: text of a comment embedded in the SVG.
    extra: format-specific settings by name.
    """

    title: str | None = None
    subtitle: str | None = None
    width: int = 1200
    minwidth: float = 0.1
    countname: str = "samples"
    inverted: bool = False
    flamechart: bool = False
    palette: str = "hot"
    hash: bool = False
    palette_file: str | None = None
    frame_height: int = 16
    font_size: float = 12.0
    font_type: str = "Verdana"
    font_width: float = 0.59
    nametype: str = "Function:"
    bgcolors: str | None = None
    negate: bool = False
    random: bool = False
    notes: str = ""
    extra: dict[str, str] = field(default_factory=dict)


class OutputFormat:
    """An output format: writes a Profile (and optionally a sample stream)."""

    name: ClassVar[str] = ""
    extensions: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    #: True if the format can use a time-ordered sample stream (chrome trace).
    wants_samples: ClassVar[bool] = False
    #: False if the format needs that stream and cannot write an aggregated Profile (trace).
    writes_profiles: ClassVar[bool] = True

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        raise NotImplementedError

    def write_samples(
        self, samples: Iterable[Sample], out: BinaryIO, options: OutputOptions | None = None
    ) -> None:
        raise UsageError(f"format {self.name!r} does not take a time-ordered sample stream")
