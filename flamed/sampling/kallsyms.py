"""Kernel symbols straight from /proc/kallsyms.

bcc's kernel symbol cache only loads kallsyms when the effective uid is 0
(``bcc_procutils_each_ksym`` returns early otherwise), so a daemon running as
an unprivileged user with CAP_SYSLOG would name no kernel frame.  Reading the
file here works for any process the kernel shows the addresses to (root, or
CAP_SYSLOG), and a bisect in a sorted list is cheaper per lookup than a call
into bcc.
"""

from __future__ import annotations

import bisect
import logging
import threading
from array import array
from itertools import accumulate
from pathlib import Path

log = logging.getLogger("flamed.sampling.symbols")

#: Symbol types that can hold code: text (t/T) and weak (w/W).
_CODE = frozenset(b"tTwW")


def shows_addresses(path: Path = Path("/proc/kallsyms")) -> bool:
    """Does ``path`` show this process real kernel addresses (not all zeros)?"""
    try:
        with open(path, "rb") as f:
            head = [f.readline() for _ in range(64)]
    except OSError:
        return False
    return any(ln.split(b" ", 1)[0].strip(b"0") for ln in head if ln)


class Kallsyms:
    """A :class:`flamed.sampling.symbols.Resolver` for the kernel (the ``pid`` is ignored)."""

    def __init__(self, pid: int = -1, path: Path = Path("/proc/kallsyms")) -> None:
        # ~120,000 code symbols: kept as an address array and one blob of names
        # (about 4 MB) rather than Python ints and bytes objects (about 20 MB).
        addrs = array("Q")
        names: list[bytes] = []
        with open(path, "rb") as f:
            for line in f:
                parts = line.split(None, 3)
                if len(parts) < 3 or parts[1][0] not in _CODE:
                    continue
                addrs.append(int(parts[0], 16))
                names.append(parts[2])
        if any(addrs[i] > addrs[i + 1] for i in range(len(addrs) - 1)):
            order = sorted(range(len(addrs)), key=addrs.__getitem__)
            addrs = array("Q", (addrs[i] for i in order))
            names = [names[i] for i in order]
        self.hidden = not addrs or addrs[-1] == 0
        if self.hidden:
            log.warning(
                "%s shows no kernel addresses to this process: kernel frames will be [unknown]_[k]; "
                "run as root or grant CAP_SYSLOG (kernel.kptr_restrict=2 hides them from everyone)", path)
            addrs, names = array("Q"), []
        self._starts = addrs
        self._blob = b"".join(names)
        self._ends = array("L", accumulate(len(n) for n in names))

    def __len__(self) -> int:
        return len(self._starts)

    def resolve(self, addr: int) -> tuple[bytes | None, bytes | None]:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None, None
        return self._blob[self._ends[i - 1] if i else 0:self._ends[i]], b"kernel"

    def refresh(self) -> None:  # modules loaded later: not worth a re-read per drain
        pass

    def close(self) -> None:
        self._starts = array("Q")
        self._blob = b""
        self._ends = array("L")


class KallsymsPreload:
    """A :class:`Kallsyms` read in a thread of its own, started at construction.

    The sampler starts one before its program compiles (seconds, spent in
    bcc's compiler outside the GIL), so the first drain finds the kernel's
    symbols read: reading them there cost ~0.12 s of CPU (a third of it the
    kernel writing /proc/kallsyms) in the daemon's first 10 s after ready.
    """

    def __init__(self, path: Path = Path("/proc/kallsyms")) -> None:
        self._path = path
        self._table: Kallsyms | None = None
        self._thread = threading.Thread(target=self._load, name="flamed-kallsyms", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        if not shows_addresses(self._path):
            return  # hidden: the symbolizer says so and never asks for the table
        try:
            self._table = Kallsyms(path=self._path)
        except (OSError, ValueError) as e:
            log.debug("reading %s ahead failed (%s): read when first needed", self._path, e)

    def take(self, pid: int = -1) -> Kallsyms:
        """The table (read now if the thread could not); a resolver factory's signature."""
        self._thread.join()
        table, self._table = self._table, None
        return table if table is not None else Kallsyms(pid, self._path)
