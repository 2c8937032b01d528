"""bcc ``profile`` output (``profile-bpfcc``): folded (``-f``) or the default multi-line form.

Multi-line: one block per stack, kernel frames first (leaf first), then user
frames, then the task and the count::

        _raw_spin_unlock_irqrestore
        --
        start_thread
        -                worker 0 (10721)
            12

Frames that no task and count line close (the output cut short at its end,
or a blank line) are counted as one malformed line, as a missing count is.

``--`` (with ``-d``) separates kernel from user frames; the kernel frames are
then annotated ``_[k]`` (without ``-d`` they cannot be told apart and are kept
as printed).  ``[Missed Kernel Stack]``/``[Missed User Stack]`` are kept, they
are the visible placeholders bcc itself prints.  The task line keeps the comm
whole (``worker 0`` stays ``worker 0``; ``;`` in it becomes ``:``); ``--pid``
adds ``-PID`` (bcc reports the process id, not the thread id).

Folded (``-f``): ``comm;user...;[-;]kernel... COUNT``, read as folded; with
``-d`` the frames after the ``-`` delimiter are annotated ``_[k]`` and the
delimiter dropped.  A ``;`` inside a comm cannot be recovered from folded text
(bcc writes it as is); the multi-line form keeps it.
"""

from __future__ import annotations

import re

from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser, block_boundary, first_lines
from flamed.folded import parse_line
from flamed.model import KERNEL_SUFFIX, Stack, sanitize_frame, task_frame

# Digit runs are bounded: int() refuses more than 4300 digits (ValueError).
_TASK_LINE = re.compile(r"^    -\s+(.*) \((\d{1,19})\)\s*$")
_TASK_LINE_B = re.compile(rb"^    -\s+.* \(\d+\)\s*$", re.M)
_COUNT_LINE = re.compile(r"^\s+(\d{1,19})\s*$")
_FOLDED = re.compile(rb"^\S.*\s[0-9]+\r?$")


class BccCollapser(Collapser):
    name = "bcc"
    description = "bcc profile output (profile-bpfcc, folded -f or multi-line)"

    def detect(self, head: bytes) -> int:
        if _TASK_LINE_B.search(head):
            return 90
        if head.startswith(b"Sampling at ") and b"Hertz" in head.split(b"\n", 1)[0]:
            return 85
        # bcc -f output is folded text; only its "-" kernel delimiter tells it apart.
        lines = [ln for ln in first_lines(head) if ln.strip()]
        if lines and any(b";-;" in ln for ln in lines) and all(_FOLDED.match(ln) for ln in lines):
            return 60
        return 0

    def boundary(self, buf: bytes) -> int:
        return block_boundary(buf)

    def parser(self, options: CollapseOptions) -> ChunkParser:
        return BccParser(options)


def _unquote(frame: str) -> str:
    # Old bcc versions printed Python bytes reprs: b'func'.
    if len(frame) >= 3 and frame[0] == "b" and frame[1] in "'\"" and frame[-1] == frame[1]:
        return frame[2:-1]
    return frame


class BccParser(ChunkParser):
    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        res = ChunkResult()
        group = res.group("")
        text = data.decode("utf-8", "surrogateescape")
        lines = text.split("\n")
        kernel = "kernel" in self.options.annotate
        frames: list[str] = []
        frames_at = 0  # line number of the first frame of ``frames``
        records = 0
        i = 0
        n = len(lines)
        while i < n:
            line = lines[i].rstrip("\r")
            i += 1
            if not line.strip():
                if frames:
                    self._unfinished(res, source, first_line + frames_at)
                frames = []
                continue
            if line.startswith("    "):
                m = _TASK_LINE.match(line)
                if m is None:
                    if not frames:
                        frames_at = i - 1
                    frames.append(line.strip())
                    continue
                # Task line: the count follows.
                comm, pid = m.group(1), int(m.group(2))
                count_line = lines[i].rstrip("\r") if i < n else ""
                cm = _COUNT_LINE.match(count_line)
                if cm is None:
                    self.malformed(res, source, first_line + i - 1, "bcc stack without a count line")
                    frames = []
                    continue
                i += 1
                group_key = ";".join(self._multiline_stack(frames, comm, pid, kernel))
                group[group_key] = group.get(group_key, 0) + int(cm.group(1))
                records += 1
                frames = []
                continue
            # Unindented: folded (-f) output, or bcc's own banner/warnings.
            if line.startswith(("Sampling at ", "WARNING", "Hint:", "Possibly")) or line.startswith("#"):
                continue
            rec = parse_line(line)
            if rec is None:
                self.malformed(res, source, first_line + i - 1, "neither a bcc folded line nor a multi-line stack")
                continue
            stack, w = rec
            if "-" in stack:
                stack = self._folded_delimited(stack, kernel)
            key = ";".join(stack)
            group[key] = group.get(key, 0) + w
            records += 1
        if frames:
            # Frames up to the end of the input (a chunk ends at a blank line, so only
            # the last one can end inside a stack): a stack cut short.
            self._unfinished(res, source, first_line + frames_at)
        res.stats.records += records
        return res

    def _unfinished(self, res: ChunkResult, source: str, line: int) -> None:
        """Frames that no task and count line closed (cut at the end of the input, or
        followed by a blank line): counted as one malformed stack, at its first frame."""
        self.malformed(res, source, line, "bcc stack without a task and count line")

    def _multiline_stack(self, frames: list[str], comm: str, pid: int, kernel: bool) -> Stack:
        root = task_frame(comm, pid) if (self.options.include_pid or self.options.include_tid) else sanitize_frame(comm)
        out = [root]
        if "--" in frames:
            d = frames.index("--")
            kframes, uframes = frames[:d], frames[d + 1 :]
        else:
            kframes, uframes = [], frames
        for f in reversed(uframes):
            out.append(sanitize_frame(_unquote(f)))
        for f in reversed(kframes):
            f = sanitize_frame(_unquote(f))
            if kernel and not f.endswith(KERNEL_SUFFIX) and not f.startswith("[Missed"):
                f += KERNEL_SUFFIX
            out.append(f)
        return tuple(out)

    def _folded_delimited(self, stack: Stack, kernel: bool) -> Stack:
        d = len(stack) - 1 - stack[::-1].index("-")
        head, tail = stack[:d], stack[d + 1 :]
        if kernel:
            tail = tuple(f if f.endswith(KERNEL_SUFFIX) else f + KERNEL_SUFFIX for f in tail)
        return head + tail
