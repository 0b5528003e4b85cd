"""The load generator of `slogate replay` and `slogate bench`: planned requests (arrival offset,
prompt and output length, SLO class, tenant) sent open loop at their offsets through a gateway,
each as its tenant, with a synthetic prompt of the planned token count and the output length
forced on the simulator (`x-sim-output-tokens`). What a request cost and whether it met its SLO
is read from the gateway's own access log, not judged here: the client keeps only what the
gateway cannot know (whether the request was sent on time, and its status)."""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

_FILL = b"the quick brown fox jumps over the lazy dog while the engine keeps its batch full "


@dataclass(frozen=True)
class Planned:
    """One request to send: `t` seconds after the start."""

    t: float
    prompt_tokens: int
    output_tokens: int
    slo_class: str | None = None
    tenant: str | None = None
    model: str = "sim"
    stream: bool = True


@dataclass
class Sent:
    planned: Planned
    status: int = 0  # 0: no answer (connection failed, or cut off at the end)
    request_id: str | None = None
    lag_s: float = 0.0  # how late it was sent (the client's own overload shows here)


def prompt_text(i: int, tokens: int, bytes_per_token: int = 4) -> str:
    """A prompt the simulator counts as `tokens` tokens (its tokens are content bytes /
    bytes_per_token); the leading number keeps prompts apart for a prefix cache."""
    n = max(1, tokens) * bytes_per_token
    head = f"req {i}: ".encode()
    return (head + _FILL * (n // len(_FILL) + 2))[:n].decode()


def poisson(rate: float, seconds: float, seed: int, prompt: tuple[int, int] = (150, 250),
            output: tuple[int, int] = (32, 160),
            classes: Mapping[str, float] | None = None) -> list[Planned]:
    """A seeded open-loop Poisson schedule: round(rate * seconds) arrivals at sorted uniform
    times (a Poisson process conditioned on its count), uniform prompt and output lengths, the
    classes drawn by their shares."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, seconds) for _ in range(int(round(rate * seconds))))
    names = list(classes or {})
    weights = list((classes or {}).values())
    return [Planned(t, rng.randint(*prompt), rng.randint(*output),
                    rng.choices(names, weights)[0] if names else None) for t in times]


async def send_open(url: str, plan: Sequence[Planned], keys: Mapping[str | None, str],
                    speed: float = 1.0, bytes_per_token: int = 4,
                    tail_s: float = 60.0) -> list[Sent]:
    """POST each planned request to `url` (a chat completions URL) at t / speed seconds from
    now, as its tenant (`keys[tenant]`, else `keys[None]`); drain every answer. Requests still
    open `tail_s` after the last arrival are cancelled (status 0)."""
    import aiohttp

    sent = [Sent(p) for p in plan]
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
    t0 = time.monotonic() + 0.1

    async def one(i: int, s: Sent) -> None:
        p = s.planned
        delay = t0 + p.t / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        s.lag_s = max(0.0, time.monotonic() - t0 - p.t / speed)
        body = {"model": p.model, "stream": p.stream, "max_tokens": p.output_tokens,
                "messages": [{"role": "user",
                              "content": prompt_text(i, p.prompt_tokens, bytes_per_token)}]}
        if p.stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Content-Type": "application/json",
                   "Authorization": f"Bearer {keys.get(p.tenant, keys.get(None, 'replay'))}",
                   "x-sim-output-tokens": str(p.output_tokens)}
        if p.slo_class:
            headers["x-slo-class"] = p.slo_class
        try:
            async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
                s.request_id = resp.headers.get("x-slogate-request-id")
                async for _ in resp.content.iter_any():
                    pass
                s.status = resp.status
        except (aiohttp.ClientError, OSError):
            s.status = 0

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(sent)]
    last = max((p.t for p in plan), default=0.0) / speed
    try:
        await asyncio.wait(tasks, timeout=max(0.0, t0 - time.monotonic()) + last + tail_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
    return sent


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
