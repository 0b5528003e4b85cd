"""Ingress: read the client's request and pull out the few fields the gateway needs."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from gateway.edge import limits
from gateway.errors import GatewayError


async def read_body(request: web.Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, within `limit` bytes and `timeout_s` seconds (a client that sends its
    headers and then trickles or withholds the body holds a connection and a task: 408)."""
    length = request.content_length
    content = request.content
    if length is not None and length <= limit and content.is_eof():
        # The whole body came with the headers (the common case): no timer, no iteration.
        return content.read_nowait(-1)
    if not timeout_s:
        return await _read_body(request, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise GatewayError(408, f"The request body did not arrive within {timeout_s:g} s.",
                           limits.BODY_TIMEOUT, headers={"Connection": "close"}) from None


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise GatewayError(413, f"Request body of {length} bytes exceeds the limit of "
                           f"{limit} bytes.", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"Request body exceeds the limit of {limit} bytes.",
                               "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise GatewayError(400, "The request body is empty; expected a JSON object.",
                           "invalid_json")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise GatewayError(400, f"The request body is not valid JSON: {e}.",
                           "invalid_json") from None
    if not isinstance(obj, dict):
        raise GatewayError(400, "The request body must be a JSON object.", "invalid_json")
    return obj


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "The request must name a model: 'model' is missing or not a "
                           "string.", "missing_model", param="model")
    return limits.check_name(model, "model")


def stream_of(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be a boolean.", "invalid_type", param="stream")
    return stream


def max_output_tokens(body: dict[str, Any]) -> int | None:
    """The output the request asks for at most (for the tenant's token reservation), or
    None when it does not say."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
