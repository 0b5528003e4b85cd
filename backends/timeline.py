"""What every stream observer writes into the request's timeline, and the one JSON parse each
observer needs: shared so that all formats stamp events and tokens the same way."""
from __future__ import annotations

from typing import Any

import orjson

from gateway.context import RequestContext


def json_object(data: bytes) -> dict[str, Any] | None:
    """The JSON object in `data`, or None for anything else (not ours to judge: the client
    decides what to do with it)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def event_seen(ctx: RequestContext, t: int) -> None:
    ctx.events += 1
    if not ctx.t_first_event:
        ctx.t_first_event = t


def token_seen(ctx: RequestContext, t: int, visible: bool) -> None:
    """An event carrying model output at `t`; `visible` when it is user-visible text."""
    ctx.token_events += 1
    ctx.token_ns.append(t)
    ctx.t_last_token = t
    if not ctx.t_first_token:
        ctx.t_first_token = t
    if visible and not ctx.t_first_visible:
        ctx.t_first_visible = t
