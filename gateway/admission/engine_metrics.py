"""An engine's own view of its load, for engines shared with clients the gateway cannot see:
`vllm:num_requests_waiting` / `vllm:num_requests_running` (SGLang: `sglang:num_queue_reqs` /
`sglang:num_running_reqs`) scraped from its Prometheus endpoint in the background."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from gateway.errors import ResponseTooLarge, UpstreamLost, UpstreamUnreachable
from gateway.transport.client import fetch

log = logging.getLogger("slogate.admission")

MAX_METRICS_BYTES = 4 * 1024 * 1024
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def parse(text: str) -> dict[str, float]:
    """Sum each gauge of interest over its label sets (several models or engines)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, names in (("waiting", WAITING), ("running", RUNNING), ("kv_usage", KV_USAGE)):
            if name in names:
                try:
                    value = float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    continue
                out[key] = max(out.get(key, 0.0), value) if key == "kv_usage" \
                    else out.get(key, 0.0) + value
    return out


def metrics_url(base_url: str) -> str:
    """/metrics lives on the server root, not under /v1 (vLLM, SGLang)."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/metrics"


async def scrape_forever(session: aiohttp.ClientSession, base_url: str, interval_s: float,
                         report: Callable[[dict[str, float]], None]) -> None:
    url = metrics_url(base_url)
    failing = False
    while True:
        try:
            # bounded: an engine's /metrics is tens of KiB
            status, body = await fetch(session, url, max(0.5, interval_s), MAX_METRICS_BYTES)
            if status == 200:
                report(parse(body.decode("utf-8", "replace")))  # the exposition format is UTF-8
                failing = False
            elif not failing:
                log.warning("engine metrics %s answered %d", url, status)
                failing = True
        except (UpstreamUnreachable, UpstreamLost, ResponseTooLarge) as e:
            if not failing:
                log.warning("engine metrics %s unreachable: %s", url, e)
                failing = True
        await asyncio.sleep(interval_s)
