"""JSON call tree, as d3-flame-graph reads it: ``{"name", "value", "children"}`` nested.

``value`` is the node's total weight (its own plus its children's), the
root is named ``root`` and holds the profile's total; children are sorted by
name so the output is byte-stable.  Written iteratively, so stacks of any
depth work (no recursion limit).  Non-ASCII and undecodable bytes are
``\\u`` escapes, so the file is plain ASCII JSON.  A profile of times
(off-CPU, wall) says the unit of its values in the root's ``"unit"``
(``"microseconds"``...); sample counts have none.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from flamed.model import Profile, Weight, format_weight, time_unit_ns
from flamed.outputs.base import OutputFormat, OutputOptions
from flamed.progress import counted, phase

# A node is [total weight, {child name: node}] (a list, mutated in place while summing).
Node = list[Any]


def build_tree(profile: Profile) -> Node:
    root: Node = [0, {}]
    for stack, w in counted(profile.stacks.items(), "building the tree", len(profile.stacks), "stacks"):
        node = root
        node[0] += w
        for frame in stack:
            children = node[1]
            child = children.get(frame)
            if child is None:
                child = children[frame] = [0, {}]
            child[0] += w
            node = child
    return root


def tree_unit(profile: Profile) -> str | None:
    """The unit of a profile of times (its ``unit`` label), else None (sample counts)."""
    return profile.labels.get("unit") if time_unit_ns(profile) is not None else None


def write_tree(root: Node, out: BinaryIO, *, name: str = "root", indent: bool = False,
               unit: str | None = None) -> None:
    """Serialise a tree from :func:`build_tree` without recursion; ``unit``
    (of a profile of times, :func:`tree_unit`) goes in the root object."""
    buf: list[str] = []
    nl = "\n" if indent else ""

    def head(n: str, v: Weight, depth: int) -> str:
        pad = " " * (2 * depth) if indent else ""
        extra = f',"unit":{json.dumps(unit)}' if unit is not None and depth == 0 else ""
        return f'{pad}{{"name":{json.dumps(n)},"value":{format_weight(v)}{extra},"children":['

    buf.append(head(name, root[0], 0))
    stack = [iter(sorted(root[1].items()))]
    first = [True]
    ph = phase("writing", None, "nodes")
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            first.pop()
            buf.append("]}")
            continue
        fname, node = item
        if not first[-1]:
            buf.append(",")
        first[-1] = False
        buf.append(nl + head(fname, node[0], len(stack)))
        if ph is not None:
            ph.step()
        stack.append(iter(sorted(node[1].items())))
        first.append(True)
        if len(buf) > 4096:
            out.write("".join(buf).encode("ascii"))
            buf.clear()
    buf.append("\n")
    out.write("".join(buf).encode("ascii"))


class JsonTreeFormat(OutputFormat):
    name = "json"
    extensions = (".json",)
    description = "JSON call tree {name, value, children} (d3-flame-graph)"

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        write_tree(build_tree(profile), out, unit=tree_unit(profile))
