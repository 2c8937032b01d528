"""flamed.sampling.kallsyms against fake and real /proc/kallsyms."""

from __future__ import annotations

from pathlib import Path

from flamed.sampling.kallsyms import Kallsyms, KallsymsPreload, shows_addresses


def test_lookup_and_hidden(tmp_path: Path) -> None:
    f = tmp_path / "kallsyms"
    f.write_text(
        "ffffffff81000000 T _stext\n"
        "ffffffff81000100 t helper\n"
        "ffffffff81000200 D some_data\n"
        "ffffffff81000300 W weak_fn\n"
        "ffffffffc0001000 t mod_fn\t[mymod]\n"
    )
    k = Kallsyms(path=f)
    assert len(k) == 4  # data symbols are not code
    assert k.resolve(0xFFFFFFFF81000150) == (b"helper", b"kernel")
    assert k.resolve(0xFFFFFFFF81000250) == (b"helper", b"kernel")  # data skipped
    assert k.resolve(0xFFFFFFFFC0001004) == (b"mod_fn", b"kernel")
    assert k.resolve(0x1000) == (None, None)
    f.write_text("0000000000000000 T _stext\n0000000000000000 t helper\n")
    hidden = Kallsyms(path=f)
    assert hidden.hidden and hidden.resolve(0xFFFFFFFF81000150) == (None, None)


def test_the_running_kernel() -> None:
    k = Kallsyms()
    if k.hidden:  # not root: nothing to check but the graceful path
        return
    for line in Path("/proc/kallsyms").read_text().splitlines():
        addr, kind, name = line.split()[:3]
        if name == "do_syscall_64" and kind in "tT":
            assert k.resolve(int(addr, 16) + 4)[0] == b"do_syscall_64"
            break


def test_read_ahead_gives_the_same_table(tmp_path: Path) -> None:
    f = tmp_path / "kallsyms"
    f.write_text("ffffffff81000000 T _stext\nffffffff81000100 t helper\nffffffffc0001000 t mod_fn\t[mymod]\n")
    assert shows_addresses(f)
    pre = KallsymsPreload(path=f)
    k = pre.take()
    assert len(k) == 3 and not k.hidden
    assert k.resolve(0xFFFFFFFF81000150) == (b"helper", b"kernel")
    again = pre.take()  # taken once: a second take reads the file itself
    assert again is not k and again.resolve(0xFFFFFFFFC0001004) == (b"mod_fn", b"kernel")


def test_read_ahead_of_hidden_addresses_reads_nothing(tmp_path: Path) -> None:
    f = tmp_path / "kallsyms"
    f.write_text("0000000000000000 T _stext\n0000000000000000 t helper\n")
    assert not shows_addresses(f)
    pre = KallsymsPreload(path=f)
    pre._thread.join()
    assert pre._table is None  # nothing read ahead
    assert pre.take().hidden  # asked anyway: read then, and said hidden
