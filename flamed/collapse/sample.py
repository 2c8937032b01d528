"""macOS ``sample`` reports (``sample PID 10 -file out.txt``): the ``Call graph:`` section as folded stacks.

A report starts with a preamble (``Analysis of sampling rg (pid 64751)...``,
``Process:``, ``Date/Time:``...), then the call graph, one node per line::

    Call graph:
        825 Thread_15758535
        + 825 thread_start  (in libsystem_pthread.dylib) + 13  [0x7fff739c240d]
        +   825 _pthread_start  (in libsystem_pthread.dylib) + 66  [0x7fff739c6249]
        +   ! 794 rg::main::h6909bd3a32e27a08  (in rg) + 34  [0x1038445a2]
    ...
    Total number in stack (recursive counted multiple, when >=5):

Every line is indented by four spaces, then two characters per level drawn
from `` +|:!``; its first number is the samples in that node and below it.
A node is ``MODULE`FUNCTION`` (``.dylib`` dropped; the argument list, e.g. a
Rust ``(.llvm.123)`` suffix, cut at the first ``(``; Rust legacy-mangled names
decoded), the thread line is the root.

Folded output, as inferno's collapse-sample writes it: one stack per leaf,
weighing the leaf's count.  The samples a non-leaf node spent in itself
(its count less its children's) are not written, as in inferno
(stackcollapse-sample.awk writes them).  Two leaves that fold to the same
stack (one function called from two offsets of its caller) are added up, as
flamegraph.pl adds the awk script's lines; inferno keeps only the last one's
count.  Stacks whose leaf is one of macOS's
blocking waits (``__psynch_cvwait``, ``mach_msg_trap``...) are left out, so
idle threads do not flatten the graph.  Those waits match as
stackcollapse-sample.awk matches them -- the bare name or
``libsystem_kernel`NAME`` -- not by suffix (inferno's ``ends_with`` also hides
``rg`Searcher::read``).  A line without ``(in MODULE)`` has no module (inferno
takes the text up to a ``)`` as the module, so ``Thread_1 DispatchQueue_1:
com.apple.main-thread  (serial)`` would get one).

The section ends at ``Total number in stack``; what follows (``Sort by top
of stack``) is not read.  Malformed call-graph lines (odd or skipped
indentation, no sample count) are skipped and counted, or are errors under
``--strict``.
"""

from __future__ import annotations

import re

from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser, first_lines, text_lines
from flamed.collapse.perf import demangle_rust_legacy
from flamed.model import Weight, sanitize_frame

_START = "Call graph:"
_END = "Total number in stack"
_INDENT = " +|:!"
#: Leaves that are a thread waiting, not working (stackcollapse-sample.awk's list).
_WAITS = (
    "__psynch_cvwait",
    "__select",
    "__semwait_signal",
    "__ulock_wait",
    "__wait4",
    "__workq_kernreturn",
    "kevent",
    "mach_msg_trap",
    "read",
    "semaphore_wait_trap",
)
_IDLE = frozenset(_WAITS) | frozenset(f"libsystem_kernel`{w}" for w in _WAITS)
_NODE_LINE = re.compile(rb"^    [ +|:!]*\d+ \S")


class SampleCollapser(Collapser):
    name = "sample"
    description = "macOS sample reports (sample PID -file out.txt): the call graph"
    integer_weights = True

    def detect(self, head: bytes) -> int:
        lines = first_lines(head)
        for i, ln in enumerate(lines):
            if ln.startswith(b"Call graph:"):
                # Above perf's 60 for indented lines that end in ")".
                nxt = next((x for x in lines[i + 1 :] if x.strip()), b"")
                return 90 if _NODE_LINE.match(nxt) or lines[0].startswith(b"Analysis of sampling ") else 0
        return 0

    def boundary(self, buf: bytes) -> int:
        # A record is a whole report: cut before a call graph that follows a complete one,
        # so every chunk holds a call graph from its start line to its end line.
        cg = buf.rfind(b"\nCall graph:")
        if cg < 0 or buf.rfind(b"\nTotal number in stack", 0, cg) < 0:
            return -1
        return cg + 1

    def parser(self, options: CollapseOptions) -> ChunkParser:
        return SampleParser(options)


class SampleParser(ChunkParser):
    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        res = ChunkResult()
        group = res.group("")
        lines = text_lines(data)
        in_graph = False
        seen = False
        stack: list[str] = []
        count: Weight = 0  # samples of the last node read (the leaf when the next line is not its child)

        def flush() -> None:
            if stack and stack[-1] not in _IDLE:
                key = ";".join(stack)
                group[key] = group.get(key, 0) + count
                res.stats.records += 1

        for n, raw in enumerate(lines):
            line = raw.rstrip()
            if not in_graph:
                if raw.startswith(_START):
                    in_graph = seen = True
                    stack = []
                continue
            if not line:
                continue
            if line.startswith(_END):
                flush()
                in_graph = False
                continue
            if not line.startswith("    "):
                self.malformed(res, source, first_line + n, "call graph line not indented by 4 spaces")
                continue
            node = _node(line)
            if isinstance(node, str):
                self.malformed(res, source, first_line + n, node)
                continue
            depth, samples, frame = node
            if depth > len(stack) + 1:
                self.malformed(res, source, first_line + n, "call graph line skips an indentation level")
                continue
            if depth <= len(stack):
                flush()  # the previous node had no children: a leaf
                del stack[depth - 1 :]
            stack.append(frame)
            count = samples
        if in_graph:
            flush()
            self.malformed(res, source, first_line + len(lines) - 1, "input ended inside the call graph")
        if not seen:
            self.malformed(res, source, first_line, "no 'Call graph:' section (not a macOS sample report)")
        return res


def _node(line: str) -> tuple[int, Weight, str] | str:
    """``(depth, samples, frame)`` of a call graph line (its first 4 spaces included), or why not."""
    body = line[4:]
    text = body.lstrip(_INDENT)
    indent = len(body) - len(text)
    if not text:
        return "call graph line with only indentation"
    if indent % 2:
        return "odd indentation in a call graph line"
    samples, sep, rest = text.partition(" ")
    if not sep or not rest.strip():
        return "call graph line without a function"
    if not (samples.isascii() and samples.isdigit() and len(samples) <= 19):
        return f"call graph line with an invalid sample count {samples[:40]!r}"
    func = rest.partition("(")[0].rstrip()
    module = ""
    before, found, tail = rest.rpartition("(in ")
    if found:
        module, closed, _ = tail.partition(")")
        if not closed:
            module = ""
        module = module.removesuffix(".dylib")
    func = demangle_rust_legacy(func)
    frame = f"{module}`{func}" if module else func
    return indent // 2 + 1, int(samples), sanitize_frame(frame)
