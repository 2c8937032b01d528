"""Command ``flamed serve``: a read-only local web viewer over profile files."""

from __future__ import annotations

import argparse

from flamed.commands._argtypes import integer, number
from flamed.commands.base import Command
from flamed.errors import UsageError
from flamed.loopback import is_loopback_address


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise UsageError(f"--address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080 (port 0 picks a free one)")
    return host.strip("[]") or "127.0.0.1", int(port)


class ServeCommand(Command):
    """Serve a web viewer: timeline, range flame graphs, top functions, compare.

    Reads the daemon's state directory (indexed from the sidecars, stacks read
    per range) or any files the toolkit reads (perf script and timestamped
    traces get a subsecond heatmap). Read-only, no network resources; listens
    on loopback unless --address says otherwise.

    examples:
      flamed serve --state-dir /var/lib/flamed/profiles
      flamed serve perf.script --address 127.0.0.1:8081
    """

    name = "serve"
    order = 80

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("files", nargs="*", help="profile files (any format the toolkit reads)")
        parser.add_argument("--state-dir", help="the daemon's state directory (output.state_dir)")
        parser.add_argument("--address", default="127.0.0.1:8080", help="HOST:PORT to listen on (default 127.0.0.1:8080)")
        # 0 (parse every range anew) to 1 TiB; nan and inf were a traceback.
        parser.add_argument("--timeout", type=number(0, 3600, what="seconds", above=True), default=30.0,
                            help="seconds a connection has to send its whole request, and then to take each "
                                 "64 KiB of its answer, before it is closed (default 30)")
        parser.add_argument("--max-connections", type=integer(1, 10000, what="a number of connections"), default=32,
                            help="connections served at once, a thread each; more are answered 503 at once "
                                 "(default 32)")
        parser.add_argument("--cache-mb", type=number(0, 1 << 20, what="a size in MB"), default=64.0,
                            help="memory for parsed files, MB (default 64; a range within it is not read again)")

    def run(self, args: argparse.Namespace) -> int:
        from flamed.serve.index import Index
        from flamed.serve.server import ServeServer

        if bool(args.state_dir) == bool(args.files):
            raise UsageError("give either --state-dir DIR or FILES..., not both and not neither")
        host, port = parse_address(args.address)
        cache = int(args.cache_mb * 1024 * 1024)
        index = (Index.from_state_dir(args.state_dir, cache) if args.state_dir
                 else Index.from_files(args.files, cache))
        if index.left_out:
            self.warn(f"left out, they carry no time while the other inputs do: {', '.join(index.left_out)}; "
                      "serve them on their own (flamed serve FILE) or compare with flamed diff")
        if index.skipped:
            skipped = sorted(index.skipped.items())
            more = f" (and {len(skipped) - 5} more; /api/index lists them)" if len(skipped) > 5 else ""
            self.warn("left out: " + "; ".join(f"{name}: {why}" for name, why in skipped[:5]) + more)
        if not index.entries:
            self.warn(f"nothing to show yet in {index.source}; the page updates when restarted")
        if not is_loopback_address(host):
            self.warn(f"WARNING: listening on {host}, not loopback: anyone who can reach this address reads "
                      "every profile served (function names, paths, pids), with no authentication")
        try:
            server = ServeServer((host, port), index, args.timeout, args.max_connections)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --address") from None
        shown = f"[{host}]" if ":" in host else host
        print(f"flamed serve: http://{shown}:{server.server_address[1]}/ ({index.kind}, {len(index.entries)} inputs)",
              file=self.stdout, flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return 0
