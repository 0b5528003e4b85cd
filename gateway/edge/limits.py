"""Limits at the trust boundary: their names (a closed set, the `limit` label of
slogate_limits_exceeded_total), what a refusal says, and the small helpers that enforce them.

Connection-level limits (header timeout, connection caps) are the listener's
(gateway/edge/listener.py) and counted in slogate_connections_rejected_total{reason}. Every
other limit ends a request or an upstream attempt with a code equal to its name, so the finished
context says which limit it hit (`hits`) and the Prometheus observer counts it once per request.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import orjson

from gateway.errors import GatewayError

MAX_STRING = 256  # client-supplied strings echoed in error bodies and logs are cut to this

# slogate_limits_exceeded_total{limit}
BODY_TIMEOUT = "body_timeout"  # the request body did not arrive within server.body_timeout_s
REQUEST_TOO_LARGE = "request_too_large"  # body over server.max_body_bytes
STRING_TOO_LONG = "string_too_long"  # a client-supplied name over MAX_STRING characters
EVENT_TOO_LARGE = "event_too_large"  # an upstream SSE event (or bytes before the first token)
#                                      over server.max_event_bytes
RESPONSE_TOO_LARGE = "response_too_large"  # a non-streamed upstream body (decompressed) over
#                                            server.max_response_bytes
UPSTREAM_REDIRECT = "upstream_redirect"  # an upstream answered 3xx (never followed)
UPSTREAM_UPGRADE = "upstream_upgrade"  # an upstream answered 101 Switching Protocols (never
#                                        relayed, its connection closed)
HEADERS_TOO_LARGE = "upstream_headers_too_large"  # upstream response headers over the parser's
#                                                   limits (a line over 8190 bytes, 128 lines)
LIMITS = (BODY_TIMEOUT, REQUEST_TOO_LARGE, STRING_TOO_LONG, EVENT_TOO_LARGE, RESPONSE_TOO_LARGE,
          UPSTREAM_REDIRECT, UPSTREAM_UPGRADE, HEADERS_TOO_LARGE)
LIMIT_SET = frozenset(LIMITS)

# slogate_connections_rejected_total{reason}
HEADER_TIMEOUT = "header_timeout"  # request headers incomplete after server.header_timeout_s
IDLE_TIMEOUT = "idle_timeout"  # a new connection sent nothing within server.header_timeout_s
MAX_CONNECTIONS = "max_connections"
MAX_CONNECTIONS_PER_CLIENT = "max_connections_per_client"
CONNECTION_REASONS = (HEADER_TIMEOUT, IDLE_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT)

if TYPE_CHECKING:

    pass


def clip(value: object, n: int = MAX_STRING) -> str:
    """A client-supplied string as it may appear in an error body or a log line."""
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= n else s[:n] + f"…({len(s) - n} more)"


def check_name(value: str, param: str) -> str:
    """A name the client chose (model, class) longer than MAX_STRING is refused, so neither
    an error body nor a log line ever carries more of it."""
    if len(value) > MAX_STRING:
        raise GatewayError(400, f"'{param}' is {len(value)} characters long; at most "
                           f"{MAX_STRING} are accepted.", STRING_TOO_LONG, param=param)
    return value


# -- raw answers where no request (or no API) is known yet -------------------------------------

def _body(status: int, message: str, code: str) -> bytes:
    # Both SDKs read `error.message`; the body carries both shapes' fields (OpenAI: message,
    # type, param, code; Anthropic: top-level type "error", error.type, error.message).
    kind = {503: "overloaded_error", 408: "timeout_error"}.get(status, "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {
        "message": message, "type": kind, "param": None, "code": code}})


def malformed_request(status: int) -> bytes:
    return _body(status, "The request is not valid HTTP/1.1 (a request line or header that "
                 "cannot be parsed, e.g. a control character in a header value).",
                 "malformed_request")


def _raw_answer(status: int, reason: str, message: str, code: str,
                retry_after: int | None = None) -> bytes:
    body = _body(status, message, code)
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def too_many_connections(code: str) -> bytes:
    return _raw_answer(503, "Service Unavailable", "The gateway has too many open connections"
                       + (" from your address" if code == MAX_CONNECTIONS_PER_CLIENT else "")
                       + "; retry later.", code, retry_after=1)


def header_timeout(seconds: float) -> bytes:
    return _raw_answer(408, "Request Timeout", f"The request headers did not arrive within "
                       f"{seconds:g} s.", HEADER_TIMEOUT)


# -- secrets in logs ----------------------------------------------------------------------------

_CREDENTIAL = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api-key|cookie|set-cookie|x-goog-api-key)"
    r"(['\"]?\s*[:=,]\s*(?-i:b)?['\"]?)([^\r\n'\"]*)")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[^\s'\"\\]+")
_KEYLIKE = re.compile(r"\b(sk|gw|pk|rk)-[A-Za-z0-9_\-]{6,}")


def redact(text: str) -> str:
    """Credential header values (and anything that looks like a bearer token) replaced."""
    text = _CREDENTIAL.sub(lambda m: m.group(1) + m.group(2) + "<redacted>", text)
    text = _BEARER.sub(lambda m: m.group(1) + " <redacted>", text)
    return _KEYLIKE.sub("<redacted>", text)
