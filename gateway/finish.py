"""Finish: everything produced from the finished context (now the JSON access log line)."""
from __future__ import annotations

import logging

import orjson

from gateway.context import RequestContext

access_log = logging.getLogger("slogate.access")


def finish(ctx: RequestContext) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info(orjson.dumps(ctx.log_record()).decode())
