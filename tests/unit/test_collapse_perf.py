"""perf script reader: headers, frames, the hostile fixture, events, -F variants."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest

from flamed.cli import main
from flamed.collapse import get
from flamed.collapse.base import CollapseOptions
from flamed.collapse.driver import collapse
from flamed.collapse.perf import _split_dso, parse_header
from flamed.errors import InputError
from flamed.folded import ReadStats
from flamed.model import EMPTY_STACK_FRAME, Profile
from support import DATA, golden

HOSTILE = DATA / "perf" / "hostile.txt"


def folded_of(tmp_path: Path, path: str, *args: str) -> tuple[str, str]:
    """Run ``flamed collapse`` through main(); the folded text and stderr."""
    out = tmp_path / "out.folded"
    err = io.StringIO()
    rc = main(["collapse", "--jobs", "1", path, *args, "-o", str(out)], stderr=err)
    assert rc == 0, err.getvalue()
    return out.read_bytes().decode("utf-8", "surrogateescape"), err.getvalue()


def prof(path: str, **kw: object) -> Profile:
    return collapse([path], options=CollapseOptions(**kw), jobs=1).profile  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        # default perf script: comm with a space and a trailing digit, tid only, cpu, time, period, event
        ("worker 0 10721 [001]   719.874582:    2004008 cpu-clock:ppp: ", ("worker 0", None, 10721, "cpu-clock:ppp", 2004008)),
        # -F comm,pid,tid,...
        ("worker 0 10719/10721   719.874582:    2004008 cpu-clock:ppp: ", ("worker 0", 10719, 10721, "cpu-clock:ppp", 2004008)),
        # tracepoint with trailing fields and no period
        (
            "hot  9991 [001]   625.344618: sched:sched_wakeup: comm=python3 pid=9910 prio=120 target_cpu=001",
            ("hot", None, 9991, "sched:sched_wakeup", 0),
        ),
        # no time field: the event anchors the task id
        ("a 1 2 3 cpu-clock:", ("a 1", None, 2, "cpu-clock", 3)),
        ("worker 0 10721 2004008 cpu-clock:", ("worker 0", None, 10721, "cpu-clock", 2004008)),
        # neither time nor event: -F comm,tid
        ("worker 0 10721", ("worker 0", None, 10721, "", 0)),
        ("worker 0 10721 [001]", ("worker 0", None, 10721, "", 0)),
        # an exited task, as perf prints it
        (":-1    -1 [000]  1264.315782:     500250 cpu-clock:ppp: ", (":-1", None, -1, "cpu-clock:ppp", 500250)),
        # a comm made only of digits and spaces
        ("1 2 3 4 [000] 1.5: 7 e:", ("1 2 3", None, 4, "e", 7)),
    ],
)
def test_header_fields(header: str, expected: tuple[object, ...]) -> None:
    h = parse_header(header)
    assert h is not None
    assert h[:5] == expected


def test_header_time_is_exact_ns() -> None:
    h = parse_header("x 1 [000] 719.874582: 1 e:")
    assert h is not None and h[6] == 719_874_582_000


@pytest.mark.parametrize("bad", ["", "   ", "justoneword", "no task id here: e:"])
def test_unparseable_headers(bad: str) -> None:
    assert parse_header(bad) is None


@pytest.mark.parametrize(
    ("rest", "sym", "dso"),
    [
        ("recurse+0x34 (/opt/hot)", "recurse+0x34", "/opt/hot"),
        ("lib_hot (/tmp/lib dir (x86)/libhot.so)", "lib_hot", "/tmp/lib dir (x86)/libhot.so"),
        ("f(int) const (/srv/a (b) c)", "f(int) const", "/srv/a (b) c"),
        ("no_dso_here", "no_dso_here", None),
        ("weird(", "weird(", None),
    ],
)
def test_dso_is_last_balanced_group(rest: str, sym: str, dso: str | None) -> None:
    assert _split_dso(rest) == (sym, dso)


def test_hostile_fixture_lines() -> None:
    p = prof(str(HOSTILE), include_tid=True)
    got = {";".join(k): v for k, v in p.stacks.items()}
    # Thread names keep their spaces and trailing digits; a ';' in a comm becomes ':'.
    assert got["worker 0-100/101;start_thread;worker;recurse"] == 1000
    assert got["worker 1-100/102;start_thread;worker;recurse"] == 1000
    # Symbols with parentheses, quotes, operator"", and ';' (replaced by ':'); DSO paths with spaces/parens.
    assert got[
        'job:2-100/103;quote\'s "name";operator""_spins(unsigned long long);'
        "(anonymous namespace)::helper(char const*);"
        "Box<std::vector<int, std::allocator<int> > >::work(unsigned long) const;"
        "<[u8: 32] as hot::Hot>::churn"
    ] == 1000
    # Kernel (kallsyms, modules, vmlinux) get _[k]; vdso does not; JIT maps get _[j];
    # [unknown] with a known DSO names the DSO.
    assert got[
        "hot-100/100;Interpreter_[j];[libfoo.so.1];[unknown];__vdso_clock_gettime;"
        "entry_SYSCALL_64_after_hwframe_[k];nf_hook_slow_[k];_raw_spin_unlock_irqrestore_[k]"
    ] == 1000
    assert got["kworker/1:1H-55/55;kthread_[k];worker_thread_[k]"] == 1000
    # Inlined frames get _[i]; srcline lines are not frames.
    assert got["hot-100/100;main;recurse;mix_[i]"] == 1000
    # A sample without frames is kept, visibly.
    assert got[f"idle thread 7-0/0;{EMPTY_STACK_FRAME}"] == 1000
    # Only the first event (cpu-clock:ppp) by default.
    assert sum(p.stacks.values()) == 8000


def test_hostile_fixture_golden(tmp_path: Path) -> None:
    out, err = folded_of(tmp_path, str(HOSTILE), "--tid")
    golden(DATA / "collapse" / "hostile-tid.folded", out.encode("utf-8", "surrogateescape"))
    assert "kept event 'cpu-clock:ppp'" in err
    assert "task-clock:ppp" in err and "sched:sched_switch" in err and "--event" in err


def test_event_selection() -> None:
    p = prof(str(HOSTILE), event="task-clock")
    assert {";".join(k): v for k, v in p.stacks.items()} == {"hot;recurse": 1000}
    # Tracepoint samples have no period: weight 1 each.
    p = prof(str(HOSTILE), event="sched:sched_switch")
    assert {";".join(k): v for k, v in p.stacks.items()} == {"hot;schedule_[k];__schedule_[k]": 1}
    with pytest.raises(InputError, match="no samples of event 'cycles'.*cpu-clock:ppp"):
        prof(str(HOSTILE), event="cycles")


def test_weight_samples_and_annotations_off() -> None:
    p = prof(str(HOSTILE), weight="samples", annotate=frozenset())
    assert sum(p.stacks.values()) == 8
    frames = {f for k in p.stacks for f in k}
    assert not any(f.endswith(("_[k]", "_[j]", "_[i]")) for f in frames)
    assert "mix" in frames and "kthread" in frames


def test_pid_without_pid_field_is_marked_unknown(tmp_path: Path) -> None:
    data = b"dd 42 [000] 1.000000: 1 cpu-clock: \n\t 1 main+0x1 (/bin/dd)\n\n"
    f = tmp_path / "perf-pid.txt"
    f.write_bytes(data)
    assert list(prof(str(f), include_pid=True).stacks) == [("dd-?", "main")]
    assert list(prof(str(f), include_tid=True).stacks) == [("dd-?/42", "main")]


def test_no_callchain_one_line_per_sample(tmp_path: Path) -> None:
    # perf record without -g: the frame is on the header line, no blank lines between samples.
    data = (
        b"hot 7 [000] 1.000001: 10 cpu-clock:  401136 recurse+0x4 (/bin/hot)\n"
        b"hot 7 [000] 1.000002: 10 cpu-clock:  401136 recurse+0x4 (/bin/hot)\n"
        b"worker 0 8 [001] 1.000003: 10 cpu-clock:  ffffffff81000130 do_syscall_64+0x76 ([kernel.kallsyms])\n"
    )
    f = tmp_path / "flat.txt"
    f.write_bytes(data)
    for chunk in (1024, 1 << 20):
        p = collapse([str(f)], jobs=1, chunk_bytes=chunk).profile
        assert {";".join(k): v for k, v in p.stacks.items()} == {"hot;recurse": 20, "worker 0;do_syscall_64_[k]": 10}


def test_malformed_header_counted_or_strict(tmp_path: Path) -> None:
    f = tmp_path / "bad.txt"
    f.write_bytes(b"dd 1 [000] 1.0: 1 e: \n\t 1 main (/bin/dd)\n\n???\n\t 1 x (/y)\n\n")
    res = collapse([str(f)], jobs=1)
    assert res.stats.skipped == 1 and ":4:" in res.stats.first_errors[0]
    with pytest.raises(InputError, match=r"bad.txt:4: unrecognised perf script header"):
        collapse([str(f)], jobs=1, options=CollapseOptions(strict=True))


def test_detect() -> None:
    perf = get("perf")
    assert perf.detect(HOSTILE.read_bytes()[:4096]) >= 90
    assert perf.detect(b"a;b;c 1\n") == 0


def test_parallel_ranges_equal_serial_with_errors_and_events(tmp_path: Path) -> None:
    # A regular file large enough for the by-range path of --jobs 3 (each process
    # reads its own range): stacks, event order, counts and the line numbers of
    # errors found in the later ranges must be those of --jobs 1.
    sample = b"dd 1 [000] 1.0: %d %s: \n\t 1 f%d (/bin/dd)\n\t 2 main (/bin/dd)\n\n"
    parts = []
    for i in range(3000):
        parts.append(sample % (i % 7 + 1, b"cycles" if i > 1500 else b"cpu-clock", i % 50))
        if i in (1700, 2900):
            parts.append(b"??? not a header\n\t 1 x (/y)\n\n")
    f = tmp_path / "big.txt"
    f.write_bytes(b"".join(parts))
    chunk = 4096
    assert f.stat().st_size > 2 * 3 * chunk
    serial = collapse([str(f)], jobs=1, chunk_bytes=chunk)
    par = collapse([str(f)], jobs=3, chunk_bytes=chunk)
    assert par.profile.stacks == serial.profile.stacks and sum(serial.profile.stacks.values()) > 0
    assert list(par.events.items()) == list(serial.events.items()) == [("cpu-clock", serial.events["cpu-clock"]), ("cycles", serial.events["cycles"])]
    assert par.stats.lines == serial.stats.lines and par.stats.records == serial.stats.records
    assert par.stats.skipped == serial.stats.skipped == 2
    assert par.stats.first_errors == serial.stats.first_errors
    assert ":6805:" in serial.stats.first_errors[0]


@pytest.mark.parametrize(
    ("prefix", "dropped"),
    [
        # A stray line that reads as a header without an event, before a real capture.
        (b"lost 12\n\n", 1),
        # Folded lines in front of a perf script: the first reads as an event-less header.
        (b"a;b;c 3\na;b 2\n", 2),
    ],
)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_event_less_sample_first_does_not_hide_the_real_event(
    tmp_path: Path, prefix: bytes, dropped: int, jobs: str
) -> None:
    """The event kept by default is the first *named* one; the event-less samples
    dropped for it are named on stderr with their weight."""
    real = gzip.decompress((DATA / "perf" / "c-default.txt.gz").read_bytes())
    plain = tmp_path / "plain.perf"
    plain.write_bytes(real)
    expected, err0 = folded_of(tmp_path, str(plain))
    assert err0 == ""
    path = tmp_path / "prefixed.perf"
    path.write_bytes(prefix + real)
    out = tmp_path / "out.folded"
    err = io.StringIO()
    assert main(["collapse", "--jobs", jobs, "--chunk-size", "4096", str(path), "-o", str(out)], stderr=err) == 0
    assert out.read_text() == expected
    assert (
        "kept event 'cpu-clock:ppp' (the first named in the input, weight "
        f"{sum(int(ln.rsplit(' ', 1)[1]) for ln in expected.splitlines()):,}); "
        f"also present: samples without an event field ({dropped}); choose one with --event"
    ) in err.getvalue()
    # --event '' keeps those samples instead.
    only, _ = folded_of(tmp_path, str(path), "--event", "")
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in only.splitlines()) == dropped


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_explicit_event_names_what_it_leaves_out(tmp_path: Path, jobs: str) -> None:
    """--event used to drop the samples of the other events without a word; now
    stderr names them with their count and weight, and the output is unchanged."""
    real = gzip.decompress((DATA / "perf" / "multi-event.txt.gz").read_bytes())  # cpu-clock, task-clock
    both = tmp_path / "both.perf"
    both.write_bytes(real)
    # The same capture without its cpu-clock samples: what --event task-clock must give.
    blocks = [b for b in real.split(b"\n\n") if b.strip()]
    only = tmp_path / "task-clock.perf"
    only.write_bytes(b"".join(b + b"\n\n" for b in blocks if b" task-clock: " in b.split(b"\n", 1)[0]))
    dropped = [b for b in blocks if b" cpu-clock: " in b.split(b"\n", 1)[0]]
    n_cpu = len(dropped)
    w_cpu = sum(int(b.split(b"\n", 1)[0].split()[-2]) for b in dropped)
    assert n_cpu > 100 and len(blocks) > n_cpu
    expected, err0 = folded_of(tmp_path, str(only))
    assert err0 == ""
    w_task = sum(int(ln.rsplit(" ", 1)[1]) for ln in expected.splitlines())
    out = tmp_path / "out.folded"
    err = io.StringIO()
    args = ["collapse", "--jobs", jobs, "--chunk-size", "4096", "--event", "task-clock", str(both), "-o", str(out)]
    assert main(args, stderr=err) == 0
    assert out.read_text() == expected
    assert err.getvalue() == (
        f"flamed collapse: kept event 'task-clock' (--event 'task-clock', weight {w_task:,}); left out "
        f"{n_cpu} samples of other events (weight {w_cpu:,}): cpu-clock ({n_cpu} samples, weight {w_cpu:,})\n"
    )


def test_explicit_event_on_lines_without_blank_lines_and_without_events(tmp_path: Path) -> None:
    # perf script without -g: one line per sample, no blank line between them (the
    # samples are split apart line by line), two events.
    flat = tmp_path / "flat.perf"
    flat.write_bytes(
        b"dd 7 [000] 1.000001:     100 cycles:  4010 f (/bin/dd)\n"
        b"dd 7 [000] 1.000002:       3 instructions:  4010 f (/bin/dd)\n"
        b"dd 7 [000] 1.000003:     100 cycles:  4020 g (/bin/dd)\n"
        b"dd 7 [000] 1.000004:       5 instructions:  4020 g (/bin/dd)\n"
        b"dd 7 [000] 1.000005:     100 cycles:  4020 g (/bin/dd)\n"
    )
    out, err = folded_of(tmp_path, str(flat), "--event", "cycles")
    assert out == "dd;f 100\ndd;g 200\n"
    assert "left out 2 samples of other events (weight 8): instructions (2 samples, weight 8)" in err
    # An --event that no sample has, on a capture without event fields: its samples are named.
    out, err = folded_of(tmp_path, str(DATA / "perf" / "fields-comm-tid-period.txt"), "--event", "cycles")
    assert out == ""
    assert "no samples of event 'cycles' (--event); left out 40 samples of other events" in err
    assert "samples without an event field (40 samples, weight " in err


def test_capture_without_event_fields_keeps_its_samples_quietly(tmp_path: Path) -> None:
    # perf script -F comm,tid,period,ip,sym: no sample names an event; all are kept.
    out, err = folded_of(tmp_path, str(DATA / "perf" / "fields-comm-tid-period.txt"))
    assert out and "kept event" not in err


# Two samples of a real perf script -g capture (frames: a tab, then the IP in 16 columns).
_REAL_G = (
    b"worker 0 11168 [001]   777.809456:    2004008 cpu-clock:ppp: \n"
    b"\t            1384 recurse+0x34 (/tmp/flamed-capture/hot)\n"
    b"\t            14bb worker+0x2b (/tmp/flamed-capture/hot)\n"
    b"\t           891f5 start_thread+0x305 (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
    b"\n"
    b"hot 11166 [000]   777.810739:    2004008 cpu-clock:ppp: \n"
    b"\tffffffff8226e079 _raw_spin_unlock_irqrestore+0x19 ([kernel.kallsyms])\n"
    b"\tffffffff813b4324 wake_up_new_task+0x1e4 ([kernel.kallsyms])\n"
    b"\tffffffff8135f779 kernel_clone+0x109 ([kernel.kallsyms])\n"
    b"\n"
)
_REAL_G_FOLDED = {
    "worker 0;start_thread;worker;recurse": 2004008,
    "hot;kernel_clone_[k];wake_up_new_task_[k];_raw_spin_unlock_irqrestore_[k]": 2004008,
}


@pytest.mark.parametrize(
    "junk",
    [
        b"\tsome text 42",  # ends in a number: read as a header without -g before
        b"\tsome text 42 [001]   777.809457:    2004008 cpu-clock:ppp: ",  # even a whole header, tab-indented
        b"    some text 42",  # space-indented, after a frame line
        b"  worker 0 11168   777.809460: ",
    ],
)
def test_junk_line_inside_a_stack_keeps_the_stack_whole(tmp_path: Path, junk: bytes) -> None:
    """An indented line after a frame line is never another sample's header: the stack
    is kept whole and the line is counted malformed (an error under --strict)."""
    lines = _REAL_G.split(b"\n")
    lines.insert(2, junk)  # between the first sample's leaf and its caller
    lines.insert(8, junk)  # and in the second sample
    path = tmp_path / "junk.perf"
    path.write_bytes(b"\n".join(lines))
    out, err = folded_of(tmp_path, str(path))
    assert dict((ln.rsplit(" ", 1)[0], int(ln.rsplit(" ", 1)[1])) for ln in out.splitlines()) == _REAL_G_FOLDED
    assert f"skipped 2 malformed lines (first: {path}:3: unreadable perf script frame line)" in err
    with pytest.raises(InputError, match=":3: unreadable perf script frame line"):
        collapse([str(path)], options=CollapseOptions(strict=True), jobs=1)
    # The timestamped reader (flamed merge) splits samples the same way.
    stats = ReadStats()
    with open(path, "rb") as f:
        samples = list(get("perf").samples(f, CollapseOptions(), source=str(path), stats=stats))
    assert sorted(";".join(s.stack) for s in samples) == sorted(_REAL_G_FOLDED)
    assert stats.skipped == 2


@pytest.mark.parametrize(
    ("name", "root", "period"),
    [
        # perf script -F comm,tid,period,ip,sym,dso
        ("hex-comm-nog-notime.txt", "deadbeef-?", 250000),
        # perf script -F comm,pid,tid,event,ip,sym (no period: weight 1; no DSO)
        ("hex-comm-nog-notime-nodso.txt", "deadbeef-23073", 1),
    ],
)
def test_no_g_no_time_capture_of_a_command_named_in_hex_digits(
    tmp_path: Path, name: str, root: str, period: int
) -> None:
    """A real capture without -g nor a time field of `perf record -- deadbeef`
    (dd copied under that name): each line is a sample, its command padded with
    spaces to 16 columns, and "        deadbeef 23073 ..." also reads as an
    indented "IP SYMBOL" frame line. It was read as one sample whose frames were
    all the other lines (or, without DSOs, as no known format at all)."""
    path = DATA / "collapse_extra" / name
    lines = path.read_bytes().splitlines()
    assert len(lines) > 50 and all(ln.startswith(b"        deadbeef ") for ln in lines)
    out, err = folded_of(tmp_path, str(path), "--pid")  # the format found by detection
    assert err == ""
    got = {ln.rsplit(" ", 1)[0]: int(ln.rsplit(" ", 1)[1]) for ln in out.splitlines()}
    assert {k.split(";")[0] for k in got} == {root}
    assert all(k.count(";") == 1 for k in got)  # one frame per sample: the one on its line
    assert sum(got.values()) == len(lines) * period
    leaf = lines[0].split()[-2 if lines[0].endswith(b")") else -1].decode()
    assert any(k.endswith(";" + leaf) for k in got), (leaf, got)
    # The same capture with a command that is not hex digits gives the same profile.
    renamed = tmp_path / "renamed.txt"
    renamed.write_bytes(path.read_bytes().replace(b" deadbeef ", b" zzzzzzzz "))
    out2, err2 = folded_of(tmp_path, str(renamed), "--pid")
    assert (out2.replace("zzzzzzzz", "deadbeef"), err2) == (out, "")
    # The timestamped reader (flamed merge) splits them the same way: each is a sample
    # without a time field, so each is counted malformed (it counted one).
    stats = ReadStats()
    with open(path, "rb") as f:
        assert list(get("perf").samples(f, CollapseOptions(), source=str(path), stats=stats)) == []
    assert stats.skipped == len(lines)


def test_no_g_capture_of_a_command_named_in_hex_digits(tmp_path: Path) -> None:
    # perf script of a real `perf record -- dd ...` (no -g): the comm "dd" padded to
    # 16 columns reads as "IP SYMBOL" too; every line is a sample.
    data = (
        b"              dd 10061 32579.823429:     250000 cpu-clock:pppH:      7fbd4655aa14 "
        b"__GI___tunables_init+0xa4 (/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2)\n"
        b"              dd 10061 32579.823934:     250000 cpu-clock:pppH:  ffffffff81416bce "
        b"rcu_core+0x12e ([kernel.kallsyms])\n"
        b"              dd 10061 32579.824442:     250000 cpu-clock:pppH:  ffffffff82237486 "
        b"copy_mc_enhanced_fast_string+0x6 ([kernel.kallsyms])\n"
        b"              dd 10061 32579.824688:     250000 cpu-clock:pppH:  ffffffff813937a0 "
        b"rcu_core+0x12e ([kernel.kallsyms])\n"
    )
    path = tmp_path / "dd.perf"
    path.write_bytes(data)
    out, err = folded_of(tmp_path, str(path))
    assert out.splitlines() == [
        "dd;__GI___tunables_init 250000",
        "dd;copy_mc_enhanced_fast_string_[k] 250000",
        "dd;rcu_core_[k] 500000",
    ]
    assert err == ""


def test_srcline_without_source_info_is_a_srcline(tmp_path: Path) -> None:
    """A real `perf script -F +srcline` capture: where perf has no source line it
    prints DSO[ADDR] under the frame (`gzip[cc5c]`, `[kernel.kallsyms][ffffffff813aeb13]`).
    Each was warned about as an unreadable frame line (267 here) though the stacks
    were right; they are srcline lines, and the profile is the plain capture's."""
    path = DATA / "collapse_extra" / "srcline-noinfo.txt"
    text = path.read_bytes()
    assert b"\n  [kernel.kallsyms][ffffffff" in text and b"\n  gzip[" in text and b"\n  read.c:" in text
    out, err = folded_of(tmp_path, str(path))
    assert err == ""
    plain, err2 = folded_of(tmp_path, str(DATA / "collapse_extra" / "srcline-noinfo-plain.txt"))
    assert (out, err2) == (plain, "") and out
    with open(path, "rb") as f:
        stats = ReadStats()
        samples = list(get("perf").samples(f, CollapseOptions(), source=str(path), stats=stats))
    assert stats.skipped == 0 and len(samples) == text.count(b"cpu-clock")
    # A shared library's, as perf prints it for libc without debug info; --strict takes it too.
    lines = _REAL_G.split(b"\n")
    lines.insert(2, b"  libc.so.6[29d90]")
    one = tmp_path / "libc.perf"
    one.write_bytes(b"\n".join(lines))
    out, err = folded_of(tmp_path, str(one), "--strict")
    assert err == "" and dict((ln.rsplit(" ", 1)[0], int(ln.rsplit(" ", 1)[1])) for ln in out.splitlines()) == _REAL_G_FOLDED


def test_no_callchain_comm_tid_period_is_perf_not_differential(tmp_path: Path) -> None:
    """A real `perf script -F comm,tid,period` without call chains: every line ends in
    two numbers, so `flamed svg` drew it as a differential graph (the tid as BEFORE,
    the period as AFTER: "dd +99.72%") and collapse could not tell its format. It is
    perf script: one sample per line, weighted by its period, no frames."""
    from flamed.folded import is_differential
    from flamed.inputs import differential_inputs

    path = DATA / "collapse_extra" / "nog-comm-tid-period.txt"
    lines = path.read_bytes().splitlines()
    assert len(lines) > 100 and all(ln.startswith(b"              dd ") for ln in lines)
    assert not is_differential(path.read_bytes()) and not differential_inputs([str(path)])
    period = int(lines[0].split()[2])
    out, err = folded_of(tmp_path, str(path), "--pid")  # the format found by detection
    assert err == "" and out == f"dd-?;{EMPTY_STACK_FRAME} {period * len(lines)}\n"
    svg = tmp_path / "out.svg"
    e = io.StringIO()
    assert main(["svg", str(path), "-o", str(svg)], stderr=e) == 0, e.getvalue()
    text = svg.read_text()
    assert f"<title>dd ({period * len(lines):,} samples, 100.00%)</title>" in text and "%;" not in text
    # difffolded.pl's own lines are still differential
    assert is_differential(b"dd;main 5622 2004008\nls;main 3 4\n")


@pytest.mark.parametrize(
    ("jobs", "gz"), [("1", False), ("2", False), ("2", True)], ids=["serial", "ranged", "gzip-chunks"]
)
def test_capture_cut_inside_a_frame_line_drops_its_last_sample(tmp_path: Path, jobs: str, gz: bool) -> None:
    """A perf script cut off inside a frame line (a full disk, a killed perf, head -c):
    the last sample lost its root frames, and its cut line became a frame
    ('start_thread+0x305 (/usr/lib/x86', offset and half a path) under the bare
    command. It is left out and reported instead."""
    real = gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes())
    last = real.rstrip(b"\n").rfind(b"\n\n") + 2  # the last sample's header
    cut_line = real.index(b"\n\t", real.index(b"\n", last)) + 1  # its first frame line
    cut = cut_line + 20  # inside it
    assert b"\n" not in real[cut_line:cut]
    whole, cut_file = tmp_path / "whole.txt", tmp_path / "cut.txt"
    whole.write_bytes(real[:last])
    cut_file.write_bytes(gzip.compress(real[:cut]) if gz else real[:cut])
    expected, err0 = folded_of(tmp_path, str(whole))
    assert err0 == ""
    out = tmp_path / "out.folded"
    err = io.StringIO()
    assert main(["collapse", "--jobs", jobs, "--chunk-size", "4096", str(cut_file), "-o", str(out)], stderr=err) == 0
    assert out.read_text() == expected
    line = real[:last].count(b"\n") + 1
    assert f"skipped 1 malformed line (first: {cut_file}:{line}: sample cut short" in err.getvalue()
    # The sample stream (merge, timelines) leaves it out too.
    trace = tmp_path / "m.trace"
    err = io.StringIO()
    assert main(["merge", str(cut_file), "-o", str(trace)], stderr=err) == 0
    assert len(trace.read_text().splitlines()) == 1 + real[:last].count(b"\n\n")
    assert f"{cut_file}:{line}: sample cut short" in err.getvalue()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_capture_missing_only_its_final_newline_keeps_its_last_sample(tmp_path: Path, jobs: str) -> None:
    """A capture whose every line is whole but which lacks the final newline (an
    edited file) is not cut short: its last frame line ends with its (dso), and
    its last sample is counted like the others."""
    real = gzip.decompress((DATA / "perf" / "c-pid-tid.txt.gz").read_bytes())
    whole, bare = tmp_path / "whole.txt", tmp_path / "bare.txt"
    whole.write_bytes(real)
    bare.write_bytes(real.rstrip(b"\n"))
    assert bare.read_bytes().endswith(b")")
    expected, err0 = folded_of(tmp_path, str(whole))
    assert err0 == ""
    out = tmp_path / "out.folded"
    err = io.StringIO()
    assert main(["collapse", "--jobs", jobs, "--chunk-size", "4096", str(bare), "-o", str(out)], stderr=err) == 0
    assert out.read_text() == expected
    assert "cut short" not in err.getvalue()


@pytest.mark.parametrize("command", [["merge"], ["export", "-f", "trace"]])
def test_a_crlf_perf_script_streams_as_its_lf_twin(tmp_path: Path, command: list[str]) -> None:
    """merge and export read perf script sample by sample (with times): there a
    blank line of CRLF text ("\\r") was taken for another sample's header, so
    every blank line was a malformed line and --strict refused a valid file."""
    lf = "".join(f"app {i} [000] 1.{i:06d}: 1 cpu-clock:\n\t4005d0 f{i} (/bin/app)\n\t400600 main (/bin/app)\n\n"
                 for i in range(1, 6))
    for name, text in (("lf.txt", lf), ("crlf.txt", lf.replace("\n", "\r\n"))):
        (tmp_path / name).write_bytes(text.encode())
    outs = []
    for name in ("lf.txt", "crlf.txt"):
        err = io.StringIO()
        out = tmp_path / f"{name}.trace"
        assert main([*command, "--strict", str(tmp_path / name), "-o", str(out)], stderr=err) == 0, err.getvalue()
        assert "malformed" not in err.getvalue()
        outs.append(out.read_text().splitlines()[1:])
    assert outs[0] == outs[1] and len(outs[0]) == 5


@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("callchains", [False, True])
def test_a_malformed_line_is_named_by_its_own_line_number(tmp_path: Path, crlf: bool, callchains: bool) -> None:
    """Samples that run into each other (perf script without -g; CRLF text, whose
    blank lines do not split blocks) are parsed from rebuilt text: an error in
    them was reported at the rebuilt text's line (10 for the 6th line of 8,
    13 for the 10th), and under --chunk-size at yet another."""
    lines: list[str] = []
    bad = 0
    for i in range(1, 40):
        if i == 23:
            lines.append("!!! not a header")
            bad = len(lines)
        lines.append(f"app {i}/{i} [000] 1.{i:06d}: 10 cpu-clock:")
        if callchains:
            lines += [f"\t4005d0 f{i} (/bin/app)", "\t400600 main (/bin/app)", ""]
    text = "\n".join(lines) + "\n"
    path = tmp_path / "p.txt"
    path.write_bytes((text.replace("\n", "\r\n") if crlf else text).encode())
    for extra in ([], ["--jobs", "2", "--chunk-size", "1024"]):
        err = io.StringIO()
        assert main(["collapse", "--format", "perf", *extra, str(path), "-o", str(tmp_path / "o.folded")],
                    stderr=err) == 0
        assert f"(first: {path}:{bad}: unrecognised perf script header)" in err.getvalue(), (extra, err.getvalue())
        err = io.StringIO()
        assert main(["collapse", "--format", "perf", "--strict", *extra, str(path)], stdout=io.StringIO(),
                    stderr=err) == 1
        assert f"error: {path}:{bad}: unrecognised perf script header" in err.getvalue(), (extra, err.getvalue())
