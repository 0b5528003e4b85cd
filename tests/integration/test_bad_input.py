"""Bad input never takes the gateway down or touches another request's stream."""
from __future__ import annotations

import asyncio
import random
import re

import aiohttp
import orjson

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.ops.server import build_app
from tests.support.servers import serve_app

GOOD = {"model": "m", "stream": True, "max_tokens": 30, "seed": 3,
        "messages": [{"role": "user", "content": "tell me something"}]}


def normalized(stream: bytes) -> bytes:
    """The stream without what differs per request (ids, timestamps)."""
    return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", stream)


def garbage(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    choices = [
        (b"{", {}),
        (b"\xff\xfe\x00not json", {}),
        (b"[" * 5000 + b"]" * 5000, {}),  # deeply nested
        (orjson.dumps({"model": 7}), {}),
        (orjson.dumps({"model": "m", "stream": "sometimes"}), {}),
        (orjson.dumps({"model": "m", "messages": "not a list", "stream": True}), {}),
        (orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user",
                                                                  "content": "x"}]}),
         {"x-slo-class": "platinum"}),
        (orjson.dumps({**GOOD}), {"x-slogate-timeout-total-ms": "-5"}),
        (orjson.dumps({**GOOD}), {"x-sim-status": "418"}),
        (b"x" * 3_000_000, {}),  # over the body limit
        (orjson.dumps({"model": "no-such-model"}), {}),
    ]
    return rng.choice(choices)


async def test_garbage_alongside_good_streams() -> None:
    async with serve_app(build_sim(SimConfig(decode_base_ms=3, decode_per_seq_ms=0))) as sim:
        cfg = config.parse({"auth": {"mode": "open"},
                            "server": {"access_log": False, "max_body_bytes": 1_000_000},
                            "backends": [{"name": "s", "base_url": sim + "/v1",
                                          "models": ["m"], "forward_headers": ["x-sim-*"]}]},
                            env={})
        async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
            async with s.post(gw + "/v1/chat/completions", json=GOOD) as r:
                reference = normalized(await r.read())
            assert reference.count(b"data: ") == 33  # role, 30 tokens, finish, [DONE]

            async def good() -> bytes:
                async with s.post(gw + "/v1/chat/completions", json=GOOD) as r:
                    assert r.status == 200
                    return normalized(await r.read())

            async def bad(i: int) -> int:
                body, headers = garbage(random.Random(i))
                async with s.post(gw + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json", **headers}) as r:
                    payload = await r.read()
                    if r.status >= 400:
                        err = orjson.loads(payload)["error"]  # always an OpenAI error object
                        assert err["message"]
                    return r.status

            async def abandon() -> None:  # clients that leave mid-stream
                async with s.post(gw + "/v1/chat/completions", json=GOOD) as r:
                    await r.content.readany()

            results = await asyncio.gather(*[good() for _ in range(10)],
                                           *[bad(i) for i in range(40)],
                                           *[abandon() for _ in range(5)])
            goods, statuses = results[:10], results[10:50]
            assert all(g == reference for g in goods)  # every one of them, whole and in order
            assert all(400 <= st < 500 for st in statuses), sorted(statuses)
            async with s.get(gw + "/healthz") as r:
                assert r.status == 200
            async with s.post(gw + "/v1/chat/completions", json=GOOD) as r:
                assert normalized(await r.read()) == reference  # and it keeps serving
