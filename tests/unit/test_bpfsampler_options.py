"""What the BPF sampler decides without loading anything: options, the
program's -D flags, header indices, placeholders (the loaded program is in
tests/integration/test_bpf_sampler.py)."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

import pytest

from flamed.sampling.bpf import BpfSampler, options_from_config
from flamed.sampling.drain import LOST_REASONS, STAT_TO_REASON, placeholder
from flamed.sampling.program import BpfSamplerOptions, bpf_program, online_cpus, stat_indices
from flamed.errors import ConfigError, FlamedError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency", 0),
        ("frequency", 1000),
        ("event", "instructions"),
        ("cpus", ()),
        ("stack_depth", 128),
        ("stack_storage_size", 0),
        ("max_entries", 0),
        ("ringbuf_pages", 3),
        ("comms", frozenset({"a-comm-longer-than-15"})),
        ("comms", frozenset({""})),
    ],
)
def test_bad_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"sampler option {field}="):
        BpfSampler(BpfSamplerOptions(**{field: value}))  # type: ignore[arg-type]


def test_defines_follow_the_options() -> None:
    prog = bpf_program(BpfSamplerOptions(include_idle=True, comms=frozenset({"x"}), stack_storage_size=99,
                                         stack_depth=20, max_entries=1234))
    flags = set(prog.cflags)
    assert {"-DFLAMED_INCLUDE_IDLE=1", "-DFLAMED_FILTER_COMMS=1", "-DFLAMED_FILTER_PIDS=0",
            "-DFLAMED_STACK_ENTRIES=99", "-DFLAMED_STACK_DEPTH=20", "-DFLAMED_MAX_ENTRIES=1234"} <= flags
    assert f"-I{prog.path.parent}" in flags
    # Every define the program reads is one the sampler sets (no string surgery,
    # no default silently used).
    used = set(__import__("re").findall(r"#ifndef (FLAMED_\w+)", prog.text))
    set_ = {f.split("=")[0][2:] for f in prog.cflags if f.startswith("-D")}
    assert used == set_
    text = prog.render()
    assert text.index(prog.header) < text.index(prog.text)


def test_header_indices_cover_every_lost_reason() -> None:
    idx = stat_indices(bpf_program().path.parent / "flamed.h")
    n = idx.pop("__N__")
    assert sorted(idx.values()) == list(range(n))
    reasons = {STAT_TO_REASON[k] for k in idx if k in STAT_TO_REASON}
    # Every BPF-side reason is reported; stack_read_failed is the user-space one.
    assert reasons | {"stack_read_failed"} == set(LOST_REASONS)


def test_placeholders() -> None:
    ph = placeholder
    assert ph(-errno.EFAULT, False) == () and ph(-errno.EFAULT, True) == ()
    assert ph(-errno.EEXIST, False) == ("[lost stack: EEXIST]",)
    assert ph(-errno.ENOMEM, True) == ("[lost stack: ENOMEM]_[k]",)
    assert ph(-errno.ENODATA, False) == ("[missing user stack]",)
    assert ph(-errno.ENODATA, True) == ("[missing kernel stack]_[k]",)


def test_online_cpus(tmp_path: Path) -> None:
    (tmp_path / "online").write_text("0-3,5,7-8\n")
    assert online_cpus(tmp_path) == [0, 1, 2, 3, 5, 7, 8]


def test_options_from_the_daemon_config() -> None:
    @dataclass(frozen=True)
    class Sampling:
        frequency: int = 99
        include_idle: bool = True
        pids: tuple[int, ...] = ()
        comms: tuple[str, ...] = ("nginx",)
        stack_map_size: int = 4096
        counts_map_size: int = 2048

    o = options_from_config(Sampling())
    assert (o.frequency, o.include_idle, o.pids, o.comms) == (99, True, None, frozenset({"nginx"}))
    assert (o.stack_storage_size, o.max_entries) == (4096, 2048)


def test_unstarted_sampler() -> None:
    s = BpfSampler()
    with pytest.raises(FlamedError, match="not started"):
        s.drain()
    with pytest.raises(FlamedError, match="pid filter is off"):
        s.add_pid(1)
    s.watch(5)  # remembered, applied at start
    assert s.watched == frozenset({5})
    s.close()
    s.close()


def test_priming_reads_are_rate_limited() -> None:
    """The token bucket: prime_rate reads at once, then prime_rate per second, the rest counted."""
    s = BpfSampler(BpfSamplerOptions(prime_rate=5))
    allowed = sum(s._processes._prime_token() for _ in range(20))
    assert allowed == 5
    assert s.stats().prime_throttled_total == 15
    s._processes._prime_refill -= 0.4  # as if 0.4 s had passed: 2 more
    assert sum(s._processes._prime_token() for _ in range(10)) == 2


def test_prime_rate_is_validated() -> None:
    from flamed.errors import ConfigError

    with pytest.raises(ConfigError, match="prime_rate"):
        BpfSamplerOptions(prime_rate=0).validate()


def test_a_map_the_kernel_refuses_is_named_with_the_setting_that_sizes_it() -> None:
    """bcc reports a map it could not create as a failed compile; flamed said
    "bcc could not compile ... (kernel headers from ...)", which sent the user
    to the headers.  What bcc printed for ``stack_map_size = 16777216`` (17 GB
    of stack traces) on the 24 GiB development VM:"""
    from flamed.sampling.program import map_refused

    bcc_said = ("the compiler process exited with 1:\n"
                "could not open bpf map: stacks0, error: Cannot allocate memory\n"
                "flamed: compile failed: Failed to compile BPF module <text>")
    msg = map_refused(bcc_said, BpfSamplerOptions(stack_storage_size=1 << 24))
    assert "stacks0 of 16777216 entries: Cannot allocate memory" in msg, msg
    assert "sampling.stack_map_size sizes it" in msg, msg
    assert "sampling.python_stack_map_size sizes it" in map_refused(
        "could not open bpf map: pystacks1, error: Operation not permitted", BpfSamplerOptions())
    # A map no setting sizes is still named; other failures are not taken for one.
    assert map_refused("could not open bpf map: seen, error: Invalid argument", BpfSamplerOptions()) == (
        "the kernel would not create the BPF map seen: Invalid argument")
    assert map_refused("error: use of undeclared identifier 'x'", BpfSamplerOptions()) == ""


def test_rereading_for_new_code_follows_the_daemon_config() -> None:
    from flamed.daemon.config import SamplingConfig
    from flamed.daemon.samplers import bpf_options

    assert bpf_options(SamplingConfig()).new_code is True
    assert bpf_options(SamplingConfig(reread_new_code=False)).new_code is False
