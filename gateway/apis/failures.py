"""What an upstream's error says, read from its words rather than its status alone.

A 400 is usually the request's own fault and must pass through untouched (rerouting a
content-policy refusal would be wrong, and it says nothing about the backend's health). One
kind of 400 is different: a prompt too long for this model's context may fit a larger model,
so it can go to the model's `[fallbacks.context_length]`. Each provider says it in its own
words; the phrasings below are the ones their servers send (OpenAI and Groq's
`context_length_exceeded`, vLLM's and SGLang's "maximum context length" / "context length",
llama.cpp's `exceed_context_size_error`, Anthropic's "prompt is too long" and "exceed context
limit").

An error event that arrives in a 200 stream before any token is an attempt that failed: an
overload or a server error goes elsewhere; a request error in band is the request's own.
"""
from __future__ import annotations

import re

from gateway.errors import ATTEMPT_CONTEXT_LENGTH

CONTEXT_LENGTH = ATTEMPT_CONTEXT_LENGTH  # too long for this model: a larger one may serve it
REQUEST_ERROR = "request_error"  # the request's own fault: never rerouted, never judges
BACKEND_ERROR = "backend_error"  # the backend's trouble: fail over, and the breaker hears it

# Only the head of a body is read: the phrasings come first in every provider's error.
_SCAN_BYTES = 4096
_CONTEXT = re.compile(
    rb"context_length_exceeded|maximum context length|context length|exceed_context_size"
    rb"|available context size|prompt is too long|exceed context limit|context window",
    re.IGNORECASE)
# In-band error types that are the request's fault (OpenAI/vLLM class-like or snake-case
# types, Anthropic's invalid_request_error): another replica would say the same.
_REQUEST = re.compile(
    rb"invalid_request|BadRequest|\"code\"\s*:\s*4(?!08|09|29)\d\d\b|not_found|permission"
    rb"|authentication", re.IGNORECASE)


def http_error(body: bytes) -> str:
    """The meaning of a 4xx answer (not one of the retried statuses)."""
    head = body[:_SCAN_BYTES]
    return CONTEXT_LENGTH if _CONTEXT.search(head) else REQUEST_ERROR


def in_band_error(event: bytes) -> str:
    """The meaning of an error event that came before any token on a 200 stream."""
    head = event[:_SCAN_BYTES]
    if _CONTEXT.search(head):
        return CONTEXT_LENGTH
    return REQUEST_ERROR if _REQUEST.search(head) else BACKEND_ERROR


def request_error_type(error_type: str | None) -> bool:
    """Does an in-band error's type (as the exchange keeps it) say it was the request's own
    fault (`invalid_request_error`, vLLM's `BadRequestError`)?"""
    return error_type is not None and _REQUEST.search(error_type.encode()) is not None
