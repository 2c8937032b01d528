"""The `flamed status` command."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from flamed.commands.base import Command
from flamed.daemon.client import DEFAULT_SOCKET, request


class StatusCommand(Command):
    """Show the running daemon's state: sampling, files, losses, backlog.

    Examples:
      flamed status
      flamed status --json
      flamed status --socket ./var/flamed.sock
    """

    name = "status"
    order = 82

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--socket", metavar="PATH", default=DEFAULT_SOCKET, help=f"control socket (default {DEFAULT_SOCKET})")
        parser.add_argument("--json", action="store_true", help="print the raw status as JSON")

    def run(self, args: argparse.Namespace) -> int:
        head = request(args.socket, {"request": "status"}, timeout=10)
        st: dict[str, Any] = head["status"]
        if args.json:
            print(json.dumps(st, indent=2, sort_keys=True), file=self.stdout)
            return 0
        up = (time.time_ns() - int(st.get("started_ns") or 0)) / 1e9
        lost = st.get("lost") or {}
        files = st.get("files") or {}
        rows = [
            ("daemon", f"flamed {st.get('version')} pid {st.get('pid')}, up {up:.0f} s, config {st.get('config') or 'defaults'}"),
            ("sampling", f"{st.get('sampler')} at {st.get('frequency')} Hz, drain every {st.get('drain_interval')} s "
                         f"(last took {st.get('last_drain_seconds')} s)" + _late(st)),
            ("samples", f"{st.get('samples')} in {st.get('windows')} windows"),
            ("lost", ", ".join(f"{k}={v}" for k, v in sorted(lost.items()) if v) or "none"),
            ("files", f"{files.get('count')} files, {files.get('bytes')} bytes in {st.get('state_dir')}, "
                      f"new file every {st.get('rotate_interval')} s"),
            ("latest", str(files.get("latest") or "-")),
            ("backlog", f"{st['backlog']['files']} files, {st['backlog']['bytes']} bytes in memory"
                        + (f" -- write error: {st['write_error']}" if st.get("write_error") else "")),
            ("snapshots", f"{_ring_row(st['ring'])}, socket {st.get('socket')}"),
            ("metrics", f"http://{st['metrics']}/metrics" if st.get("metrics") else "off"),
            ("pprof", f"http://{st['metrics']}/debug/pprof/profile?seconds=N" if st.get("pprof") else "off"),
            ("off-cpu", _offcpu_row(st.get("offcpu"), st.get("metrics") if st.get("pprof") else None)),
            ("push", _push_row(st.get("push"))),
            ("unwind", _unwind_row(st.get("unwind"), bool(st.get("unwind_configured")) and not st.get("windows"))),
            ("start-up", _startup_row(st.get("startup"), st.get("program_from"))),
            ("memory", _memory_row(st.get("memory"))),
        ]
        reload_row = _reload_row(st.get("last_reload"))
        if reload_row:
            rows.insert(1, ("reload", reload_row))
        for name, p in sorted((st.get("processors") or {}).items()):
            rows.append((f"processor {name}", json.dumps(p, sort_keys=True)))
        width = max(len(r[0]) for r in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}", file=self.stdout)
        return 0


def _late(st: dict[str, Any]) -> str:
    """Said when the last drain is far older than the drain interval: the control socket
    answers from a thread of its own, so a main loop that hangs still looks alive here."""
    last = int(st.get("last_drain_ns") or 0)
    every = float(st.get("drain_interval") or 0)
    if not last or every <= 0:
        return ""
    age = (time.time_ns() - last) / 1e9
    if age <= 3 * every + 5:
        return ""
    return f" -- LATE: the last drain was {age:.0f} s ago (the main loop may be stuck; see the daemon's log)"


def _ring_row(ring: dict[str, Any]) -> str:
    """The windows snapshots can read, by kind: with off-CPU time on a drain adds one of each."""
    off = ring.get("offcpu_windows") or 0
    windows = f"{ring['windows']} CPU windows" + (f" and {off} off-CPU windows" if off else "")
    return f"{windows} ({ring['stacks']} stacks) in memory"


def _unwind_row(u: dict[str, Any] | None, pending: bool = False) -> str:
    """``pending``: unwinding is configured and nothing was drained yet (no window yet; the figures come with the first drain)."""
    if not u:
        return "on, no drain yet" if pending else "off (frame-pointer user stacks)"
    stacks = u["stacks"]
    total = sum(stacks.values())
    cut = ", ".join(f"{k}={v}" for k, v in stacks.items() if v and k != "complete") or "none cut"
    share = f"{100 * stacks['complete'] / total:.1f} % complete" if total else "no stack yet"
    row = (f"{share} ({cut}); {u['processes']} processes, {u['binaries']} binaries, "
           f"{u['rows']['used']}/{u['rows']['capacity']} rows")
    ev = u.get("evicted") or {}
    if ev.get("tables"):
        row += f", {ev['tables']} tables evicted ({ev['rows']} rows)"
    largest = u.get("largest") or []
    if largest:
        row += "; largest: " + ", ".join(f"{t['binary']} {t['rows']}" for t in largest[:3])
    return row


_PROGRAM_FROM = {"cache": "BPF program from the cache", "child": "BPF program compiled in a child",
                 "compiled": "BPF program compiled"}


def _startup_row(su: dict[str, float] | None, program_from: str | None = None) -> str:
    if not su:
        return "-"
    parts = [("state dir", "state_dir_s"), (_PROGRAM_FROM.get(program_from or "", "BPF program"), "sampler_program_s"),
             ("compile and verify", "sampler_compile_s"), ("attach", "sampler_attach_s"),
             ("sampler in all", "sampler_s"), ("processors", "processors_s"), ("servers", "servers_s")]
    shown = ", ".join(f"{name} {su[k]:.2f} s" for name, k in parts if k in su)
    return f"ready in {su.get('ready_s', 0.0):.2f} s ({shown})"


def _memory_row(mem: dict[str, int] | None) -> str:
    if not mem:
        return "-"

    def mb(k: str) -> str:
        return f"{mem.get(k, 0) / 2**20:.0f} MB"

    return (f"{mb('rss')} resident: {mb('anon')} anonymous (heap, caches), {mb('compiler')} LLVM/clang, "
            f"{mb('files')} other files; BPF maps {mb('bpf_maps')} (kernel)")


def _offcpu_row(off: dict[str, Any] | None, pprof: str | None) -> str:
    if not off or not off.get("enabled"):
        return "off ([sampling] off_cpu = false)"
    row = (f"{off['seconds']:.1f} s recorded (waits of {off['min_us']} us or more, one switch in {off['every']}); "
           f"latest {off.get('latest') or '-'}")
    if pprof:
        row += f"; http://{pprof}/debug/pprof/offcpu?seconds=N"
    return row


def _push_row(push: dict[str, Any] | None) -> str:
    if not push:
        return "off"
    row = (f"{push['server']}/ingest as {push['name']} ({push['format']}): {push['sent']} sent, "
           f"{push['failed']} failed, {push['dropped']} dropped, {push['queue']}/{push['max_queue']} queued")
    if push.get("last_error"):
        ago = (time.time_ns() - int(push.get("last_error_ns") or 0)) / 1e9
        row += f" -- last error {ago:.0f} s ago: {push['last_error']}"
    return row


def _reload_row(last: dict[str, Any] | None) -> str:
    """A refused last reload: the config file named above is not what runs.  "" otherwise."""
    if not last or last.get("result") != "error":
        return ""
    ago = (time.time_ns() - int(last.get("time_ns") or 0)) / 1e9
    return (f"last reload FAILED {ago:.0f} s ago, the configuration read before still runs "
            f"(the file is not what runs): {last.get('error')}")
