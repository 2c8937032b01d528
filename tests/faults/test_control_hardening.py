"""What a new user (or a careless member of the socket's group) runs into first.

* Bad requests on the control socket get errors that say what was expected.
* A config file with a byte that is not UTF-8 is one clear error, at start and
  on reload (the running config is kept).
* Two daemons cannot share a state directory; a SIGKILLed one does not block a restart.
* Idle connections do not starve other clients, root's least of all.
* ``make run``'s configuration prints the client commands to copy.

Every daemon here is a real ``flamed daemon`` process (tests/faults/daemonproc.py)
with the synthetic sampler: these are about the socket, the config and the
state directory, not about BPF.
"""

from __future__ import annotations

import json
from typing import Any

from daemonproc import DaemonProc, unix_request_raw

FAKE = {"sampler": "fake", "drain_interval": 0.5}


def _error(d: DaemonProc, data: bytes) -> dict[str, Any]:
    answer = unix_request_raw(d.socket_path, data)
    head = json.loads(answer.split(b"\n", 1)[0])
    assert head["ok"] is False, head
    return head  # type: ignore[no-any-return]


def test_bad_requests_say_what_was_expected(daemon_factory: Any) -> None:
    d = daemon_factory(sampling=FAKE)
    cases = [
        # binary garbage; a leading NUL once made json.loads guess UTF-16
        (b"\xff\xfe\x00\x01garbage\n", ["not UTF-8 text", "byte 0xff at offset 0", '{"request": "status"}']),
        (b"\x00{\x00\"\x00r\n", ["not valid JSON", '{"request": "status"}']),
        (b'{"request": "status", "x": "\xe9"}\n', ["not UTF-8 text", "byte 0xe9 at offset 28"]),
        # Python's int-digits limit must not be what the client reads
        (b'{"request": "snapshot", "pid": ' + b"9" * 5000 + b"}\n",
         ["integer of 5000 digits", "pid, tgid and tid take integers in [0, 2^32)"]),
        (b'{"request": "snapshot", "seconds": NaN}\n', ["NaN", "not a JSON number"]),
        (b"{not json\n", ["not valid JSON", "at offset 1", "docs/protocol.md"]),
    ]
    for data, needles in cases:
        head = _error(d, data)
        assert head["code"] == "bad_request", (data[:40], head)
        msg = head["error"]
        for n in needles:
            assert n in msg, (data[:40], msg)
        for bad in ("codec", "set_int_max_str_digits", "Traceback", "utf-16", "utf-32"):
            assert bad not in msg, (data[:40], msg)
    # The daemon is still fine and counted them as bad requests.
    assert d.status()["pid"] == d.pid
    assert d.metric("flamed_control_requests_total", {"result": "bad_request"}) == len(cases)
