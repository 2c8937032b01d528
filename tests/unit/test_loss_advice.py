"""flamed/daemon/losses.py: the wording of loss messages and their rate limits (fake clock)."""

from __future__ import annotations

import logging

from flamed.daemon.losses import LossAdviceOptions, LossAdvisor, placeholder_stacks

SETTINGS = {"sampling.counts_map_size": 65536, "sampling.stack_map_size": 16384}
NONE = {"EEXIST": 0, "ENOMEM": 0}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def advisor() -> tuple[LossAdvisor, Clock]:
    c = Clock()
    return LossAdvisor(LossAdviceOptions(), clock=c), c


def test_placeholder_stacks_counts_either_side() -> None:
    stacks = [
        ("[lost stack: EEXIST]", "do_syscall_64_[k]"),          # user side lost
        ("main", "f", "[lost stack: EEXIST]_[k]"),               # kernel side lost
        ("[lost stack: ENOMEM]",),
        ("main", "f"),
        (),
        ("[lost stack: EEXIST]", "[lost stack: EEXIST]_[k]"),  # both: one stack
    ]
    assert placeholder_stacks(stacks) == {"EEXIST": 3, "ENOMEM": 1}


def test_a_few_collisions_are_information_without_advice() -> None:
    a, _ = advisor()
    # the idle host: 500 stacks in a 16,384-entry map, a handful of collisions
    out = a.advise(1900, {"user_stack_eexist": 7, "kernel_stack_eexist": 1}, {"EEXIST": 6, "ENOMEM": 0}, SETTINGS)
    assert len(out) == 1
    assert out[0].level == logging.INFO
    m = out[0].message
    assert "8 samples (0.4% of the last window's 1900 samples)" in m
    assert "hash collisions (EEXIST" in m and "6 '[lost stack: EEXIST]' stacks" in m
    assert "raise" not in m and "larger" not in m  # a bigger map does not cure them
    assert "16384" in m


def test_collisions_below_the_share_are_reported_once_an_hour() -> None:
    a, c = advisor()
    lost = {"user_stack_eexist": 3}
    assert len(a.advise(1000, lost, NONE, SETTINGS)) == 1
    for _ in range(59):  # every minute for the next hour: nothing
        c.t += 60.0
        assert a.advise(1000, lost, NONE, SETTINGS) == []
    c.t += 60.0
    assert len(a.advise(1000, lost, NONE, SETTINGS)) == 1


def test_collisions_above_the_share_warn_each_minute_and_say_what_lowers_them() -> None:
    a, c = advisor()
    lost = {"user_stack_eexist": 150}  # 15 % of the window
    out = a.advise(1000, lost, {"EEXIST": 120, "ENOMEM": 0}, SETTINGS)
    assert [x.level for x in out] == [logging.WARNING]
    m = out[0].message
    assert "150 samples (15.0% of the last window's 1000 samples)" in m and "120 '[lost stack: EEXIST]' stacks" in m
    assert "above 5%" in m and "larger sampling.stack_map_size (now 16384) makes them rarer" in m
    c.t += 30.0
    assert a.advise(1000, lost, NONE, SETTINGS) == []
    c.t += 30.0
    assert len(a.advise(1000, lost, NONE, SETTINGS)) == 1
    # and a low-share window in between is still reported on its own (hourly) schedule
    assert [x.level for x in a.advise(1000, {"user_stack_eexist": 1}, NONE, SETTINGS)] == [logging.INFO]


def test_a_full_stack_map_advises_raising_it() -> None:
    a, c = advisor()
    out = a.advise(2000, {"user_stack_enomem": 40, "kernel_stack_enomem": 10}, {"EEXIST": 0, "ENOMEM": 9},
                   SETTINGS)
    assert [x.level for x in out] == [logging.WARNING]
    m = out[0].message
    assert "the BPF stack map is full: 50 samples (2.5% of the last window's 2000 samples)" in m
    assert "9 '[lost stack: ENOMEM]' stacks" in m and "raise sampling.stack_map_size (now 16384)" in m
    c.t += 59.0
    assert a.advise(2000, {"user_stack_enomem": 1}, NONE, SETTINGS) == []
    c.t += 1.0
    assert len(a.advise(2000, {"user_stack_enomem": 1}, NONE, SETTINGS)) == 1


def test_a_full_count_map_advises_its_own_setting() -> None:
    a, _ = advisor()
    out = a.advise(1000, {"map_full": 100, "user_stack_enomem": 5, "user_stack_eexist": 2}, NONE, SETTINGS)
    msgs = [x.message for x in out]
    assert len(msgs) == 3
    assert "count map is full: 100 samples (10.0% of the last window's 1000) were dropped" in msgs[0]
    assert "raise sampling.counts_map_size (now 65536)" in msgs[0]
    assert "stack_map_size" in msgs[1] and "counts_map_size" not in msgs[1]
    assert out[2].level == logging.INFO


def test_nothing_lost_says_nothing() -> None:
    a, _ = advisor()
    assert a.advise(1000, {"map_full": 0, "user_stack_eexist": 0, "ringbuf_full": 3}, NONE, SETTINGS) == []


def test_one_collision_in_a_short_window_is_no_warning() -> None:
    # the last window at SIGTERM: 18 samples, one collided (5.6 %): no trend to warn about
    a, _ = advisor()
    out = a.advise(18, {"user_stack_eexist": 1}, {"EEXIST": 1, "ENOMEM": 0}, SETTINGS)
    assert [x.level for x in out] == [logging.INFO]
    assert "raise" not in out[0].message and "larger" not in out[0].message


def test_a_full_python_or_unwind_map_names_its_setting_once_a_minute() -> None:
    a, c = advisor()
    settings = {"sampling.python_stack_map_size": 16, "sampling.unwind_stack_map_size": 8192}
    out = a.advise_maps({"sampling.python_stack_map_size": 120}, 400, settings)
    assert len(out) == 1 and out[0].level == logging.WARNING
    assert "120 samples (30.0% of the last window's 400)" in out[0].message
    assert "lost their Python frames" in out[0].message
    assert "raise sampling.python_stack_map_size (now 16)" in out[0].message
    # the same map again within the minute: quiet; the other map: its own line
    out = a.advise_maps({"sampling.python_stack_map_size": 5, "sampling.unwind_stack_map_size": 3}, 400, settings)
    assert [m.message.split(" is full")[0] for m in out] == ["the BPF map of unwound native stacks"]
    assert "raise sampling.unwind_stack_map_size (now 8192)" in out[0].message
    c.t += 61
    assert len(a.advise_maps({"sampling.python_stack_map_size": 1}, 10, settings)) == 1
    assert a.advise_maps({}, 10, settings) == []


def test_with_off_cpu_recorded_waits_their_stack_losses_are_named_with_the_samples() -> None:
    # The off-CPU program takes its stacks from the same map; the stacks lost by
    # the waits it recorded are added to the samples' (the loop sums
    # Window.lost and Window.offcpu_lost): the line says so, and its
    # placeholders (in the off-CPU counts) are counted with the samples'.
    a, _ = advisor()
    cpu = [("main", "f"), ("main", "g")]
    off = [("[lost stack: EEXIST]", "schedule_[k]"), ("main", "[lost stack: EEXIST]_[k]")]
    stacks = placeholder_stacks(s for part in (cpu, off) for s in part)
    (line,) = a.advise(900, {"user_stack_eexist": 1, "kernel_stack_eexist": 1}, stacks, SETTINGS,
                       offcpu_waits=100)
    assert ("2 samples and off-CPU waits (0.2% of the last window's 900 samples and 100 off-CPU waits recorded)"
            in line.message)
    assert "show as 2 '[lost stack: EEXIST]' stacks" in line.message


def test_with_off_cpu_the_share_of_stack_losses_is_of_samples_and_recorded_waits() -> None:
    """Recorded waits took their stacks from the same map as the samples: 1674
    collisions among 394 samples and 8000 recorded waits are 19.9 %, not
    "424.9% of the last window's 394 samples"; and a share below the threshold
    is information, not a warning."""
    a, c = advisor()
    lost = {"user_stack_eexist": 1600, "kernel_stack_eexist": 74}
    (line,) = a.advise(394, lost, {"EEXIST": 138, "ENOMEM": 0}, SETTINGS, offcpu_waits=8000)
    assert line.level == logging.WARNING
    assert "(19.9% of the last window's 394 samples and 8000 off-CPU waits recorded)" in line.message, line.message
    assert "424.9%" not in line.message
    c.t += 4000
    (line,) = a.advise(394, {"user_stack_eexist": 100}, NONE, SETTINGS, offcpu_waits=8000)
    assert line.level == logging.INFO, line.message
    assert "(1.2% of the last window's 394 samples and 8000 off-CPU waits recorded)" in line.message, line.message
    enomem = a.advise(394, {"kernel_stack_enomem": 84}, NONE, SETTINGS, offcpu_waits=8000)
    assert "(1.0% of the last window's 394 samples and 8000 off-CPU waits recorded)" in enomem[0].message


def test_off_cpu_waits_per_window_come_from_the_sampler_totals() -> None:
    """SamplerAccounting gives the loop each drain's recorded waits (counted in
    the window, or carried to a later one), from the sampler's cumulative
    off-CPU counters, and none while off-CPU time is off.  Switches whose waits
    ended below the threshold recorded nothing and are not among them."""
    from flamed.daemon.metrics import DaemonMetrics  # noqa: PLC0415
    from flamed.daemon.sampler_stats import SamplerAccounting  # noqa: PLC0415
    from flamed.sampling.stats import SamplerStats  # noqa: PLC0415

    acc = SamplerAccounting(DaemonMetrics(process=False))
    st = SamplerStats()
    acc.take(st)
    assert acc.new_offcpu_waits is None
    st.offcpu_total.update(OFF_SWITCHES=5000, OFF_STARTS=4000, OFF_START_FULL=10, OFF_BELOW=3900,
                           OFF_COUNTED=90, OFF_CARRIED=5)
    acc.take(st.copy())
    assert acc.new_offcpu_waits == 95
    st.offcpu_total.update(OFF_SWITCHES=9000, OFF_STARTS=7000, OFF_START_FULL=10, OFF_BELOW=6800,
                           OFF_COUNTED=280, OFF_CARRIED=5)
    acc.take(st.copy())
    assert acc.new_offcpu_waits == 190


def test_stack_failures_of_short_waits_are_not_counted_as_lost() -> None:
    """With off-CPU time on, a window's CPU samples lost nothing while 3000
    switches off a CPU found their stack bucket taken (EEXIST) and 5 of the
    waits recorded lost their user stack: flamed_samples_lost_total stays at
    0, flamed_offcpu_stacks_lost_total{reason="user_stack_eexist"} says 5 and
    the switches' failures are named as such, not as lost samples."""
    from flamed.daemon.metrics import DaemonMetrics  # noqa: PLC0415
    from flamed.daemon.sampler_stats import SamplerAccounting  # noqa: PLC0415
    from flamed.sampling.stats import LOST_REASONS, SamplerStats  # noqa: PLC0415

    m = DaemonMetrics(process=False)
    acc = SamplerAccounting(m)
    st = SamplerStats()
    st.offcpu_total.update(OFF_SWITCHES=4000, OFF_STARTS=4000, OFF_BELOW=3900, OFF_COUNTED=100,
                           OFF_FETCH_EEXIST=3000, OFF_USTACK_EEXIST=5)
    acc.take(st.copy())
    m.observe_lost(dict.fromkeys(LOST_REASONS, 0))

    def value(name: str, labels: dict[str, str]) -> float:
        v = m.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    assert value("flamed_samples_lost_total", {"reason": "user_stack_eexist"}) == 0
    assert value("flamed_offcpu_stacks_lost_total", {"reason": "user_stack_eexist"}) == 5
    assert value("flamed_offcpu_stacks_lost_total", {"reason": "kernel_stack_eexist"}) == 0
    assert value("flamed_offcpu_switch_stack_failures_total", {"reason": "eexist"}) == 3000
    # cumulative totals advance the counters by what is new
    st.offcpu_total.update(OFF_FETCH_EEXIST=3500, OFF_USTACK_EEXIST=7)
    acc.take(st.copy())
    assert value("flamed_offcpu_stacks_lost_total", {"reason": "user_stack_eexist"}) == 7
    assert value("flamed_offcpu_switch_stack_failures_total", {"reason": "eexist"}) == 3500


def test_a_full_python_map_with_off_cpu_is_a_share_of_the_walks() -> None:
    """Off-CPU time on: the Python walker also runs at switches off the CPU, so its full
    map is a share of all its walks, never of the samples alone (1504 of 8 samples: 18800%)."""
    a, _ = advisor()
    settings = {"sampling.python_stack_map_size": 16, "sampling.unwind_stack_map_size": 8192}
    out = a.advise_maps({"sampling.python_stack_map_size": 1504, "sampling.unwind_stack_map_size": 2}, 8, settings,
                        walks={"sampling.python_stack_map_size": 1600})
    by_map = {x.message.split(" is full")[0]: x.message for x in out}
    assert ("1504 Python stack walks (94.0% of the last window's 1600, at samples and at switches off the CPU)"
            in by_map["the BPF map of Python stacks"])
    # the unwinder runs at samples only: a share of the samples, as before
    assert "2 samples (25.0% of the last window's 8)" in by_map["the BPF map of unwound native stacks"]
