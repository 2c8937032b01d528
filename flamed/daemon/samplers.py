"""Build the sampler named by ``[sampling] sampler`` from the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flamed.daemon.config import SamplingConfig
from flamed.errors import CapabilityError, ConfigError
from flamed.sampling.contract import Sampler


def unwind_cache_dir(cfg: SamplingConfig, state_dir: str | None) -> Path | None:
    """``unwind_cache_dir`` (relative to the working directory); empty: none,
    tables are rebuilt at each start."""
    del state_dir  # the cache is the host's, not one daemon's
    return Path(cfg.unwind_cache_dir).absolute() if cfg.unwind_cache_dir else None


def bpf_options(cfg: SamplingConfig, state_dir: str | None = None) -> Any:
    """The :class:`flamed.sampling.bpf.BpfSamplerOptions` for ``[sampling]``."""
    from flamed.sampling.bpf import BpfSamplerOptions

    opts = BpfSamplerOptions(
        frequency=cfg.frequency,
        event=cfg.event,
        include_idle=cfg.include_idle,
        pids=frozenset(cfg.pids) if cfg.pids else None,
        comms=frozenset(cfg.comms) if cfg.comms else None,
        cgroups=frozenset(cfg.cgroups) if cfg.cgroups else None,
        units=frozenset(cfg.units) if cfg.units else None,
        # A unit may start after the daemon: wait for it rather than refuse to start.
        cgroups_missing_ok=True,
        stack_storage_size=cfg.stack_map_size,
        stack_depth=cfg.stack_depth,
        max_entries=cfg.counts_map_size,
        prime=cfg.prime_new_processes,
        prime_rate=cfg.prime_rate,
        new_code=cfg.reread_new_code,
        python=cfg.python_frames and cfg.prime_new_processes,
        python_depth=cfg.python_depth,
        python_stack_entries=cfg.python_stack_map_size,
        unwind=cfg.unwind and cfg.prime_new_processes,
        unwind_depth=cfg.unwind_depth,
        unwind_rows=cfg.unwind_rows,
        unwind_stack_entries=cfg.unwind_stack_map_size,
        unwind_maps=cfg.unwind_maps,
        unwind_cache_dir=unwind_cache_dir(cfg, state_dir),
        bpf_cache_dir=Path(cfg.bpf_cache_dir).absolute() if cfg.bpf_cache_dir else None,
        # LLVM's heap (tens of MB after a compile) never stays in the daemon
        bpf_compile_isolated=True,
        offcpu=cfg.off_cpu,
        offcpu_min_us=cfg.off_cpu_min_us,
        offcpu_every=cfg.off_cpu_every,
    )
    try:
        opts.validate()
    except ConfigError as e:
        raise ConfigError(f"[sampling]: {e}") from None
    return opts


def make_sampler(cfg: SamplingConfig, state_dir: str | None = None) -> Sampler:
    if cfg.sampler == "fake":
        from flamed.daemon.fake import FakeSampler

        return FakeSampler(cfg.frequency, offcpu=cfg.off_cpu)
    try:
        from flamed.sampling.bpf import BpfSampler
    except ImportError as e:
        raise CapabilityError(f"the BPF sampler cannot be loaded: {e}; is python3-bpfcc installed "
                              "(apt-get install python3-bpfcc) and flamed run by /usr/bin/python3?") from None
    return BpfSampler(bpf_options(cfg, state_dir))


def bpf_program_text(cfg: SamplingConfig) -> str:
    """The BPF C program (with its -D defines) the daemon would load, for ``--print-bpf``."""
    from flamed.sampling.bpf import bpf_program, task_fsbase_offset

    opts = bpf_options(cfg)
    return bpf_program(opts, fsbase_offset=task_fsbase_offset() if opts.python else -1).render()


def check_config(cfg: Any) -> None:
    """Everything the daemon checks before it compiles, for ``--check-config``:
    the sampler's options (``[sampling]``) and every ``[processors.NAME]`` table.
    Raises ConfigError naming the key."""
    from flamed.daemon.processors import processor_options  # noqa: PLC0415 - imports py-spy's helpers

    if cfg.sampling.sampler == "bpf":
        bpf_options(cfg.sampling)
    processor_options(cfg.processors)
