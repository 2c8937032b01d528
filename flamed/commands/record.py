"""``flamed record``: mixed-mode recording of one process tree, no daemon needed (see the class doc)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from flamed import outputs
from flamed.commands import record_daemon
from flamed.commands.base import Command
from flamed.commands._argtypes import PID_MAX, WEEK_S, duration, integer
from flamed.daemon.client import DEFAULT_SOCKET
from flamed.errors import CapabilityError, FlamedError, UsageError
from flamed.fileio import open_output, output_problem
from flamed.folded import read_folded
from flamed.model import EMPTY_STACK_FRAME, Profile, Sample, Stack, task_frame
from flamed.outputs.base import OutputOptions
from flamed.procstat import OFF_CPU_STATES, running, status_tgid, thread_states
from flamed.procstat import comm as process_comm
from flamed.pyspy.align import JoinOptions
from flamed.pyspy.mixed import MixedMode, MixedOptions
from flamed.pyspy.supervisor import MAX_RATE, PySpyOptions, find_pyspy
from flamed.pyspy.watcher import PyProcess, WatchOptions, unsupported_reason
from flamed.sampling import mappedfile, pysource
from flamed.commands.snapshot import root_spec
from flamed.sampling.cgroups import CgroupIdentity
from flamed.sampling.contract import SampleEvent, parse_root, root_frames

DRAIN_S = 0.5
#: What ``--mode`` can record (docs/offcpu.md).
MODES = ("cpu", "offcpu", "wall")
#: A Python frame, ``name (file:line)`` (``<string>`` for ``python -c``).
_PY_FRAME = re.compile(r" \(.*:\d+\)$")


class _ExitWait:
    """Sleeps between drains, ended early by the target's exit (a pidfd turns readable
    when the process exits), so that a command of 50 ms is not waited on for a drain's
    0.5 s.  Where pidfds are refused (pid gone, kernel older than 5.3), a plain sleep."""

    def __init__(self, pid: int) -> None:
        self.fd = -1
        with contextlib.suppress(OSError, AttributeError):
            self.fd = os.pidfd_open(pid)

    def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.fd < 0:
            time.sleep(seconds)
            return
        if select.select([self.fd], [], [], seconds)[0]:
            self.close()  # it exited: later waits (if the loop goes on) are plain sleeps

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RecordCommand(Command):
    """Record a Python (or any) process: Python, native and kernel frames in one profile.

    flamed record -p PID [-d SECONDS] [-r HZ] [-o FILE] [--format FORMAT]
    flamed record [options] -- COMMAND ARGS...

    Run as root with BPF, this is mixed mode: the BPF sampler takes every sample
    (native and kernel stacks) and, for CPython 3.8-3.13, reads the Python
    frames of the interrupted thread at the same instant; each output stack reads
    `python frames;native frames below the interpreter;kernel frames_[k]`.
    Interpreters the BPF program cannot read get py-spy (its frames joined by
    time), and --pyspy forces that for all.  Samples are weighted by the BPF
    sampler only.  Without BPF it falls back to py-spy alone (Python frames
    only) and says so.

    --mode says what the weights are: cpu (default) counts CPU samples; offcpu
    is the time threads spent off the CPU (blocked or preempted), under the
    stack they left it in, with a [off-cpu: blocked], [off-cpu: preempted] or
    [gil wait] (a Python thread waiting for the GIL) leaf; wall is where each
    thread's wall-clock time went: CPU samples as time (1/rate s each) plus
    its off-CPU time.  offcpu and wall weights are
    microseconds (folded output as bcc's offcputime -f writes it); they need
    BPF, and waits shorter than --min-block-us are not counted.  See
    docs/offcpu.md.

    When a daemon answers on its socket (the default path, or --socket), record
    goes through it: the command starts at once and the daemon's samples of it
    (at the daemon's rate, with its Python frames) come back over the socket;
    --since 60s with -p also takes the minute before.  -r, --mode offcpu|wall,
    --pyspy, --no-bpf, --timeline, --subprocesses or --no-daemon sample here
    instead.  See docs/daemon.md.

    With a COMMAND it runs it, stops when it exits and returns its exit code;
    --subprocesses also records every process it starts, each from its fork
    (the BPF sampler follows them; with --no-bpf, its Python descendants
    only, through py-spy), and what it leaves running when it exits (a
    daemon, `app &`) until that exits too (without it, record names that
    process: record it with -p).  Ctrl-C (or SIGTERM)
    writes what was recorded; the command gets SIGINT and 10 s to exit before
    it is killed (Ctrl-C again kills it at once).

    examples:
      flamed record -p 1234 -d 10 -o now.svg
      sudo flamed record -r 199 -o app.folded -- python app.py --port 8080
      flamed record --subprocesses --format folded -o - -- gunicorn app:wsgi
      sudo flamed record --mode wall -o wall.svg -- python service.py
      flamed record -p 1234 --since 60s -d 5 -o last.svg     # through the daemon
      sudo flamed record -o run.speedscope.json -- python job.py   # each thread's samples in time order
    """

    name = "record"
    order = 20
    _daemon_status: dict[str, Any] = {}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-p", "--pid", type=integer(1, PID_MAX, what="a process id"),
                            help="process to record (a process id, not the id of one of its threads)")
        parser.add_argument("-d", "--duration", type=duration(WEEK_S), default=None,
                            help="how long to record: seconds (10, 2.5) or 500ms, 30s, 5m, 1h, as --since (default: "
                                 "until the process exits or Ctrl-C); a command that runs "
                                 "longer gets its profile then, and record waits for its exit code")
        parser.add_argument("-r", "--rate", type=integer(1, 999, what="samples per second"), default=None,
                            help="BPF samples per second, 1..999 (default 99; giving it samples here, not "
                                 "through the daemon)")
        parser.add_argument("-o", "--output", default=None,
                            help="output file, '-' for stdout (a command's own standard output then goes to standard "
                                 "error); checked before recording starts (default: "
                                 "flamed-PID.<ext of the format> with -p, flamed-record.<ext> with a command)")
        parser.add_argument("-f", "--format", default=None,
                            help="output format: " + ", ".join(outputs.names())
                                 + " (default: by -o's extension, else folded); trace, chrometrace and "
                                   "speedscope get each sample at its time, per thread (--mode cpu, "
                                   "sampling here, not through the daemon)")
        parser.add_argument("--subprocesses", action="store_true",
                            help="also record the processes the command starts, from their fork (Python ones with "
                                 "their Python frames; with --no-bpf only those, through py-spy), and follow what "
                                 "it leaves running when it exits (a daemon) until that exits or -d ends")
        parser.add_argument("--mode", choices=MODES, default="cpu",
                            help="cpu: CPU samples (default); offcpu: time off the CPU, in microseconds; "
                                 "wall: CPU samples as time plus off-CPU time, in microseconds")
        parser.add_argument("--min-block-us", type=integer(0, 3_600_000_000, what="microseconds"), default=1000,
                            metavar="US",
                            help="offcpu/wall: shortest wait counted, in microseconds (default 1000)")
        parser.add_argument("--offcpu-every", type=integer(1, 1 << 22), default=1, metavar="N",
                            help="offcpu/wall: remember one switch off the CPU in N at random and count its wait "
                                 "N times, to cut the cost on threads switching >10k times/s (default 1: all)")
        parser.add_argument("--root", metavar="FRAMES", type=root_spec, default=None,
                            help="root frames, root first: none, comm, pid or tid, or a comma-separated list "
                                 "adding unit, container, cgroup, e.g. unit,pid (default: none; pid with "
                                 "--subprocesses)")
        parser.add_argument("--pyspy", nargs="?", const="", default=None, metavar="BINARY",
                            help="Python frames from py-spy (joined by time) instead of the BPF program's own "
                                 "reading, optionally with that py-spy binary")
        parser.add_argument("--pyspy-binary", default=None,
                            help="py-spy binary for interpreters BPF cannot read (default: next to python, else PATH)")
        parser.add_argument("--pyspy-rate", type=integer(1, MAX_RATE, what="samples per second"), default=100,
                            help=f"py-spy samples per second, 1..{MAX_RATE} (default 100)")
        parser.add_argument("--blocking", action="store_true",
                            help="let py-spy pause the target while it reads it (default: non-blocking)")
        parser.add_argument("--native", action="store_true", help="py-spy's own native frames (implies --blocking)")
        parser.add_argument("--no-idle", action="store_true",
                            help="py-spy skips idle threads (weakens the time alignment)")
        parser.add_argument("--no-refine", action="store_true",
                            help="place stack changes at the midpoint, without the signature likelihood")
        parser.add_argument("--no-clock-uprobe", action="store_true",
                            help="do not calibrate py-spy's clock by a uprobe (guess it from its start; for comparison)")
        parser.add_argument("--read-times", action="store_true",
                            help="time py-spy's samples by its process_vm_readv calls (a tracepoint that makes "
                                 "every syscall on the host take the traced path; for comparison)")
        parser.add_argument("--no-bpf", action="store_true", help="py-spy alone, even when BPF is available")
        parser.add_argument("--no-unwind", action="store_true",
                            help="frame-pointer user stacks instead of unwinding them from .eh_frame tables "
                                 "(tables are kept in $XDG_CACHE_HOME/flamed/unwind)")
        parser.add_argument("--timeline", metavar="FILE",
                            help="also write every sample of the profile with its time, as 'MONOTONIC_NS PID "
                                 "TID STACK' lines")
        parser.add_argument("--title", default=None, help="graph title for image formats")
        parser.add_argument("--socket", metavar="PATH", default=None,
                            help=f"record through the daemon on this control socket (default: {DEFAULT_SOCKET} "
                                 "when a daemon answers there)")
        parser.add_argument("--no-daemon", action="store_true",
                            help="sample here even when a daemon is running (compiles the BPF program: seconds)")
        parser.add_argument("--since", metavar="DURATION", type=duration(WEEK_S), default=None,
                            help="through the daemon: begin DURATION before now (e.g. 60s, 5m; up to a week), "
                                 "from its ring")
        parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... to run and record")

    def run(self, args: argparse.Namespace) -> int:
        cmd = list(args.command)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        if args.pid is not None and cmd:
            raise UsageError("give either -p PID or -- COMMAND ARGS..., not both")
        if args.pid is None and not cmd:
            raise UsageError("nothing to record: give -p PID or -- COMMAND ARGS...")
        if args.pid is not None:
            _check_target(args.pid)
        else:
            _check_command(cmd[0])
        # Numbers were checked as they were parsed (_argtypes); the outputs are
        # checked before anything is recorded, so an unwritable -o (or a format
        # that cannot hold what record writes) does not cost the whole recording.
        _check_format(args, outputs.choose(args.format, args.output))
        _check_writable(_output_path(args, outputs.choose(args.format, args.output)), "-o/--output")
        if args.timeline:
            _check_writable(args.timeline, "--timeline")
            if _same_destination(args.timeline, _output_path(args, outputs.choose(args.format, args.output))):
                raise UsageError(f"--timeline {args.timeline} is where the profile goes (-o): one would "
                                 "overwrite or mix into the other; give them different files")
        # -o - : the profile goes to standard output, so the command's own output does not.
        args.command_stdout = None
        if cmd and _is_stdout(_output_path(args, outputs.choose(args.format, args.output))):
            args.command_stdout = _stderr_fd()
            self.warn("the profile goes to standard output (-o -): the command's standard output goes to "
                      "standard error instead")
        # What the command leaves running when it exits (a daemon, `app &`) becomes
        # record's child, to be named, and followed by --subprocesses (Survivors).
        self._survivors: record_daemon.Survivors | None = record_daemon.Survivors() if cmd else None
        try:
            return self._record(args, cmd)
        finally:
            if self._survivors is not None:
                self._survivors.close()

    def _record(self, args: argparse.Namespace, cmd: list[str]) -> int:
        self._fmt = outputs.choose(args.format, args.output)
        if self._through_daemon(args, cmd):
            return self._via_daemon(args, cmd)
        if args.rate is None:
            args.rate = 99
        timed = args.mode != "cpu"
        if timed and (args.no_bpf or args.pyspy is not None):
            raise UsageError(f"--mode {args.mode} measures waits in BPF: it cannot go with --no-bpf or --pyspy")
        fmt = outputs.choose(args.format, args.output)
        policy = _policy(args)
        force_pyspy = policy == "pyspy"
        pyspy_bin = args.pyspy or args.pyspy_binary or None
        pyspy_opts = PySpyOptions(binary=pyspy_bin, rate=args.pyspy_rate, nonblocking=not args.blocking,
                                  idle=not args.no_idle, native=args.native,
                                  # one window for the whole recording: the trace arrives at the end
                                  window_s=(args.duration or 0) + 3600.0, max_children=32,
                                  # ... after a first short one, whose trace (taken while the target
                                  # surely runs) maps pthread ids to OS tids before Python 3.11
                                  first_window_s=1.0,
                                  # the user named these processes: no reason to wait
                                  min_age_s=0.0)
        if find_pyspy(pyspy_bin) is None and (force_pyspy or args.no_bpf):
            self.warn("py-spy not found: recording native and kernel stacks only")
        with _signals_interrupt():
            try:
                if not args.no_bpf:
                    self.warn("loading the BPF programs (compiling takes a second or two)")
                sampler, why = (None, "--no-bpf") if args.no_bpf else self._bpf_sampler(
                    args.rate, pysource.walker_wanted(policy), not args.no_unwind,
                    offcpu_min_us=args.min_block_us if timed else None, offcpu_every=args.offcpu_every,
                    timeline=args.timeline is not None or _timed_output(args, fmt),
                    follow_forks=args.subprocesses)
            except KeyboardInterrupt:
                return self._interrupted_before_sampling(
                    args, fmt, "the command was not started" if cmd else f"process {args.pid} was not sampled")
            if sampler is None and timed:
                raise CapabilityError(f"--mode {args.mode} needs the BPF sampler, which is unavailable: {why}")
            if sampler is None and _timed_output(args, fmt):
                if not fmt.writes_profiles:
                    raise CapabilityError(f"the {fmt.name} format needs each sample's time, which only the BPF "
                                          f"sampler gives; it is unavailable: {why}")
                self.warn(f"without the BPF sampler ({why}) there is no sample time: the {fmt.name} output is "
                          "the aggregated profile, not a timeline")
            if sampler is None:
                self.warn(f"BPF unavailable ({why}); recording Python stacks with py-spy alone")
                return self._pyspy_only(args, cmd, pyspy_opts, fmt)
            return self._mixed(args, cmd, sampler, pyspy_opts, fmt)

    # -- through the daemon -------------------------------------------------
    def _through_daemon(self, args: argparse.Namespace, cmd: list[str]) -> bool:
        """Record through a running daemon?  Yes when one answers (at --socket, or
        the default path) and nothing asked for sampling here."""
        local_only = [opt for opt, on in (("--no-daemon", args.no_daemon), ("-r", args.rate is not None),
                                          (f"--mode {args.mode}", args.mode != "cpu"),
                                          ("--pyspy", args.pyspy is not None), ("--no-bpf", args.no_bpf),
                                          ("--timeline", args.timeline is not None),
                                          ("--subprocesses", args.subprocesses),
                                          (f"the {self._fmt.name} format (a timeline of each sample)",
                                           _timed_output(args, self._fmt) and (
                                               not self._fmt.writes_profiles
                                               or (args.socket is None and args.since is None)))) if on]
        wanted = args.socket is not None or args.since is not None
        if local_only:
            if args.since is not None:
                raise UsageError(f"--since reads the daemon's ring: it cannot go with {local_only[0]}")
            if args.socket is not None:
                raise UsageError(f"--socket records through the daemon: it cannot go with {local_only[0]}")
            return False
        if args.since is not None and cmd:
            raise UsageError("--since goes with -p PID (a command started now has no past)")
        try:
            status = record_daemon.probe(args.socket or DEFAULT_SOCKET)
        except record_daemon.DaemonAbsent as e:
            if wanted:
                raise FlamedError(f"no daemon to record through ({e}); start it, or record without "
                                  "--socket/--since (as root)") from None
            return False
        self._daemon_status = status
        return True

    def _via_daemon(self, args: argparse.Namespace, cmd: list[str]) -> int:
        sock = args.socket or DEFAULT_SOCKET
        fmt = outputs.choose(args.format, args.output)
        st = self._daemon_status
        self.warn(f"recording through the daemon at {sock} ({st.get('frequency', '?')} Hz, its rate; -r or "
                  "--no-daemon samples here)")
        if fmt.wants_samples:
            # --socket or --since asked for the daemon, whose windows are summed.
            self.warn(f"the daemon's samples have no time each: the {fmt.name} output is the aggregated profile, "
                      "not a timeline (--no-daemon records one)")
        with _signals_interrupt():
            rec, rc, interrupted = record_daemon.record(
                sock, pid=args.pid, cmd=cmd, duration=args.duration, since_s=args.since or 0.0,
                root=args.root or "none", warn=self.warn, status=st, stdout=args.command_stdout)
        profile = rec.profile()
        if rec.start_ns is not None and args.since:
            asked = time.time_ns() - int(args.since * 1e9)
            if rec.start_ns > asked + 2_000_000_000:
                self.warn(f"the daemon's ring began {(rec.start_ns - asked) / 1e9:.0f} s after the --since asked: "
                          "older samples were no longer held")
        # The weights of the stacks with Python frames (each stack searched once).
        python_weights = [w for stack, w in rec.stacks.items() if any(_PY_FRAME.search(f) for f in stack)]
        if not rec.stacks:
            self.warn(f"nothing was recorded: {rec.nothing_reason()}")
        elif rec.child and not python_weights:
            # A wrapper that forks (sh -c without exec, timeout, unshare --fork): its own
            # samples came back, not those of the Python child it left the work to.
            self.warn(f"no Python frames were recorded, only samples of {rec.comm or 'process'} (pid {rec.target})"
                      + (rec.watch or record_daemon.TargetWatch(rec.target, child=rec.child)).child_hint(daemon=True))
        elif rec.watch is not None and rec.watch.unrecorded_children(daemon=True):
            self.warn(rec.watch.unrecorded_children(daemon=True))
        total = int(sum(rec.stacks.values()))
        named = int(sum(python_weights))
        python_on = bool((st.get("processors") or {}).get("python", {}).get("active"))
        if python_on and (named < 0.9 * total or not total):
            # CPython 2.7-3.7: the daemon's py-spy starts late, and a short run gets few or no Python frames.
            late = record_daemon.late_python_hint(rec.comm or "process", rec.target, rec.version,
                                                  st.get("drain_interval"), named, total)
            if late:
                self.warn(late)
        left = self._left_running(*([rec.running.pid] if rec.running is not None else []))
        if left and cmd:
            self.warn(record_daemon.survivors_hint(left, os.path.basename(cmd[0]), subprocesses=False, daemon=True))
        failed_rc, late_interrupts = self._write_or_wait(lambda: self._write(args, fmt, profile), rec.running, cmd)
        if failed_rc is not None:
            return failed_rc
        if rec.running is not None:
            rc = self._wait_command(rec.running, cmd, stop=bool(late_interrupts))
        if rec.broken:
            return rc if cmd and rc else 1
        if interrupted and not cmd:
            return 130
        # As without the daemon: nothing recorded is a failure (the command's own code when it failed).
        return (rc or 1) if not rec.stacks else rc

    # -- mixed mode ---------------------------------------------------------
    def _bpf_sampler(self, rate: int, python: bool, unwind: bool = True, *,
                     offcpu_min_us: int | None = None, offcpu_every: int = 1,
                     timeline: bool = False, follow_forks: bool = False) -> tuple[Any, str]:
        try:
            from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: PLC0415
            from flamed import cli  # noqa: PLC0415
            from flamed.sampling.bpfimage import runtime_only  # noqa: PLC0415
            from flamed.sampling.program import program_is_cached  # noqa: PLC0415
        except ImportError as e:
            return None, str(e)
        try:
            opts = BpfSamplerOptions(frequency=rate, pids=frozenset(), python=python, unwind=unwind,
                                     unwind_cache_dir=_cache_dir() if unwind else None,
                                     bpf_cache_dir=_cache_dir("bpf"),
                                     offcpu=offcpu_min_us is not None, offcpu_min_us=offcpu_min_us or 0,
                                     offcpu_every=offcpu_every, timeline=timeline, follow_forks=follow_forks)
            if cli.STANDALONE and program_is_cached(opts):
                # Compiled before: bcc without clang and LLVM (0.2 s and ~65 MB less)
                runtime_only()
            s = BpfSampler(opts)
        except FlamedError as e:
            return None, str(e).splitlines()[0]
        try:
            s.start()
        except FlamedError as e:
            s.close()
            return None, str(e).splitlines()[0]
        except BaseException:
            # Ctrl-C while compiling or attaching: what start() had begun (the
            # priming and unwinder threads, perf buffers) stops before the exit.
            s.close()
            raise
        return s, ""

    def _mixed(self, args: argparse.Namespace, cmd: list[str], sampler: Any, pyspy_opts: PySpyOptions,
               fmt: outputs.OutputFormat) -> int:
        child: subprocess.Popen[bytes] | None = None
        mixed: MixedMode | None = None
        samples: list[tuple[SampleEvent, Stack]] = []
        counts: dict[tuple[int, int, str, Stack], int] = {}
        self._identities: dict[int, CgroupIdentity] = {}  # tgid -> its cgroup's owner, for --root
        #: --subprocesses: (the command's pid, record's comm, the command's name), for
        #: the samples of the command between its fork and its exec.
        self._pre_exec: tuple[int, str, str] | None = None
        self._offcpu: dict[tuple[int, int, str, Stack], int] = {}  # ns, --mode offcpu/wall
        #: Stacks lost (Window.lost, Window.offcpu_lost) and samples taken, summed over the drains.
        self._lost: dict[str, int] = {}
        self._offcpu_lost: dict[str, int] = {}
        self._samples_taken = 0
        #: --timeline: the counted samples (those of processes whose Python frames are read
        #: in BPF, and native ones) with their times; ``samples`` holds py-spy's joined ones.
        self._timeline: list[tuple[SampleEvent, Stack]] = []
        rc = 0
        interrupted = False
        pythons: set[int] = set()
        target_exited = False
        #: Seconds from the start of sampling to the target's exit (when it exited meanwhile).
        exited_after = 0.0
        watch: record_daemon.TargetWatch | None = None
        #: What the command left running that --subprocesses follows (pid set).
        followed: set[int] = set()
        #: SIGINT/SIGTERM received while the sampler stopped (deferred, then acted on).
        late_interrupts: list[int] = []
        #: An error that ended the sampling loop (the profile is still written, then it is raised).
        failure: Exception | None = None
        timed = args.mode != "cpu"
        #: At the end, how the target's threads all waited ("" unless each one did; --mode offcpu/wall).
        waiting_since_before = ""
        #: The target's threads off the CPU when the recording ended (--mode offcpu/wall).
        waiting_now: list[int] = []
        target: int | None = None
        #: Sampling of the target began (its command started, or -p's process added).
        began = False
        t_sampling = time.monotonic()
        try:
            try:
                def found(p: PyProcess) -> None:
                    pythons.add(p.pid)
                    sampler.add_pid(p.pid)

                opts = MixedOptions(
                    pyspy=pyspy_opts,
                    watch=WatchOptions(pids=frozenset(), descendants=args.subprocesses,
                                       scan_interval_s=1.0, exclude_self=True, max_watched=32),
                    join=JoinOptions(refine=not args.no_refine),
                    clock=not args.no_clock_uprobe,
                    vm_readv=args.read_times,
                )
                # The sampler is compiled and attached before the command starts, so a
                # short command is recorded from its first samples; so is the py-spy
                # clock when py-spy is sure to run (else compiled when first needed).
                policy = _policy(args)
                mixed = MixedMode(sampler, opts, on_process=found, claim=pysource.claim_for(policy, sampler),
                                  pyspy_fallback=pysource.pyspy_fallback(policy))
                mixed.start(clock_now=policy == "pyspy" or sampler is None)
                target = args.pid
                if target is not None and not _alive(target):
                    # Compiling the BPF program takes seconds; the process did not wait.
                    raise FlamedError(f"process {target} exited before sampling began (while the BPF "
                                      "program compiled): nothing was recorded; record a longer-lived "
                                      "process, or run the command under flamed record -- COMMAND")
                if cmd:
                    # --subprocesses: the command is in the filter from its fork (record itself
                    # is not sampled), so a fast one (a shell) cannot start a child unfollowed
                    # before add_pid below.
                    adopt = bool(args.subprocesses)
                    if adopt:
                        sampler.follow_children_of(os.getpid())
                    try:
                        child = subprocess.Popen(cmd, stdout=args.command_stdout)
                    except OSError as e:
                        raise UsageError(f"cannot run {cmd[0]}: {e.strerror}") from None
                    finally:
                        if adopt:
                            sampler.follow_children_of(os.getpid(), False)
                    target = child.pid
                    if adopt:
                        # Sampled from its fork: until its exec it bears record's name.
                        self._pre_exec = (child.pid, process_comm(os.getpid()), os.path.basename(cmd[0])[:15])
                sampler.add_pid(target)
                t_sampling = time.monotonic()
                began = True
                # -d counts from here, when sampling began: the set-up below takes a
                # tenth of a second or more for a process of thousands of threads.
                deadline = t_sampling + args.duration if args.duration else None
                mixed.follow(target)
                watch = record_daemon.TargetWatch(target)
                exit_wait = _ExitWait(target)
                try:
                    while True:
                        watch.update(child)
                        if (child.poll() is not None) if child is not None else not _alive(target):
                            # The command exited (or -p's process): as through the daemon, an
                            # empty profile then says it exited, not that it stayed off the CPU.
                            if not target_exited:
                                target_exited = True
                                exited_after = time.monotonic() - t_sampling
                            # --subprocesses: what it left running (a daemon, `app &`) is
                            # followed until it exits too, or -d ends.
                            left = self._left_running() if args.subprocesses else []
                            if not left:
                                break
                            self._follow_survivors(mixed, left, followed, cmd)
                        if deadline is not None and time.monotonic() >= deadline:
                            break
                        step = min(DRAIN_S, max(0.0, deadline - time.monotonic())) if deadline else DRAIN_S
                        if target_exited:
                            time.sleep(step)  # --subprocesses: what the command left running
                        else:
                            exit_wait.wait(step)  # back at once when the target exits
                        if deadline is not None and time.monotonic() >= deadline:
                            break  # the last drain flips at once: the recording ends at -d
                        self._drain(sampler, mixed, samples, counts)
                except KeyboardInterrupt:
                    interrupted = True
                finally:
                    exit_wait.close()
                with self._interrupts_deferred() as late:
                    self._drain(sampler, mixed, samples, counts, last=True)
                late_interrupts += late
                if timed and target is not None:
                    states = thread_states(target)  # one read of /proc for both
                    waiting_since_before = _waiting(states)
                    if not target_exited:
                        waiting_now = [tid for tid, st in states.items() if st in OFF_CPU_STATES]
            except KeyboardInterrupt:
                # Ctrl-C before or between drains: still write what was recorded.
                interrupted = True
            except Exception as e:  # noqa: BLE001 - said below; what was recorded is still written
                if child is None and not samples and not counts:
                    raise
                failure = e
        finally:
            # A second Ctrl-C while the sampler and py-spy stop does not cut the stop short
            # (nor skip the profile): it is said, and the command is stopped at once after.
            with self._interrupts_deferred() as late:
                if mixed is not None:
                    samples.extend(mixed.close())
                sampler.close()
            late_interrupts += late
            if child is not None and failure is not None and child.poll() is None:
                # The recording failed while the command runs: it is stopped as by Ctrl-C
                # (SIGINT, then SIGKILL after the grace time), not waited for without end.
                self.warn(f"the recording failed ({_describe(failure)}): stopping the "
                          f"{os.path.basename(cmd[0])} command (pid {child.pid}); what was recorded is written")
                rc = self._finish_child(child, True)
                child = None
            elif child is not None and late_interrupts and child.poll() is None:
                # Ctrl-C again (after the first, or after -d ended): as while it is waited for.
                if interrupted:
                    child.kill()
                    child.wait()
                    rc = 128 + signal.SIGKILL
                else:
                    rc = self._finish_child(child, True)
                child = None
            # A command still running when -d ended is waited for once its profile is written.
            elif child is not None and (interrupted or child.poll() is not None or sys.exc_info()[0] is not None):
                rc = self._finish_child(child, interrupted)
                child = None
            interrupted = interrupted or bool(late_interrupts)
        if interrupted and not began and failure is None:
            said = self._interrupted_before_sampling(
                args, fmt, "the command was not started" if cmd and target is None else
                f"{'the command' if cmd else f'process {args.pid}'} was not sampled yet")
            return rc or said
        by_bpf = {pid for pid, (src, _) in mixed.decided.items() if src == "bpf"} if mixed is not None else set()
        by_pyspy = pythons - by_bpf
        if mixed is not None and by_bpf:
            total = sum(n for (tgid, _t, _c, _s), n in counts.items() if tgid in by_bpf)
            named = sum(n for (tgid, _t, _c, s), n in counts.items()
                        if tgid in by_bpf and any(_PY_FRAME.search(f) for f in s))
            self.warn(f"{total} samples of {len(by_bpf)} Python process(es) read in BPF, {named} with Python frames")
        if mixed is not None and mixed.clock_error:
            self.warn(f"py-spy clock uprobe unavailable ({mixed.clock_error}); alignment is approximate")
        if mixed is not None and by_pyspy:
            st = mixed.stats
            total = st.matched + st.unmatched
            calib = mixed.counters.get("runs_calibrated", 0)
            why = sorted({r for pid, (src, r) in mixed.decided.items() if pid in by_pyspy and src != "bpf"})
            self.warn(f"{total} Python samples by py-spy ({', '.join(why) or 'py-spy'}), {st.matched} with Python "
                      f"frames, {st.unmatched} without; {calib} py-spy run(s) calibrated by uprobe "
                      f"({mixed.counters.get('runs_read_times', 0)} with read times); "
                      f"py-spy failures: {_failures(mixed)}")
            waited = sum(n for (tgid, _t, _c, _s), n in self._offcpu.items() if tgid in by_pyspy)
            if waited and args.mode != "cpu":
                # py-spy's stacks are joined with CPU samples by time; the waits are
                # counted in BPF maps, without the times a join would need.
                self.warn(f"{waited / 1e9:.2f} s of waits of the process(es) read by py-spy have native and "
                          "kernel frames only: py-spy's Python frames are joined with CPU samples, not with "
                          "waits (docs/offcpu.md)")
            unmapped = mixed.thread_ids.counters["unmapped"]
            if unmapped:
                reasons = "; ".join(sorted(set(mixed.thread_ids.reasons.values())))
                self.warn(f"{unmapped} Python thread(s) not matched to an OS thread (their samples have no "
                          f"Python frames): {reasons}")
        if mixed is not None and not pythons:
            refused = sorted(mixed.watcher.stats.unsupported_versions)
            for ver in refused:
                self.warn(unsupported_reason(ver))
            if not refused:
                # A wrapper that forks (sh -c without exec, timeout, unshare --fork) left the
                # work to a child: say so here when the wrapper's own samples make a profile
                # (an empty one says it below, with the same hint).
                hint = (watch.child_hint(daemon=False) if watch is not None and not args.subprocesses and counts
                        else "")
                if mappedfile.refused:
                    # The interpreter may be one of them: "no Python" would be too sure.
                    hint += (f" (or none could be recognised: {len(mappedfile.refused)} mapped file(s) could not "
                             "be opened, as said above)")
                self.warn("no Python process was found: native and kernel stacks only" + hint)
        elif mixed is not None and mappedfile.refused:
            # Found as Python by its name, its interpreter file unreadable: the walker
            # cannot read it, nor can py-spy; the count ties the warnings above to the profile.
            self.warn(f"{len(mappedfile.refused)} mapped file(s) could not be opened, as said above: the frames "
                      "in them (symbols, unwinding, Python frames) are missing from this profile")
        if pythons and counts and watch is not None and not args.subprocesses:
            # A multiprocessing pool, a prefork server: the target's own profile
            # says nothing of the work its children did.
            if missed := watch.unrecorded_children(daemon=False):
                self.warn(missed)
        running = self._left_running(*([child.pid] if child is not None else []))
        left = [p for p in running if p not in followed]
        if left and cmd and target_exited:
            self.warn(record_daemon.survivors_hint(left, os.path.basename(cmd[0]),
                                                   subprocesses=args.subprocesses, daemon=False))
        elif followed and running:
            self.warn(f"{record_daemon.Survivors.describe(running)}, left running by the command, still runs: "
                      "the recording ended (-d or Ctrl-C); record does not stop it")
        profile = self._profile(args, samples, counts, sampler)
        if waiting_now and target is not None and profile.total():
            # A thread blocked all along, in a wait begun before the recording, is in no
            # sample and no wait: said, rather than left out of a wall-clock profile unsaid.
            seen = {tid for (tgid, tid, _c, _s) in [*counts, *self._offcpu] if tgid == target}
            seen |= {ev.tid for ev, _s in samples if ev.tgid == target}
            unseen = [t for t in waiting_now if t not in seen]
            if unseen:
                shown = ", ".join(map(str, unseen[:8])) + (", ..." if len(unseen) > 8 else "")
                main = " (its main thread among them)" if target in unseen else ""
                self.warn(f"{len(unseen)} thread(s) of pid {target} are not in the profile{main}: they waited all "
                          f"along, in waits begun before the recording (only waits that begin while recording are "
                          f"measured); tids {shown}; flamed dump -p {target} shows where they wait")

        def write() -> None:
            if _timed_output(args, fmt) and sampler is not None:
                self._write(args, fmt, profile, samples + self._timeline)
            else:
                self._write(args, fmt, profile)
            if args.timeline:
                self._write_timeline(args.timeline, samples + self._timeline)
            missing = sum(counts.values()) - len(self._timeline) if args.mode != "offcpu" else 0
            if missing > 0 and (args.timeline or _timed_output(args, fmt)):
                self.warn(f"{missing} of {sum(counts.values()) + len(samples)} samples are in the profile but not "
                          "in the timeline (the ring buffer of sample times was full)")

        failed_rc, late = self._write_or_wait(write, child, cmd)
        if failed_rc is not None:
            return failed_rc
        if failure is not None:
            raise FlamedError(f"the recording failed: {_describe(failure)} (what was recorded until then "
                              "is written)") from failure
        if interrupted and not cmd:
            return 130
        secs = time.monotonic() - t_sampling  # sampled (not the wait below)
        if child is not None:
            rc = self._wait_command(child, cmd, stop=bool(late))
        if not profile.total():
            what = f"process {args.pid}" if args.pid is not None else f"{cmd[0]} (pid {target})"
            if args.mode != "cpu" and waiting_since_before:
                # Off the CPU all along, in waits begun before the recording: never seen to begin.
                self.warn(f"nothing was recorded: every thread of {what} was {waiting_since_before} all along, in "
                          "waits that began before the recording (only waits that begin while recording are "
                          f"measured: docs/offcpu.md); flamed dump -p {target} shows where they wait now")
                return rc or 1
            if args.mode == "offcpu":
                self.warn(f"nothing was recorded: {what} did not wait {args.min_block_us} us or longer")
                return rc or 1
            hint = watch.child_hint(daemon=False) if watch is not None and not args.subprocesses else ""
            if target_exited:
                self.warn(f"nothing was recorded: {what} exited {exited_after:.1f} s after sampling began, "
                          f"before it was seen on a CPU{hint}")
            elif hint:
                self.warn(f"nothing was recorded: {what} was not on a CPU in the {secs:.1f} s sampled{hint}")
            else:
                self.warn(f"nothing was recorded: {what} was not on a CPU in the {secs:.1f} s sampled "
                          "(idle, or blocked); record it while it works")
            return rc or 1
        return rc

    def _follow_survivors(self, mixed: MixedMode, left: list[int], followed: set[int], cmd: list[str]) -> None:
        """--subprocesses, once the command exited: what it left running is followed
        (as its descendants are) until it exits or -d ends."""
        new = [p for p in left if p not in followed]
        if not new:
            return
        if not followed:
            self.warn(f"{os.path.basename(cmd[0])} exited, leaving {record_daemon.Survivors.describe(new)} running "
                      "(started in the background, or a daemon): following it until it exits or -d ends "
                      "(Ctrl-C stops the recording, not it)")
        for pid in new:
            followed.add(pid)
            mixed.follow(pid)

    def _drain(self, sampler: Any, mixed: MixedMode, samples: list[tuple[SampleEvent, Stack]],
               counts: dict[tuple[int, int, str, Stack], int], last: bool = False) -> None:
        # The last drain of an off-CPU recording counts the waits still open.
        offcpu = getattr(getattr(sampler, "options", None), "offcpu", False)
        w = sampler.drain(close_waits=True) if last and offcpu else sampler.drain()
        lost = self._lost
        for k, n in w.lost.items():
            lost[k] = lost.get(k, 0) + n
        for k, n in w.offcpu_lost.items():
            self._offcpu_lost[k] = self._offcpu_lost.get(k, 0) + n
        self._samples_taken += w.samples
        if last:
            self._warn_stack_losses()
        if last and offcpu:
            self._warn_offcpu_losses(sampler.stats().offcpu_total)
        self._identities.update(w.identities)
        for k, n in w.counts.items():
            counts[k] = counts.get(k, 0) + n
        off = self._offcpu
        for k, n in w.offcpu.items():
            off[k] = off.get(k, 0) + n
        samples.extend(mixed.process(w.events))
        self._timeline.extend(w.timeline)

    def _warn_stack_losses(self) -> None:
        """Say how many CPU samples and off-CPU waits kept a lost-stack placeholder
        (``[lost stack: EEXIST]``...) in place of a stack, and why, and how many
        samples were dropped (``map_full``)."""
        def said(counts: dict[str, int]) -> str:
            return ", ".join(f"{k}={n}" for k, n in sorted(counts.items()) if n)

        stacks = {k: n for k, n in self._lost.items() if n and "stack" in k}
        if stacks:
            self.warn(f"stacks lost in {sum(stacks.values())} of {self._samples_taken} CPU samples (counted under "
                      f"a [lost stack: ...] frame): {said(stacks)}")
        if self._lost.get("map_full"):
            self.warn(f"{self._lost['map_full']} CPU samples dropped: the count map was full")
        if self._lost.get("ringbuf_full"):
            self.warn(f"{self._lost['ringbuf_full']} CPU samples came without their time (the ring buffer was "
                      "full): counted, but not joined with py-spy's stacks or placed on the timeline")
        if any(self._offcpu_lost.values()):
            self.warn(f"stacks lost in {sum(self._offcpu_lost.values())} off-CPU waits (their time is counted under "
                      f"a [lost stack: ...] frame): {said(self._offcpu_lost)}")

    def _warn_offcpu_losses(self, st: dict[str, int]) -> None:
        """Say what off-CPU lost (docs/offcpu.md).  The maps' sizes are the daemon's
        [sampling] settings; record has fixed ones, so each loss is said by what filled."""
        why = {"OFF_START_FULL": "the map of open waits was full", "OFF_MAP_FULL": "the map of counted waits was full",
               "OFF_CARRY_FULL": "the map of waits carried across a drain was full",
               "CARRY_OVERFLOW": "more waits open across a drain than the map of open waits holds",
               "CARRY_MISSING": "", "CARRY_EXPIRED": ""}
        lost = {k: st.get(k, 0) for k in why if st.get(k, 0)}
        if lost:
            self.warn("off-CPU waits lost: " + ", ".join(
                f"{k.lower()}={n}" + (f" ({why[k]})" if why[k] else "") for k, n in sorted(lost.items())))
        if st.get("OFF_STALE", 0):
            self.warn(f"{st['OFF_STALE']} off-CPU wait(s) ended at an estimate: the kernel did not trace their "
                      "return to a CPU (docs/offcpu.md)")

    def _profile(self, args: argparse.Namespace, samples: list[tuple[SampleEvent, Stack]],
                 counts: dict[tuple[int, int, str, Stack], int], sampler: Any) -> Profile:
        kinds = parse_root(args.root or ("pid" if args.subprocesses else "none"))
        mode = getattr(args, "mode", "cpu")
        p = Profile(sample_rate=float(args.rate), labels={**_mode_labels(mode), "source": "flamed record"})
        identities = getattr(self, "_identities", {})
        pre_exec: tuple[int, str, str] | None = getattr(self, "_pre_exec", None)

        def key(tgid: int, tid: int, comm: str, stack: Stack) -> Stack:
            if pre_exec is not None and tgid == pre_exec[0] and comm == pre_exec[1]:
                comm = pre_exec[2]  # the command between its fork and its exec (--subprocesses)
            return root_frames(kinds, tgid, tid, comm, identities.get(tgid)) + stack

        # CPU samples weigh one each, or their share of CPU time in wall mode;
        # off-CPU nanoseconds are summed per stack before they become
        # microseconds, so rounding happens once per stack.
        per_sample = 1e6 / args.rate if mode == "wall" else 1.0
        weights: dict[Stack, float] = {}
        if mode != "offcpu":
            for (tgid, tid, comm, stack), n in counts.items():
                k = key(tgid, tid, comm, stack)
                weights[k] = weights.get(k, 0.0) + n * per_sample
            for ev, stack in samples:
                k = key(ev.tgid, ev.tid, ev.comm, stack)
                weights[k] = weights.get(k, 0.0) + per_sample
        if mode != "cpu":
            for (tgid, tid, comm, stack), ns in getattr(self, "_offcpu", {}).items():
                k = key(tgid, tid, comm, stack)
                weights[k] = weights.get(k, 0.0) + ns / 1000
        for k, w in weights.items():
            n = round(w)
            if n > 0:
                p.add(k, n)
        if samples:
            # ktime to wall clock, for the profile's time range
            off = time.time_ns() - time.monotonic_ns()
            p.start_ns = min(ev.ktime_ns for ev, _ in samples) + off
            p.end_ns = max(ev.ktime_ns for ev, _ in samples) + off
        return p

    def _write_timeline(self, path: str, samples: list[tuple[SampleEvent, Stack]]) -> None:
        """One line per sample: ``ktime tgid tid stack``, the stack named as in the
        profile (a sample with no frame at all is ``[no frames]`` in both)."""
        with open_output(path) as f:
            for ev, stack in sorted(samples, key=lambda s: (s[0].ktime_ns, s[0].tid)):
                frames = ";".join(stack) or EMPTY_STACK_FRAME
                f.write(f"{ev.ktime_ns} {ev.tgid} {ev.tid} {frames}\n".encode("utf-8", "surrogateescape"))

    # -- py-spy alone -----------------------------------------------------
    def _pyspy_only(self, args: argparse.Namespace, cmd: list[str], opts: PySpyOptions,
                    fmt: outputs.OutputFormat) -> int:
        binary = find_pyspy(opts.binary)
        if binary is None:
            raise CapabilityError("neither BPF nor py-spy is available: nothing can record; install py-spy "
                                  "(pip install py-spy) or run as root with bcc")
        child: subprocess.Popen[bytes] | None = None
        rc = 0
        interrupted = False
        with tempfile.TemporaryDirectory(prefix="flamed-record-") as tmp:
            out = os.path.join(tmp, "raw.txt")
            try:
                if cmd:
                    try:
                        child = subprocess.Popen(cmd, stdout=args.command_stdout)
                    except OSError as e:
                        raise UsageError(f"cannot run {cmd[0]}: {e.strerror}") from None
                target = child.pid if child is not None else args.pid
                pcmd = [binary, "record", "--pid", str(target), "--format", "raw", "--rate", str(opts.rate),
                        "--output", out]
                if opts.nonblocking and not opts.native:
                    pcmd.append("--nonblocking")
                if opts.native:
                    pcmd.append("--native")
                if args.subprocesses:
                    pcmd.append("--subprocesses")
                if args.duration:
                    pcmd += ["--duration", str(max(1, round(args.duration)))]
                spy = subprocess.Popen(pcmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       start_new_session=True)
                try:
                    while spy.poll() is None:
                        if child is not None and child.poll() is not None:
                            break
                        time.sleep(0.1)
                except KeyboardInterrupt:
                    interrupted = True
                # Ctrl-C again while py-spy writes its profile does not lose it (nor leave py-spy running).
                with self._interrupts_deferred() as late:
                    if spy.poll() is None:
                        spy.send_signal(signal.SIGINT)
                    try:
                        _, err = spy.communicate(timeout=30)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                        _, err = spy.communicate()
                interrupted = interrupted or bool(late)
            finally:
                if child is not None:
                    rc = self._finish_child(child, interrupted)
            if not os.path.exists(out):
                msg = (err or b"").decode(errors="replace").strip().splitlines()
                if not msg and child is not None:
                    # py-spy was stopped when the command exited, before it wrote or said anything.
                    raise CapabilityError(
                        f"py-spy recorded nothing: {cmd[0]} exited (code {rc}) before py-spy read a Python "
                        "stack of it: it is not Python, or ran too briefly; without BPF only Python stacks "
                        "are recorded (as root, BPF records native and kernel stacks of any program)")
                raise CapabilityError(f"py-spy recorded nothing: {msg[0] if msg else 'no output'}")
            with open(out, "rb") as f:
                profile = read_folded(f, source="py-spy")
        profile.sample_rate = float(opts.rate)
        profile.labels = {"unit": "samples", "source": "flamed record (py-spy only)"}
        self._write(args, fmt, profile)
        if interrupted and child is None:
            return 130
        return rc

    # -- shared -----------------------------------------------------------
    def _interrupted_before_sampling(self, args: argparse.Namespace, fmt: outputs.OutputFormat, what: str) -> int:
        """Ctrl-C while the BPF programs loaded: nothing was recorded, and nothing is
        written (an empty profile would replace the output of an earlier run there)."""
        path = _output_path(args, fmt)
        kept = "nothing was written" if _is_stdout(path) else (
            f"{path} was not written" + (" (the earlier file there is kept)" if os.path.exists(path) else ""))
        self.warn(f"interrupted while the BPF programs loaded: {what}; nothing was recorded, and {kept}")
        return 130

    def _finish_child(self, child: subprocess.Popen[bytes], interrupted: bool) -> int:
        return record_daemon.finish_child(child, interrupted, self.warn)

    def _left_running(self, *exclude: int) -> list[int]:
        """What the command left running when it exited (record's adopted children)."""
        s = getattr(self, "_survivors", None)
        return [p for p in s.running() if p not in exclude] if s is not None else []

    @contextlib.contextmanager
    def _interrupts_deferred(self) -> Iterator[list[int]]:
        """While record stops its sampler and py-spy and writes the profile (seconds at
        most: each step is bounded), Ctrl-C and SIGTERM do not cut that short, which
        left no profile (and, before, a traceback): they are said at once, counted in
        the list yielded, and acted on after (the command stopped)."""
        got: list[int] = []

        def handler(signum: int, frame: FrameType | None) -> None:
            if not got:
                # Not print(): the main thread may be inside a write to the same stream.
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    os.write(self.stderr.fileno(), f"flamed {self.name}: stopping: the sampler stops and the "
                             "profile is written first (a few seconds at most)\n".encode())
            got.append(signum)

        try:
            old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread
            yield got
            return
        try:
            yield got
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    def _write_or_wait(self, write: Callable[[], None], running: subprocess.Popen[bytes] | None,
                       cmd: list[str]) -> tuple[int | None, list[int]]:
        """``write()`` the profile with Ctrl-C deferred (the signals that came meanwhile are
        returned).  When it fails while a command that outlived -d still runs, the profile was
        saved elsewhere where it could be (as the error says) and the command is still waited
        for, not left behind: its exit code, else the error's, is returned first, else None."""
        try:
            with self._interrupts_deferred() as late:
                write()
        except FlamedError as e:
            if running is None:
                raise
            self.warn(f"error: {e}")
            rc = self._wait_command(running, cmd, stop=bool(late))
            return rc or e.exit_code, late
        return None, late

    def _wait_command(self, child: subprocess.Popen[bytes], cmd: list[str], *, stop: bool = False) -> int:
        """-d ended while the command runs on: its profile is written; its exit code
        is still record's, so it is waited for (Ctrl-C stops it, as while recording).
        ``stop``: Ctrl-C came while the profile was written: it is stopped now."""
        if stop:
            return self._finish_child(child, True)
        if child.poll() is None:
            self.warn(f"the {os.path.basename(cmd[0])} command (pid {child.pid}) still runs after the -d "
                      "recorded: waiting for it to exit, as record returns its exit code (Ctrl-C stops it)")
        try:
            return self._finish_child(child, False)
        except KeyboardInterrupt:
            return self._finish_child(child, True)

    def _write(self, args: argparse.Namespace, fmt: outputs.OutputFormat, profile: Profile,
               samples: list[tuple[SampleEvent, Stack]] | None = None) -> None:
        """The profile, or with ``samples`` (a format of timed samples: trace,
        chrometrace, speedscope) each sample at its time (wall clock), under a
        ``comm-PID/TID`` root frame, in time order."""
        path = _output_path(args, fmt)
        if samples is None:
            opts = OutputOptions(title=args.title, palette="mixed" if "mixed" in _palettes() else "hot")
            unit = "us" if profile.labels.get("unit") == "microseconds" else "samples"
            said = f"{int(profile.total())} {unit}, {len(profile)} stacks"
        else:
            opts = OutputOptions(title=args.title, extra={"sample_rate": str(args.rate)})
            said = f"{len(samples)} samples in time order, {len(profile)} stacks"
        try:
            with open_output(path) as out:
                if samples is None:
                    fmt.write(profile, out, opts)
                else:
                    off = time.time_ns() - time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
                    fmt.write_samples((Sample(ev.ktime_ns + off, (task_frame(ev.comm, ev.tgid, ev.tid), *stack), 1,
                                              ev.tgid, ev.tid)
                                       for ev, stack in sorted(samples, key=lambda s: (s[0].ktime_ns, s[0].tid))),
                                      out, opts)
        except FlamedError as e:
            # Checked writable before recording, failing now (a full disk, the
            # directory removed meanwhile): the recording is not thrown away.
            raise FlamedError(f"{e}; {_save_elsewhere(path, profile)}") from None
        if path != "-":
            self.warn(f"wrote {path} ({said})")


def _output_path(args: argparse.Namespace, fmt: outputs.OutputFormat) -> str:
    """Where the profile goes: -o, else flamed-PID.<ext> (-p) or flamed-record.<ext> (a command)."""
    if args.output is not None:
        return str(args.output)
    ext = fmt.extensions[0] if fmt.extensions else ".out"
    return f"flamed-{args.pid or 'record'}{ext}"


def _same_destination(a: str, b: str) -> bool:
    """Would writing ``a`` and ``b`` land in one file (or both on standard output)?
    A device other than standard output (/dev/null) may take both."""
    if _is_stdout(a) or _is_stdout(b):
        return _is_stdout(a) and _is_stdout(b)
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
    return os.path.samestat(sa, sb) and stat.S_ISREG(sa.st_mode)


def _is_stdout(path: str) -> bool:
    """Is ``path`` (-o) this process's standard output: ``-``, or a name of the same file
    (/dev/stdout, /dev/fd/1)?"""
    if path == "-":
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except OSError:
        return False


def _stderr_fd() -> int:
    """Standard error's descriptor, for a command's output; DEVNULL when it has none."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # None, or a stream without one (io.UnsupportedOperation)
        return subprocess.DEVNULL


def _check_target(pid: int) -> None:
    """-p names a live process (not a thread of one, not a zombie), or a usage error says what it is."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except FileNotFoundError:
        raise UsageError(f"no process {pid}") from None
    except OSError as e:
        raise UsageError(f"cannot read /proc/{pid}/status: {e.strerror or e}") from None
    tgid = status_tgid(status)
    if tgid is not None and tgid != pid:
        # /proc/TID exists for every thread, though not listed: its samples
        # would be looked for under a process id no task has.
        raise UsageError(f"{pid} is a thread of process {tgid}, not a process; give -p {tgid}")
    if not running(f"/proc/{pid}/stat"):
        raise UsageError(f"process {pid} has already exited (a zombie its parent has not reaped): "
                         "nothing to record")


def _timed_output(args: argparse.Namespace, fmt: outputs.OutputFormat) -> bool:
    """Does ``fmt`` get record's samples in time order (trace, chrometrace,
    speedscope: a per-thread timeline) rather than the aggregated profile?
    In CPU mode only: off-CPU and wall-clock weights are waits summed in BPF,
    without a time per sample."""
    return fmt.wants_samples and args.mode == "cpu"


def _check_format(args: argparse.Namespace, fmt: outputs.OutputFormat) -> None:
    """A usage error when ``fmt`` cannot write what record makes (trace: one line per
    timestamped sample, which --mode offcpu/wall do not have), before the command starts
    rather than once it has been recorded."""
    if fmt.writes_profiles or _timed_output(args, fmt):
        return
    chosen = f"-f/--format {fmt.name}" if args.format else f"-o/--output {args.output} (the {fmt.name} format)"
    raise UsageError(f"{chosen}: with --mode {args.mode} record writes waits summed per stack, which the "
                     f"{fmt.name} format cannot hold (it needs each sample's time, which --mode cpu has); write "
                     "folded or another format")


def _check_writable(path: str, option: str) -> None:
    """A usage error when ``path`` cannot be written (as :func:`flamed.fileio.open_output` will, at the end)."""
    problem = output_problem(path)
    if problem is not None:
        raise UsageError(f"{option} {path}: {problem}")


def _save_elsewhere(path: str, profile: Profile) -> str:
    """Write the profile as folded text to a new file of the temporary directory; say where, or that
    it is lost."""
    try:
        fd, tmp = tempfile.mkstemp(prefix="flamed-record-", suffix=".folded")
        with os.fdopen(fd, "wb") as f:
            outputs.get("folded").write(profile, f, OutputOptions())
    except (OSError, FlamedError) as e:
        return f"the recording is lost (it could not be saved elsewhere either: {e})"
    return f"the recording was saved as folded text to {tmp} instead of {path}"


def _mode_labels(mode: str) -> dict[str, str]:
    """The labels saying what a recording's weights are."""
    if mode == "cpu":
        return {"unit": "samples"}
    return {"unit": "microseconds", "kind": "off_cpu" if mode == "offcpu" else "wall"}


def _policy(args: argparse.Namespace) -> pysource.Policy:
    """Where Python frames come from: --pyspy forces py-spy for all."""
    return "pyspy" if args.pyspy is not None else "auto"


def _palettes() -> tuple[str, ...]:
    try:
        from flamed.palette import PALETTES  # noqa: PLC0415

        return tuple(PALETTES)
    except ImportError:
        return ()


def _failures(mixed: MixedMode) -> str:
    m = mixed.supervisor.metrics()
    bad = {k.removeprefix("failed_"): v for k, v in m.items() if k.startswith("failed_") and v}
    return ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "none"


def _check_command(name: str) -> None:
    """A COMMAND that cannot run fails before anything is loaded (the BPF
    program took seconds to compile before the same error came), with the
    exit status a shell, env or timeout gives it: 127 when it is not found,
    126 when it is found but cannot be run."""
    if os.sep in name:
        if not os.path.exists(name):
            raise FlamedError(f"cannot run {name}: No such file or directory", exit_code=127)
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            raise FlamedError(f"cannot run {name}: Permission denied", exit_code=126)
    elif shutil.which(name) is None:
        raise FlamedError(f"cannot run {name}: not found in PATH", exit_code=127)


def _describe(e: BaseException) -> str:
    """An error in a message: a FlamedError's own words, else its type and words."""
    return str(e) if isinstance(e, FlamedError) else f"{type(e).__name__}: {e}"


def _alive(pid: int) -> bool:
    return running(f"/proc/{pid}/stat")


def _waiting(states: dict[int, bytes]) -> str:
    """How every thread of a live process is off the CPU now ("stopped", "blocked"),
    by ``states`` (:func:`~flamed.procstat.thread_states`), or "" when one of them
    runs (or it is gone)."""
    if not states or any(s not in OFF_CPU_STATES for s in states.values()):
        return ""
    return "stopped" if all(s in (b"T", b"t") for s in states.values()) else "blocked"


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C: stop and write what was recorded."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (tests calling main() from a thread)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _cache_dir(what: str = "unwind") -> Path:
    """Where `record` keeps unwind tables (``unwind``) and compiled programs
    (``bpf``): $XDG_CACHE_HOME/flamed/WHAT (~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flamed" / what
