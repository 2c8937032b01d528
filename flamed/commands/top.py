"""Command ``flamed top``: the heaviest functions by self and total weight."""

from __future__ import annotations

import argparse
import csv

from flamed.commands.base import Command
from flamed.commands.collapse import add_input_arguments, run_collapse
from flamed.errors import UsageError
from flamed.fileio import open_output
from flamed.model import Weight, format_weight, printable, tidy_weight, time_kind
from flamed.top import function_stats, ranked


def _pct(w: Weight, total: Weight) -> str:
    return f"{100.0 * w / total:.2f}" if total else "0.00"


class TopCommand(Command):
    """List the heaviest functions by self and total weight.

    Self: weight of the stacks a function is the leaf of. Total: weight of
    the stacks it appears in, counted once per stack even when it recurses
    (so no total exceeds 100%). Reads everything 'flamed collapse' reads.

    examples:
      flamed top out.folded
      perf script | flamed top --sort total --limit 50
      flamed top --csv --limit 0 out.folded > functions.csv
    """

    name = "top"
    progress = True
    order = 40

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_input_arguments(parser)
        parser.add_argument("-o", "--output", help="output file (default stdout)")
        parser.add_argument("--sort", choices=("self", "total"), default="self", help="rank by (default self)")
        parser.add_argument("-n", "--limit", type=int, default=20, help="rows to show, 0 for all (default 20)")
        parser.add_argument("--csv", action="store_true", help="CSV (function,self,self_pct,total,total_pct) instead of a table")

    def run(self, args: argparse.Namespace) -> int:
        if args.limit < 0:
            # As diff's --limit: a typo ('-n -5' for '-n 5') must not list everything.
            raise UsageError("--limit must not be negative (0 shows every function)")
        profile = run_collapse(self, args).profile
        total = profile.total()
        rows = ranked(function_stats(profile), args.sort)
        if args.limit > 0:
            rows = rows[: args.limit]
        with open_output(args.output) as out:
            if args.csv:
                import io

                text = io.StringIO(newline="")
                w = csv.writer(text, lineterminator="\n")
                w.writerow(["function", "self", "self_pct", "total", "total_pct"])
                for r in rows:
                    w.writerow([r.name, format_weight(r.self_weight), _pct(r.self_weight, total), format_weight(r.total_weight), _pct(r.total_weight, total)])
                out.write(text.getvalue().encode("utf-8", "surrogateescape"))
                return 0
            sw = max([len("SELF")] + [len(format_weight(r.self_weight)) for r in rows])
            tw = max([len("TOTAL")] + [len(format_weight(r.total_weight)) for r in rows])
            lines = [f"{'SELF':>{sw}} {'SELF%':>7} {'TOTAL':>{tw}} {'TOTAL%':>7}  FUNCTION"]
            for r in rows:
                lines.append(
                    f"{format_weight(r.self_weight):>{sw}} {_pct(r.self_weight, total):>7} "
                    f"{format_weight(r.total_weight):>{tw}} {_pct(r.total_weight, total):>7}  {printable(r.name)}"
                )
            timed = time_kind(profile)
            unit = f" {timed[1]} of {timed[0]}" if timed is not None else ""
            lines.append(f"total weight {format_weight(tidy_weight(total))}{unit} in {len(profile.stacks)} distinct stacks")
            out.write(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
        return 0
