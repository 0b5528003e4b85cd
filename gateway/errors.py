"""Every exception type and outcome code of the gateway, in one place.

Three kinds of failure, and where each ends up:
- `GatewayError`: the gateway itself refuses or fails the request before anything was sent to
  the client; answered as an HTTP error in the client's API format.
- `AttemptFailed`: one upstream attempt failed before commit; the request goes back to
  "choose replica" (or, when attempts run out, its last failure is answered).
- `ClientGone`: the client went away; nothing more can be said to it.
`ConfigError` is the start-up failure: a config key with a bad value.

The outcome codes, deadline reasons and attempt results below are closed vocabularies: they
become metric labels and access-log fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# -- outcomes of a request (slogate_requests_total{outcome}, the access log's `outcome`) --------
OK = "ok"
CLIENT_CANCELLED = "client_cancelled"
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_TRUNCATED = "upstream_truncated"
GATEWAY_ERROR = "gateway_error"
TIMEOUT = "timeout"  # a deadline ended it
REJECTED = "rejected"  # refused by the gateway before any upstream work (bad request, no backend)
# The error code of a request refused because its tenant's own requests keep failing on every
# replica that could serve it while other tenants' succeed (upstream/health.py's holds).
TENANT_HELD = "tenant_held"

# -- why the watchdog ended a request (error_type, stream_interruptions_total{reason}) ---------
FIRST_TOKEN = "first_token_timeout"
IDLE = "idle_timeout"
TOTAL = "total_timeout"
SHUTDOWN = "shutdown"
# ... and why admission cut a stream: its slot went to a less served class (continued after)
PREEMPTED = "preempted"

# -- results of one upstream attempt (upstream_attempts_total{result}); http_<status> too -------
ATTEMPT_OK = "ok"  # the answer reached the client complete
CONNECT_ERROR = "connect_error"
INVALID_RESPONSE = "invalid_response"  # an answer that is not HTTP/1.1 (a body after a 204...)
NO_ANSWER = "no_answer"  # a success status without an answer: not 200, or an empty body
NOT_STREAMED = "not_streamed"  # a whole answer (not an event stream) to a streamed request
CLOSED_BEFORE_FIRST_TOKEN = "closed_before_first_token"
# ... and of an attempt that reached the client but did not complete (after commit)
ATTEMPT_CUT = "cut"  # the upstream closed or lost the stream before its end
ATTEMPT_STALLED = "stalled"  # the idle deadline ended it
ATTEMPT_IN_BAND_ERROR = "in_band_error"  # the upstream said so in the stream
# ... and of one that failed before commit for the request's size: a larger model may serve it
ATTEMPT_CONTEXT_LENGTH = "context_length"
# ... and of one cancelled because the other attempt of a first-token race had a token first
ATTEMPT_HEDGE_LOST = "hedge_lost"

# An attempt's result in words, for an operator (what a backend's breaker remembers as its last
# failure); http_<status> is "status <N>", a connect error names the address and why.
_RESULT_WORDS = {
    FIRST_TOKEN: "no first token before the deadline",
    TOTAL: "ran past the request's total deadline",
    CLOSED_BEFORE_FIRST_TOKEN: "closed the stream before the first token",
    ATTEMPT_CUT: "closed the connection before the end of its answer",
}


class GatewayError(Exception):
    """Answered to the client as an HTTP error in the client's API format."""

    def __init__(self, status: int, message: str, code: str, *, param: str | None = None,
                 outcome: str = REJECTED, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.outcome = outcome
        self.headers = headers or {}


# -- why admission shed a request (slogate_tenant_sheds_total{reason}, x-slogate-admission) ------
SHED_QUEUE_FULL = "queue_full"  # the queue was full and this flow was the one over its share
SHED_TTFT_INFEASIBLE = "ttft_infeasible"
QUOTA_IN_FLIGHT = "quota_in_flight"
QUOTA_QUEUED = "quota_queued"
QUOTA_REQUESTS = "quota_requests_per_minute"
QUOTA_TOKENS = "quota_tokens_per_minute"
SHED_REASONS = (SHED_QUEUE_FULL, SHED_TTFT_INFEASIBLE, QUOTA_IN_FLIGHT, QUOTA_QUEUED,
                QUOTA_REQUESTS, QUOTA_TOKENS)

# -- how a late first token or a slow stream was judged (slogate_tenant_ttft_stalls_total,
# slogate_tenant_tpot_slow_total) --
STALL_OWN = "own"  # its tenant's alone: held back from the estimator
STALL_BACKEND = "backend"  # another tenant's were late too (or it is alone there): learned


@dataclass(frozen=True)
class RateLimits:
    """What a tenant's rate quotas say now, for the SDKs' rate-limit headers (0 limit = none)."""
    requests_limit: int = 0
    requests_remaining: int = 0
    requests_reset_s: float = 0.0
    tokens_limit: int = 0
    tokens_remaining: int = 0
    tokens_reset_s: float = 0.0


class RateLimited(GatewayError):
    """A tenant's quota refused the request: 429 with Retry-After, and the API adapter adds the
    rate-limit headers its SDKs read (`limits`)."""

    def __init__(self, message: str, code: str, retry_after_s: float,
                 limits: RateLimits) -> None:
        super().__init__(429, message, code, outcome=REJECTED,
                         headers={"Retry-After": str(max(1, math.ceil(retry_after_s))),
                                  "x-slogate-admission": code})
        self.limits = limits


class AttemptFailed(Exception):
    """An upstream attempt failed before anything was committed to the client: the request
    may go to another replica. `result` is its label in upstream_attempts_total; `response`
    is an upstream error answer to pass through if this failure is the last."""

    def __init__(self, result: str, status: int, message: str, code: str, *,
                 retryable: bool = True, retry_after_s: float | None = None,
                 response: tuple[int, Any, bytes] | None = None,
                 judges_backend: bool = True, cause: str = "") -> None:
        super().__init__(message)
        self.result = result
        self.status = status
        self.message = message
        self.code = code
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.response = response
        # False when the failure says nothing about the replica's health (a rate limit).
        self.judges_backend = judges_backend
        self._cause = cause

    @property
    def cause(self) -> str:
        """This failure in a few words for an operator: `127.0.0.1:9: connection refused`,
        `status 503`, `no first token before the deadline`."""
        if self._cause:
            return self._cause
        if self.result in _RESULT_WORDS:
            return _RESULT_WORDS[self.result]
        if self.result.startswith("http_"):
            return f"status {self.result[5:]}"
        return self.message.rstrip(".")

    def as_record(self) -> AttemptFailed:
        """This failure as plain data, to keep on the exchange: without its traceback and the
        exception it replaced, which would pin the frames and read buffers of the attempt
        (a flooded upstream's megabytes) and make a cycle through the exchange."""
        self.__traceback__ = self.__context__ = self.__cause__ = None
        return self

    def as_gateway_error(self) -> GatewayError:
        """The gateway's own answer for this failure, when no upstream answer passes through."""
        if self.code == SHUTDOWN:
            outcome = GATEWAY_ERROR
        elif self.code in (FIRST_TOKEN, TOTAL):
            outcome = TIMEOUT
        else:
            outcome = UPSTREAM_ERROR
        return GatewayError(self.status, self.message, self.code, outcome=outcome)


class StreamBroken(Exception):
    """A committed stream could not complete (cut, stalled, an event over the limit, an error
    event from the backend) and the
    answer so far could be continued elsewhere: the proxy decides whether it is, or ends the
    stream with this error event in the client's format."""

    def __init__(self, result: str, reason: str, outcome: str, message: str, code: str,
                 said: bytes = b"") -> None:
        super().__init__(message)
        self.result = result  # the attempt's result (upstream_attempts_total{result})
        self.reason, self.outcome, self.message, self.code = reason, outcome, message, code
        # What the upstream itself said to end it (its error event and what followed), held
        # back from the client: the stream ends with it if it is not continued.
        self.said = said

    def as_record(self) -> StreamBroken:
        """Plain data, as AttemptFailed.as_record: no frames kept."""
        self.__traceback__ = self.__context__ = self.__cause__ = None
        return self


class ClientGone(Exception):
    """The client went away while we wrote to it."""


class UpstreamUnreachable(Exception):
    """The upstream could not be connected to, or closed before its response headers; the
    message says which address and why, in words (transport/netdiag.py)."""


class UpstreamLost(Exception):
    """The upstream's connection was lost (reset, closed mid-chunk, timed out) in the middle
    of its response body."""


class UpstreamInvalid(Exception):
    """The upstream's response head cannot be read: not HTTP/1.1 (a body after a 204, a status
    line that does not parse) or, `too_large`, over the parser's limits. The message says
    which in words, quoting nothing the upstream sent."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


class ConfigError(Exception):
    """A config problem: names the key, the bad value and what was expected; when the value
    came from the environment, `source` names the variable (`SLOGATE_SERVER_PORT=eighty`)."""

    def __init__(self, key: str, value: Any, expected: str, source: str | None = None) -> None:
        self.key, self.value, self.expected, self.source = key, value, expected, source
        if source:
            super().__init__(f"config error: {source} ({key}): expected {expected}")
        else:
            super().__init__(f"config error: {key} = {value!r}: expected {expected}")


def deadline_failure(reason: str) -> AttemptFailed:
    """A deadline (or the drain) that fired before anything was committed to the client."""
    if reason == FIRST_TOKEN:
        return AttemptFailed(reason, 504, "The upstream sent no token before the first-token "
                             "deadline.", reason)
    if reason == TOTAL:
        return AttemptFailed(reason, 504, "The request ran past its total deadline.", reason,
                             retryable=False)
    if reason == ATTEMPT_HEDGE_LOST:
        return AttemptFailed(reason, 502, "Another attempt had the first token first.", reason,
                             judges_backend=False)
    return AttemptFailed(reason, 503, "The gateway is shutting down.", reason, retryable=False,
                         judges_backend=False)


# -- the trust boundary's limits on what an upstream sends ----------------------------------

class EventTooLarge(Exception):
    """An upstream SSE event (or what was held before the first token) is over the limit."""

    def __init__(self, size: int, limit: int, what: str = "event") -> None:
        super().__init__(f"The upstream sent an {what} of more than {limit} bytes "
                         f"({size} so far).")
        self.size = size
        self.limit = limit


class ResponseTooLarge(Exception):
    """A non-streamed upstream body (decompressed) is over the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"The upstream's response is larger than {limit} bytes.")
        self.limit = limit


class ListenError(Exception):
    """The listening socket could not be opened (the message says where and why)."""


class StaleState(Exception):
    """Shared admission state changed while a call waited for its turn: the call must not go
    to Redis."""
