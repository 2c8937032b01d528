"""The `flamed daemon` command."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from flamed.commands.base import Command
from flamed.errors import FlamedError

if TYPE_CHECKING:
    from flamed.daemon.core import Daemon


class DaemonCommand(Command):
    """Run the profiling daemon in the foreground (as systemd runs it).

    Samples every CPU with the BPF program, writes a folded file per rotation
    period under the state directory, serves Prometheus metrics and answers
    `flamed snapshot`/`status`/`flush` on the control socket.  SIGHUP reloads the
    config file, SIGTERM/SIGINT write the last window and exit.

    Examples:
      flamed daemon                                   # /etc/flamed/flamed.toml
      flamed daemon --config packaging/flamed.dev.toml
      flamed daemon --state-dir /tmp/prof --socket /tmp/flamed.sock --frequency 99
      flamed daemon --print-bpf                        # the BPF program it would load
    """

    name = "daemon"
    order = 80

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", metavar="FILE",
                            help="TOML config file (default /etc/flamed/flamed.toml, optional)")
        parser.add_argument("--state-dir", metavar="DIR", help="directory of the profile files (output.state_dir)")
        parser.add_argument("--socket", metavar="PATH", help="control socket path (control.socket)")
        parser.add_argument("--metrics-address", metavar="HOST:PORT",
                            help="Prometheus endpoint, '' to disable (metrics.address)")
        parser.add_argument("--frequency", metavar="HZ", type=int, help="samples per second per CPU (sampling.frequency)")
        parser.add_argument("--drain-interval", metavar="S", type=float,
                            help="seconds between drains (sampling.drain_interval)")
        parser.add_argument("--rotate-interval", metavar="S", type=float,
                            help="seconds per file (output.rotate_interval)")
        parser.add_argument("--sampler", choices=("bpf", "fake"), help="sampling.sampler (fake: synthetic stacks)")
        parser.add_argument("--print-bpf", action="store_true", help="print the BPF program that would load, and exit")
        parser.add_argument("--check-config", action="store_true", help="validate the config and exit")

    def run(self, args: argparse.Namespace) -> int:
        from flamed.daemon.config import load_config
        from flamed.daemon.logs import setup_logging

        overrides: dict[str, Any] = {
            "output.state_dir": args.state_dir,
            "control.socket": args.socket,
            "metrics.address": args.metrics_address,
            "sampling.frequency": args.frequency,
            "sampling.drain_interval": args.drain_interval,
            "output.rotate_interval": args.rotate_interval,
            "sampling.sampler": args.sampler,
        }
        overrides = {k: v for k, v in overrides.items() if v is not None}
        try:
            cfg = load_config(args.config, overrides=overrides)
        except FlamedError as e:
            if not (args.check_config or args.print_bpf):
                from flamed.daemon.notify import Notifier

                Notifier().notify(f"STATUS=failed: {e}")  # systemctl status shows why
            raise
        if args.check_config:
            from flamed.daemon.paths import check_directory, check_socket_path
            from flamed.daemon.samplers import check_config

            check_config(cfg)
            # The paths as start-up would use them, nothing created (under socket activation
            # systemd owns the socket, but the daemon run by hand binds control.socket).
            check_directory(cfg.output.state_dir, "output.state_dir")
            check_socket_path(cfg.control.socket)
            if cfg.pyroscope.server_address and cfg.pyroscope.basic_auth_password_file:
                from flamed.daemon.pyroscope import read_password

                read_password(cfg.pyroscope.basic_auth_password_file)  # as the start reads it
            print(f"{cfg.source or 'defaults'}: ok", file=self.stdout)
            return 0
        if args.print_bpf:
            from flamed.daemon.samplers import bpf_program_text

            from flamed.fileio import write_text

            write_text(self.stdout, bpf_program_text(cfg.sampling))
            return 0
        setup_logging(cfg.log.level, cfg.log.target)
        # bcc without clang and LLVM (~65 MB of RSS): every compile runs in a child process
        from flamed.sampling.bpfimage import runtime_only
        from flamed.sampling.memory import limit_arenas

        from flamed import cli

        if cli.STANDALONE:  # process-wide: not when another program calls the command
            runtime_only()
            limit_arenas()  # before the threads: their peaks would stay resident, each in its own arena
        from flamed.daemon.core import Daemon
        from flamed.daemon.notify import Notifier

        listen_fd = _activation_fd()
        # Under systemd nobody reads stdout; run by hand (make run), the next
        # thing the user wants is a client command that works as it is.
        by_hand = not _under_systemd()
        daemon = Daemon(cfg, config_path=args.config, overrides=overrides, listen_fd=listen_fd,
                        manage_logging=True, on_ready=self._print_clients if by_hand else None)
        daemon.install_signals()
        try:
            return daemon.run()
        except Exception as e:
            # Tell systemd why we did not come up; the CLI prints FlamedErrors.
            Notifier().notify(f"STATUS=failed: {e}")
            if not isinstance(e, FlamedError):
                logging.getLogger("flamed.daemon").exception("daemon failed")
            raise


    def _print_clients(self, daemon: Daemon) -> None:
        """The exact client commands for this daemon, with its real socket path and metrics port."""
        exe = _own_command()
        sock = shlex.quote(os.path.abspath(daemon.control.path or daemon.config.control.socket))
        lines = ["flamed daemon ready; in another terminal:",
                 f"  {exe} status --socket {sock}",
                 f"  {exe} snapshot --socket {sock} --seconds 30 --format svg -o now.svg",
                 f"  {exe} flush --socket {sock}"]
        bound = daemon.metrics_server.bound
        if bound:
            lines.append(f"  curl -s http://{bound}/metrics | grep ^flamed_")
        print("\n".join(lines), file=self.stdout, flush=True)


def _under_systemd() -> bool:
    # NOTIFY_SOCKET for Type=notify units, INVOCATION_ID for every unit systemd starts.
    return bool(os.environ.get("NOTIFY_SOCKET") or os.environ.get("INVOCATION_ID"))


def _own_command() -> str:
    """How this flamed was started, to be typed again: ``.venv/bin/flamed`` from a checkout."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "flamed" and os.path.exists(argv0):
        path = os.path.abspath(argv0)
        rel = os.path.relpath(path)
        # Relative to here when it is below here (what `make run` users type), else absolute.
        return shlex.quote(rel if not rel.startswith("..") else path)
    return f"{shlex.quote(sys.executable)} -m flamed"


def _activation_fd() -> int | None:
    """The listening socket systemd passed (flamed.socket), if any."""
    try:
        from systemd.daemon import listen_fds
    except ImportError:
        return None
    fds = listen_fds()  # checks LISTEN_PID and unsets the variables
    return fds[0] if fds else None
