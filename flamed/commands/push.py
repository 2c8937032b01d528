"""The `flamed push` command: send rotated files to Pyroscope (backfill)."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import os
import time
from typing import Any

from flamed.commands._argtypes import integer
from flamed.commands.base import Command
from flamed.daemon.config import DEFAULT_CONFIG_PATH, PyroscopeConfig, build_options, load_config
from flamed.daemon.pyroscope import PUSH_OFFCPU_SAMPLE_TYPE, PushError, Target, ingest_request, send
from flamed.errors import ConfigError, FlamedError, InputError, UsageError
from flamed.folded import read_folded
from flamed.model import Profile, is_task, parse_task_frame
from flamed.outputs.pprof import LabelledSample, to_proto, write_pprof

#: Retries per file when the server fails in a way a retry may cure (--retries).
RETRIES = 3
MAX_RETRIES = 10


class PushCommand(Command):
    """Send profile files the daemon wrote to a Pyroscope server (backfill after an outage).

    Each FILE (HOST-YYYYMMDDTHHMMSSZ.folded[.gz] with its .json sidecar) is one
    POST to SERVER/ingest, oldest first, with the time range, rate and host of
    its sidecar.  Settings not given come from the [pyroscope] table of
    --config (default /etc/flamed/flamed.toml, if present).

    Examples:
      flamed push --server http://pyroscope:4040 /var/lib/flamed/profiles/*.folded
      flamed push --server http://pyroscope:4040 --tag env=prod --format folded host-2024*.folded.gz
    """

    name = "push"
    order = 84

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("files", metavar="FILE", nargs="+", help="rotated profile files (.folded, .folded.gz)")
        parser.add_argument("--server", metavar="URL", help="Pyroscope base URL (default: pyroscope.server_address)")
        parser.add_argument("--config", metavar="FILE", help=f"read [pyroscope] from here (default {DEFAULT_CONFIG_PATH})")
        parser.add_argument("--application-name", metavar="NAME", help="name= before the tags")
        parser.add_argument("--tag", metavar="K=V", action="append", default=[], help="a tag (repeatable)")
        parser.add_argument("--format", choices=("pprof", "folded"), help="body format (default pprof)")
        parser.add_argument("--tenant-id", metavar="ID", help="sent as X-Scope-OrgID")
        parser.add_argument("--basic-auth-user", metavar="USER")
        parser.add_argument("--basic-auth-password-file", metavar="FILE")
        parser.add_argument("--timeout", metavar="S", type=float, help="seconds per request (default 10)")
        parser.add_argument("--retries", metavar="N", type=integer(0, MAX_RETRIES, what="a number of retries"), default=RETRIES,
                            help=f"retries of a file whose failure a retry may cure, 1, 2, 4... s apart "
                                 f"(default {RETRIES}, at most {MAX_RETRIES})")

    def run(self, args: argparse.Namespace) -> int:
        cfg = self._config(args)
        if not cfg.server_address:
            raise UsageError("no server: give --server URL (or set pyroscope.server_address in the config)")
        files = sorted((_read_file(f) for f in args.files), key=lambda e: e["start_ns"])
        failed = 0
        for i, e in enumerate(files):
            target = Target.from_config(cfg, e["host"])
            if e["kind"] == "offcpu":
                target = dataclasses.replace(target, format="pprof")  # off-CPU time goes as pprof only
            body = _body(target.format, e)
            req = ingest_request(target, start_ns=e["start_ns"], end_ns=e["end_ns"],
                                 sample_rate=e["sample_rate"], body=body, kind=e["kind"])
            unanswered = False
            for attempt in range(args.retries + 1):
                try:
                    send(target, req)
                except PushError as err:
                    if err.retry and attempt < args.retries:
                        time.sleep(2.0 ** attempt)
                        continue
                    self.warn(f"{e['path']}: {err}")
                    failed += 1
                    unanswered = not err.answered
                else:
                    print(f"{e['path']}: sent ({len(body)} bytes)", file=self.stdout)
                break
            if unanswered and i + 1 < len(files):
                # No answer through all the retries: the next files would wait as long for
                # the same failure each.  They are named by the count; run again later.
                rest = len(files) - i - 1
                self.warn(f"the server did not answer: {rest} later file(s) not tried (from {files[i + 1]['path']}); "
                          "run the same command again once it is back")
                failed += rest
                break
        if failed:
            self.warn(f"{failed} of {len(files)} files not sent")
            return 1
        return 0

    def _config(self, args: argparse.Namespace) -> PyroscopeConfig:
        base = load_config(args.config).pyroscope
        raw: dict[str, Any] = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        over = {"server_address": args.server, "application_name": args.application_name, "format": args.format,
                "tenant_id": args.tenant_id, "basic_auth_user": args.basic_auth_user,
                "basic_auth_password_file": args.basic_auth_password_file, "timeout": args.timeout}
        raw.update({k: v for k, v in over.items() if v is not None})
        tags = dict(raw["tags"])
        for t in args.tag:
            k, sep, v = t.partition("=")
            if not sep:
                raise UsageError(f"--tag {t!r}: expected KEY=VALUE")
            tags[k] = v
        raw["tags"] = tags
        try:
            return build_options(PyroscopeConfig, raw, "pyroscope")  # type: ignore[no-any-return]
        except ConfigError as e:
            raise UsageError(str(e)) from None


def _read_file(path: str) -> dict[str, Any]:
    stem = path[: -len(".folded.gz")] if path.endswith(".folded.gz") else path.removesuffix(".folded")
    if stem == path:
        raise InputError("not a rotated profile file (expected NAME.folded or NAME.folded.gz)", source=path)
    try:
        with open(stem + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"cannot read it or its sidecar {os.path.basename(stem)}.json: {e.strerror or e}; "
                         "push needs both (the sidecar holds the time range)", source=path) from None
    except ValueError as e:
        raise InputError(f"sidecar {stem}.json is not valid JSON: {e}", source=path) from None
    if path.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise InputError(f"corrupt gzip data: {e}", source=path) from None
    try:
        start, end = int(meta["start_ns"]), int(meta["end_ns"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"sidecar {stem}.json has no start_ns/end_ns", source=path) from None
    rate = meta.get("sample_rate")
    return {"path": path, "data": data, "start_ns": start, "end_ns": end,
            "sample_rate": float(rate) if isinstance(rate, (int, float)) else None,
            "host": str(meta.get("host") or "localhost"),
            "kind": "offcpu" if meta.get("kind") == "offcpu" else "cpu"}


def _body(fmt: str, e: dict[str, Any]) -> bytes:
    if fmt == "folded":
        return e["data"]  # type: ignore[no-any-return]
    try:
        prof = read_folded(io.BytesIO(e["data"]), source=e["path"])
    except FlamedError:
        raise
    offcpu = e["kind"] == "offcpu"
    p = Profile(start_ns=e["start_ns"], end_ns=e["end_ns"], sample_rate=None if offcpu else e["sample_rate"],
                labels={"host": e["host"], **({"unit": "microseconds", "kind": "off_cpu"} if offcpu
                                              else {"unit": "samples"})})
    samples: list[LabelledSample] = []
    for stack, w in prof.sorted_items():
        task = parse_task_frame(stack[0]) if stack else None
        labels = {"host": e["host"]}
        if task is not None and is_task(task):
            labels["comm"] = task.comm
            if task.pid is not None:
                labels["pid"] = str(task.pid)
            if task.tid is not None:
                labels["thread"] = str(task.tid)
        samples.append((stack, w, labels))
    if offcpu:
        # Microseconds of the file as nanoseconds, sample type named as the daemon pushes it.
        msg = to_proto(p, samples)
        for vt in msg.sample_type:
            msg.string_table[vt.type] = PUSH_OFFCPU_SAMPLE_TYPE
        return gzip.compress(msg.SerializeToString(deterministic=True), compresslevel=6, mtime=0)
    buf = io.BytesIO()
    write_pprof(p, buf, samples)
    return buf.getvalue()
