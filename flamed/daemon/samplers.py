"""Build the sampler named by ``[sampling] sampler`` from the config."""

from __future__ import annotations

from flamed.daemon.config import SamplingConfig
from flamed.errors import CapabilityError
from flamed.sampler import Sampler


def make_sampler(cfg: SamplingConfig) -> Sampler:
    if cfg.sampler == "fake":
        from flamed.daemon.fake import FakeSampler

        return FakeSampler(cfg.frequency)
    try:
        from flamed import bpfsampler
    except ImportError as e:
        raise CapabilityError(f"the BPF sampler cannot be loaded: {e}; is python3-bpfcc installed "
                              "(apt-get install python3-bpfcc) and flamed run by /usr/bin/python3?") from None
    return bpfsampler.from_config(cfg)  # type: ignore[attr-defined, no-any-return]


def bpf_program_text(cfg: SamplingConfig) -> str:
    """The BPF C program (with its -D defines) the daemon would load, for ``--print-bpf``."""
    from flamed import bpfsampler

    return bpfsampler.program_text_for_config(cfg)  # type: ignore[attr-defined, no-any-return]
