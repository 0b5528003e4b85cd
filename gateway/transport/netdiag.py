"""Network failures in words a user can act on: which address, and why (connection refused,
timed out, name not resolved…), never an internal exception class name."""
from __future__ import annotations

import asyncio
import errno
import socket
import ssl

_ERRNO_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ETIMEDOUT: "timed out",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network unreachable",
    errno.ECONNRESET: "connection reset",
    errno.EADDRINUSE: "address already in use",
    errno.EADDRNOTAVAIL: "address not available",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def _cause(exc: BaseException) -> str:
    """The innermost OS-level reason behind `exc`, in words."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, socket.gaierror):
            return "name not resolved"
        if type(e).__name__ == "ClientConnectorDNSError":  # aiohttp >= 3.10
            return "name not resolved"
        if isinstance(e, (asyncio.TimeoutError, TimeoutError, socket.timeout)):
            return "timed out"
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({e.verify_message})"
        if isinstance(e, ssl.SSLError):
            return "TLS handshake failed"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if type(e).__name__ in ("ServerTimeoutError", "ConnectionTimeoutError"):
            return "timed out"
        inner = getattr(e, "os_error", None)  # aiohttp's ClientConnectorError
        if isinstance(inner, BaseException) and inner is not e:
            e = inner
            continue
        if isinstance(e, OSError) and e.errno in _ERRNO_WORDS:
            return _ERRNO_WORDS[e.errno]
        if isinstance(e, OSError) and e.strerror:
            # "Multiple exceptions: [Errno 111] Connect call failed …" (several addresses)
            return e.strerror.lower()
        nxt = e.__cause__ or e.__context__
        if nxt is None and isinstance(e, OSError) and e.args and isinstance(e.args[0], str):
            text = e.args[0].lower()
            if "refused" in text or "connect call failed" in text:
                return "connection refused"
            return text
        e = nxt
    text = str(exc).strip()
    if "Connect call failed" in text or "refused" in text.lower():
        return "connection refused"
    return text.lower() or "connection failed"


def _hostport(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def describe_connect_error(exc: BaseException, host: str, port: int | None) -> str:
    """`10.0.0.5:8000: connection refused` — the address and the cause of a failed connect."""
    return f"{_hostport(host, port)}: {_cause(exc)}"


def describe_listen_error(exc: BaseException, host: str, port: int) -> str:
    """`cannot listen on 127.0.0.1:8080: address already in use`."""
    return f"cannot listen on {_hostport(host, port)}: {_cause(exc)}"
