"""Which `Host` a keyless browser surface (the console) answers: the defence against DNS
rebinding, where a page on an attacker's domain re-resolves that domain to the gateway's
address and reads what the gateway serves with the attacker's name in `Host`.

Allowed: an IP literal (a rebinding attack needs a name the attacker controls), `localhost`
and `*.localhost` (browsers resolve these to loopback themselves), and the names configured
(the listen host, `[server] console_hosts`); `*` among them allows any. A request without
`Host` (HTTP/1.0, not a browser) is allowed.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable


class HostAllowList:
    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(_name(n) for n in names if n)
        self.any = "*" in self.names

    def allows(self, host: str | None) -> bool:
        if host is None or self.any:
            return True
        name = _name(host)
        if name == "localhost" or name.endswith(".localhost") or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _name(host: str) -> str:
    """The host part of a Host header value (port and IPv6 brackets off), lower case, without
    a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")
