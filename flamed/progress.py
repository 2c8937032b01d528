"""The progress line of the long offline jobs (collapse, svg, top, tree, export, merge).

One line on stderr, redrawn a few times a second, and only when stderr is a
terminal and the input is large: tests, pipes and redirected stderr never see
it, and nothing of it reaches the output.

While a command reads, the line shows the bytes read of its input files
against their total size (:func:`reading` makes a :class:`Progress` the active
one; :func:`flamed.fileio.open_input` counts what is read through the files it
opens, by file, so a file opened twice -- once for its head, once to read it --
counts once).  Work after the reading (layout, drawing, sorting, writing) shows
as a named phase with a count (:func:`phase`), drawn only once the phase has
taken a moment, so a short one shows nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TextIO, TypeVar

#: Show a progress line for inputs larger than this (when stderr is a terminal).
PROGRESS_MIN_BYTES = 4 << 20
#: Seconds between redraws.
REDRAW = 0.2
#: A phase after the reading is drawn once it has run this long.
PHASE_DELAY = 0.5

T = TypeVar("T")


def isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Phase:
    """A named step after the reading: ``label: NAME [bar] 40.0% 1,234/3,085 UNIT``
    (without a bar when the total is not known)."""

    def __init__(self, progress: Progress, name: str, total: int | None, unit: str) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.unit = unit
        self.done = 0
        self._next_check = 0
        # Many small items: the clock is read every few hundred; few large ones
        # (a thread's timeline): at each.
        self._every = 1 if total is not None and total < 10_000 else 256
        self.t0 = time.monotonic()

    def step(self, n: int = 1) -> None:
        """``n`` more items done (cheap: the clock is read every few hundred items)."""
        self.done += n
        if self.done >= self._next_check:
            self._next_check = self.done + self._every
            self.progress._draw_phase(self)

    def update(self, done: int) -> None:
        """``done`` items done in all."""
        self.done = done
        self.step(0)

    def text(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            return f"{self.name} [{bar:<30}] {frac * 100:5.1f}% {self.done:,}/{self.total:,}{unit}"
        return f"{self.name} {self.done:,}{unit}"


class Progress:
    """A one-line progress bar on a terminal, at most a few redraws a second."""

    def __init__(self, stream: TextIO, total: int | None, label: str = "collapse") -> None:
        self.stream = stream
        self.total = total
        self.label = label
        self.done = 0
        self.t0 = time.monotonic()
        # A known large input is drawn at once; one of unknown size (stdin) only
        # after a moment, so a short run shows nothing.
        self._last = 0.0 if total else self.t0
        self._drawn = False
        #: Bytes read of each file (its furthest offset), by name.
        self._files: dict[str, int] = {}
        self._base = 0

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the input read."""
        self._base += nbytes
        self._changed()

    def reached(self, name: str, offset: int) -> None:
        """The input ``name`` has been read up to ``offset`` bytes."""
        if offset > self._files.get(name, 0):
            self._files[name] = offset
            self._changed()

    def _changed(self) -> None:
        now = time.monotonic()
        if now - self._last < REDRAW:
            return
        self._last = now
        self.done = self._base + sum(self._files.values())
        mb = self.done / 1e6
        rate = mb / max(now - self.t0, 1e-6)
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            text = f"{self.label}: [{bar:<30}] {frac * 100:5.1f}% {mb:8.1f}/{self.total / 1e6:.1f} MB {rate:6.1f} MB/s"
        else:
            text = f"{self.label}: {mb:8.1f} MB {rate:6.1f} MB/s"
        self._write(text)

    def _draw_phase(self, ph: Phase) -> None:
        now = time.monotonic()
        if now - ph.t0 < PHASE_DELAY or now - self._last < REDRAW:
            return
        self._last = now
        self._write(f"{self.label}: {ph.text()}")

    def _write(self, text: str) -> None:
        # Marked drawn before the write: a Ctrl-C that lands inside the write (or
        # between it and the flush) must still have finish() clear the line, or the
        # message that ends the run is printed after the bar.
        self._drawn = True
        try:
            # Clear to the end of the line: a shorter text must not keep the tail of a longer one.
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
        except (OSError, ValueError):
            return  # the terminal went away: the job goes on without its progress line

    def phase(self, name: str, total: int | None = None, unit: str = "") -> Phase:
        return Phase(self, name, total, unit)

    def finish(self) -> None:
        if self._drawn:
            self._drawn = False
            with contextlib.suppress(OSError, ValueError):
                self.stream.write("\r\x1b[K")
                self.stream.flush()


#: The progress line of the job under way, if it draws one.
_ACTIVE: Progress | None = None


def active() -> Progress | None:
    return _ACTIVE


def input_total(paths: Sequence[str | None]) -> int | None:
    """Total size of ``paths``; ``None`` when one is stdin, a pipe or missing (size unknown)."""
    total = 0
    for p in paths or [None]:
        if p is None or p == "-":
            return None
        try:
            st = os.stat(p)
        except OSError:
            return None
        if not os.path.isfile(p):
            return None
        total += st.st_size
    return total


@contextlib.contextmanager
def reading(stream: TextIO | None, paths: Sequence[str | None], label: str) -> Iterator[Progress | None]:
    """Draw the progress of a job reading ``paths`` on ``stream`` while the block runs:
    only when ``stream`` is a terminal and the input is over :data:`PROGRESS_MIN_BYTES`
    (or of unknown size: stdin, drawn after a moment).  Inside a job that already
    draws one, the block shares it.  The line is cleared when the block ends, an
    error or Ctrl-C included."""
    global _ACTIVE
    if _ACTIVE is not None or not isatty(stream):
        yield _ACTIVE
        return
    assert stream is not None
    total = input_total(paths)
    if total is not None and total <= PROGRESS_MIN_BYTES:
        yield None
        return
    prog = Progress(stream, total, label)
    _ACTIVE = prog
    try:
        yield prog
    finally:
        _ACTIVE = None
        prog.finish()


def phase(name: str, total: int | None = None, unit: str = "") -> Phase | None:
    """A named phase of the job under way, or ``None`` when it draws no progress line."""
    prog = _ACTIVE
    return prog.phase(name, total, unit) if prog is not None else None


def counted(items: Iterable[T], name: str, total: int | None = None, unit: str = "") -> Iterable[T]:
    """``items`` as they are, counted in a phase ``name`` when a progress line is drawn
    (without one, ``items`` itself: no cost)."""
    ph = phase(name, total, unit)
    if ph is None:
        return items
    return _counting(items, ph)


def _counting(items: Iterable[T], ph: Phase) -> Iterator[T]:
    step = ph.step
    for x in items:
        yield x
        step()
