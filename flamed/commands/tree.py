"""Command ``flamed tree``: the call tree as JSON for d3-flame-graph."""

from __future__ import annotations

import argparse

from flamed.commands.base import Command
from flamed.commands.collapse import add_input_arguments, run_collapse
from flamed.fileio import open_output
from flamed.outputs.jsontree import build_tree, tree_unit, write_tree


class TreeCommand(Command):
    """Write the call tree as JSON: {"name", "value", "children"} nested.

    The format d3-flame-graph reads: 'value' is a node's total weight
    (itself plus its children), children are sorted by name, the root is
    named 'root' (or --root-name). Reads everything 'flamed collapse' reads.

    examples:
      flamed tree out.folded -o tree.json
      perf script | flamed tree --indent > tree.json
    """

    name = "tree"
    progress = True
    order = 41

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_input_arguments(parser)
        parser.add_argument("-o", "--output", help="output file (default stdout), written atomically")
        parser.add_argument("--root-name", default="root", help="name of the root node (default root)")
        parser.add_argument("--indent", action="store_true", help="one node per line, indented by depth")

    def run(self, args: argparse.Namespace) -> int:
        profile = run_collapse(self, args).profile
        with open_output(args.output) as out:
            write_tree(build_tree(profile), out, name=args.root_name, indent=args.indent, unit=tree_unit(profile))
        return 0
