"""perf script forms from FlameGraph's and inferno's regression corpora, written from perf's formats."""

from __future__ import annotations

from flamed.collapse import get
from flamed.collapse.base import CollapseOptions
from flamed.collapse.perf import demangle_rust_legacy


def _fold(text: str, **kw: object) -> dict[str, int]:
    c = get("perf")
    p = c.parser(CollapseOptions(**kw))  # type: ignore[arg-type]
    res = p.parse(text.encode(), source="t", first_line=1)
    out: dict[str, int] = {}
    for ev in res.order:
        for k, w in res.groups[ev].items():
            out[k.lstrip(";")] = out.get(k.lstrip(";"), 0) + int(w)
    return out


def test_old_header_without_time_and_flush_left_frames() -> None:
    # perf before 3.x: "comm pid event:" and frames not indented.
    text = ("java 19983 cycles: \n"
            "ffffffff8103d0ca native_write_msr_safe ([kernel.kallsyms])\n"
            "7f2e5c34e6ae Ljava/lang/Thread;::run (/tmp/perf-19982.map)\n"
            "7f2e60a4a182 start_thread (/lib/libpthread-2.15.so)\n\n")
    assert _fold(text) == {"java;start_thread;java/lang/Thread:::run_[j];native_write_msr_safe_[k]": 1}


def test_java_frames_in_flamegraph_java_palette_form() -> None:
    text = ("java 1 1.000001: 1 cycles: \n"
            "\t7f0 Ljava/io/PrintStream;::print (/var/tmp/perf-1.map)\n"
            "\t7f1 LBusy;::main (/var/tmp/perf-1.map)\n\n")
    assert _fold(text) == {"java;LBusy:::main_[j];java/io/PrintStream:::print_[j]": 1}


def test_perf_without_g_ip_and_symbol_on_the_header_line() -> None:
    text = ("           false 39654 19115.489713:          1 cycles:  ffffffff9b201293 [unknown] ([unknown])\n"
            "           false 39654 19115.489719:          1 cycles:      7fa68b1f2d84 _dl_start+0x4 (/usr/lib/ld-2.31.so)\n")
    assert _fold(text) == {"false;[unknown]": 1, "false;_dl_start": 1}


def test_perf_map_agent_inlined_chains_are_frames() -> None:
    text = ("java 1 1.000001: 1 cycles: \n"
            "\t7f0 Ljava/io/PrintStream;::println->Ljava/io/PrintStream;::newLine->LW;::flush (/tmp/perf-1.map)\n"
            "\t7f1 Interpreter (/tmp/perf-1.map)\n\n")
    assert _fold(text) == {"java;Interpreter_[j];java/io/PrintStream:::println_[j];java/io/PrintStream:::newLine_[i];"
                           "LW:::flush_[i]": 1}


def test_jitdump_dsos_are_jit() -> None:
    text = ("spshell 1 1.000001: 1 cycles: \n"
            "\t7f0 fib.smx::fib (/root/.debug/jit/x/jitted-42-7.so)\n"
            "\t7f1 main (/bin/spshell)\n\n")
    assert _fold(text) == {"spshell;main;fib.smx::fib_[j]": 1}


def test_rust_legacy_names_perf_left_mangled() -> None:
    assert demangle_rust_legacy("gc::gc::GcBox$LT$T$GT$::new::_$u7b$$u7b$closure$u7d$$u7d$::ha2ed0674a1c3dc9f") == \
        "gc::gc::GcBox<T>::new::_{{closure}}"
    assert demangle_rust_legacy("_$LT$term..terminfo..TerminfoTerminal$LT$T$GT$$GT$::new::h1234567890abcdef") == \
        "<term::terminfo::TerminfoTerminal<T>>::new"
    assert demangle_rust_legacy("emulator::main::hc2aaa9b4591a10c7") == "emulator::main"
    assert demangle_rust_legacy("a$LT$b") == "a$LT$b"  # no hash: not a mangled Rust name
