"""The listener's own limits: what a hostile client can hold open.

aiohttp bounds header size and idle keep-alive time, but has no deadline for reading a request's
headers (a slowloris client trickles them for ever) and no cap on open connections. The
mechanics (a header deadline per connection, a site whose connections get it) are the
transport's (gateway/transport/server.py); the policy is here:

- ConnectionGuard: open connections in total and per client address, and the header deadline.
  A connection over a cap is answered 503 with Retry-After and closed at once, so descriptors
  stay bounded; headers that do not arrive in time get 408 (if any byte of them came) and
  close; a request that cannot be parsed gets a short JSON error that echoes nothing.
- fd_budget: raises the soft RLIMIT_NOFILE as far as allowed and clamps max_connections so that
  accepting a client can never take the descriptor an upstream connection needs.
- kernel_backlog: the listen backlog the kernel grants (net.core.somaxconn bounds `backlog`),
  said once at start when it is less than configured.

The keep-alive idle timeout is aiohttp's own (`keepalive_timeout`); the body deadline is
ingress's (it answers in the client's API format).
"""
from __future__ import annotations

import logging
import resource
from typing import Any

from gateway.edge import limits

log = logging.getLogger("slogate")

class ConnectionGuard:
    def __init__(self, max_connections: int, max_per_client: int, header_timeout_s: float,
                 metrics: Any = None) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.by_client: dict[str, int] = {}
        self._rejected = metrics.connections_rejected if metrics is not None else None
        self._gauge = metrics.open_connections if metrics is not None else None
        self.rejected: dict[str, int] = dict.fromkeys(limits.CONNECTION_REASONS, 0)

    def admit(self, client: str) -> str | None:
        """None (and the connection is counted), or why it is refused."""
        if self.open >= self.max_connections:
            return limits.MAX_CONNECTIONS
        n = self.by_client.get(client, 0)
        if self.max_per_client and n >= self.max_per_client:
            return limits.MAX_CONNECTIONS_PER_CLIENT
        self.by_client[client] = n + 1
        self.open += 1
        if self._gauge is not None:  # inc/dec: the admin listener's guard shares the gauge
            self._gauge.inc()
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        n = self.by_client.get(client, 1) - 1
        if n > 0:
            self.by_client[client] = n
        else:
            self.by_client.pop(client, None)
        if self._gauge is not None:
            self._gauge.dec()

    def count(self, reason: str) -> None:
        self.rejected[reason] += 1
        if self._rejected is not None:
            self._rejected.labels(reason).inc()

    # -- the transport's ConnectionPolicy --------------------------------------------------------
    def refused(self, reason: str) -> bytes:
        self.count(reason)
        return limits.too_many_connections(reason)

    def timed_out(self, got_bytes: bool) -> bytes | None:
        if not got_bytes:
            self.count(limits.IDLE_TIMEOUT)
            return None
        self.count(limits.HEADER_TIMEOUT)
        return limits.header_timeout(self.header_timeout_s)

    def malformed(self, remote: str | None, message: str, status: int) -> bytes:
        log.warning("malformed request from %s: %s", remote,
                    limits.clip(limits.redact(message.split("\n")[0]), 128))
        return limits.malformed_request(status)


def fd_budget(max_connections: int, upstream_fds: int, reserve: int = 128) -> int:
    """Raise the soft descriptor limit as far as the hard limit allows; return the number of
    client connections that fit next to the upstream connections and a reserve (listening
    sockets, logs, the event loop's own). A request holds one upstream connection at a time,
    so upstream connections in use are at most `upstream_fds` (the pools' sizes) and about
    as many as the client connections: a pool larger than half the limit is budgeted as half
    (client and upstream connections split the descriptors evenly)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + min(upstream_fds, max_connections) + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    fit = max(16, soft - min(upstream_fds, (soft - reserve) // 2) - reserve)
    if fit < max_connections:
        log.warning("max_connections lowered from %d to %d: the descriptor limit is %d "
                    "(raise it with ulimit -n)", max_connections, fit, soft)
        return fit
    return max_connections


SOMAXCONN = "/proc/sys/net/core/somaxconn"


def kernel_backlog(backlog: int, path: str = SOMAXCONN) -> int:
    """The listen backlog the kernel grants: `backlog`, bounded by net.core.somaxconn (Linux;
    elsewhere, or unreadable, `backlog` as configured). Lower than configured, it is logged:
    a burst of new connections beyond the queue waits for a SYN retransmit (1 s)."""
    try:
        with open(path) as f:
            cap = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return backlog
    if 0 < cap < backlog:
        log.warning("listen backlog %d is bounded by net.core.somaxconn = %d: the kernel "
                    "queues at most %d connections not yet accepted (raise it with sysctl -w "
                    "net.core.somaxconn=%d)", backlog, cap, cap, backlog)
        return cap
    return backlog


def runner_kwargs(server_cfg: Any) -> dict[str, Any]:
    """aiohttp's own per-connection limits."""
    return {"keepalive_timeout": server_cfg.idle_connection_timeout_s,
            "max_line_size": 8190, "max_field_size": 8190, "max_headers": 128,
            "lingering_time": 5.0}


class RedactingFilter(logging.Filter):
    """Credential header values never reach a log line: aiohttp logs a request it could not
    parse with the parser's exception, which quotes the offending header line."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format: keep it as aiohttp made it
            return True
        clean = limits.clip(limits.redact(message), 2048)
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = limits.redact(text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = limits.redact(record.exc_text)
        record.msg, record.args = clean, ()
        return True


_FILTER = RedactingFilter()
REDACTED_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.client",
                    "aiohttp.internal", "asyncio", "slogate")


def install_log_redaction() -> None:
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
