"""The Host rule of flamed's HTTP servers on a loopback address.

A web page the user opens elsewhere can point its own DNS name at 127.0.0.1
(DNS rebinding): the browser then sends it requests to a local server and
lets the page read the answers, since to the browser they come from the
page's own origin.  What the browser cannot change is the ``Host`` header,
which still names the page's host.  So a server bound to loopback answers
only requests whose ``Host`` names a loopback host: ``localhost`` or a
loopback address (``127.x.x.x``, ``[::1]``), with or without a port.

``flamed serve`` (flamed/serve/server.py) and the daemon's metrics server
(flamed/daemon/metrics.py) both apply it.
"""

from __future__ import annotations

import ipaddress

#: The body of the 403 answer to a request with another Host.
REFUSED = "answers only requests for a loopback host name (localhost, 127.0.0.1, [::1])"


def is_loopback_address(bound: str) -> bool:
    """True when a server bound to ``bound`` (an address or ``localhost``)
    is reachable only from this host."""
    name = bound.strip("[]").lower()
    if name in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def host_is_loopback(host_header: str | None) -> bool:
    """Whether a ``Host`` header value names a loopback host.

    An address, not a name that starts like one: ``127.0.0.1.evil.example``
    is a DNS name its owner can point at 127.0.0.1.  The root's dot
    (``localhost.``) is the same name.
    """
    host = (host_header or "").strip().lower()
    if host.startswith("["):
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name[:-1] if name.endswith(".") else name
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(bound: str, host_header: str | None) -> bool:
    """The rule: any Host on a non-loopback address (asked for explicitly, and
    warned about), a loopback Host only on a loopback address."""
    return not is_loopback_address(bound) or host_is_loopback(host_header)
