"""pthread ids to OS tids by reading a live process's memory: this test process's own threads."""

from __future__ import annotations

import os
import threading

from flamed.pyspy.threadids import ThreadIds


def test_maps_the_pthread_ids_of_a_live_process_to_its_os_tids() -> None:
    stop = threading.Event()
    started = threading.Barrier(4)

    def wait() -> None:
        started.wait(10)
        stop.wait(30)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(10)
        # threading's ident is pthread_self(), what py-spy names before 3.11; native_id is the OS tid
        want = {t.ident: t.native_id for t in threads} | {threading.get_ident(): threading.get_native_id()}
        ids = ThreadIds()
        got, why = ids.resolve(os.getpid(), list(want))
        assert why is None and got == want
        assert ids.counters["mapped"] == 4 and ids.counters["unmapped"] == 0
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_says_why_when_the_process_is_gone() -> None:
    ids = ThreadIds()
    got, why = ids.resolve(2**22 + 1, [0x7F0000000000])  # above any pid_max: no such process
    assert got == {} and why is not None and "exited" in why
    assert ids.counters["unmapped"] == 1
