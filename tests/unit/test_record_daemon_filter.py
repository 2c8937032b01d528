"""The daemon's [sampling] filter as ``flamed record`` through it reads it from
``status["filter"]`` (flamed/commands/record_daemon.py)."""

from __future__ import annotations

from flamed.commands.record_daemon import DaemonRecording, filter_excludes, filter_unchecked


def _status(**flt: list[object]) -> dict[str, object]:
    return {"filter": {"pids": [], "comms": [], "cgroups": [], "units": [], **flt}}


def test_a_comm_or_pid_the_filter_leaves_out_is_named() -> None:
    assert filter_excludes(_status(comms=["nginx"]), 42, "python3") == '[sampling] comms = ["nginx"]'
    assert filter_excludes(_status(comms=["nginx"]), 42, "nginx") == ""
    assert filter_excludes(_status(pids=[1, 2]), 42, "python3") == "[sampling] pids = [1, 2]"
    assert filter_excludes(_status(pids=[42]), 42, "python3") == ""
    assert filter_excludes(_status(), 42, "python3") == ""
    assert filter_excludes({}, 42, "python3") == ""  # an older daemon: nothing known


def test_cgroups_and_units_are_mentioned_not_judged() -> None:
    st = _status(units=["a.service"], cgroups=["/system.slice"])
    assert filter_excludes(st, 42, "python3") == ""
    assert filter_unchecked(st) == '[sampling] cgroups = ["/system.slice"] and [sampling] units = ["a.service"]'
    rec = DaemonRecording("/s", target=42, comm="python3", maybe_filtered=filter_unchecked(st))
    assert "may leave it out" in rec.nothing_reason() and "on no CPU" in rec.nothing_reason()
    rec = DaemonRecording("/s", target=42, comm="python3", filtered_out='[sampling] comms = ["nginx"]')
    assert rec.nothing_reason() == ('the daemon at /s samples only [sampling] comms = ["nginx"], which leaves out '
                                    "python3 (pid 42); --no-daemon records it here")
