"""The flight recorder over real sockets: a gateway in front of the simulator with a TTFT target
the engine cannot meet for a long prompt, driven by the openai SDK until admission refuses one
(429). GET /admin/decisions (admin key) then explains the refusal — its reason and each
replica's predicted TTFT — a tenant's key is refused there, the console's snapshot says why in
a sentence, and the JSON-lines file holds the same record once the gateway has stopped."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.edge.auth import hash_key
from gateway.ops.server import build_app
from tests.support.servers import serve_app

ADMIN = {"Authorization": "Bearer adm"}


def gateway_config(sim: str, path: Path) -> config.Config:
    return config.parse({
        "auth": {"mode": "keys", "keys": [{"tenant": "acme", "sha256": hash_key("k-acme")}],
                 "admin_keys": [{"sha256": hash_key("adm")}]},
        "server": {"access_log": False},
        "admission": {"enabled": True},
        "slo_classes": [{"name": "tight", "ttft_ms": 30, "tpot_ms": 1000}],
        "slo": {"default": "tight"},
        "recorder": {"path": str(path)},
        "backends": [{"name": "sim", "base_url": sim + "/v1", "models": ["m"]}]}, env={})


async def decisions(s: aiohttp.ClientSession, base: str, query: str = "",
                    headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with s.get(base + "/admin/decisions" + query,
                     headers=ADMIN if headers is None else headers) as r:
        return r.status, await r.json()


async def test_a_refusal_is_explained_at_admin_decisions_and_in_the_console(
        tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    # ~2,000 prompt tokens at 20,000 tokens/s: ~0.1 s of prefill against a 30 ms TTFT target
    sim_app = build_sim(SimConfig(prefill_tokens_per_s=20_000, decode_base_ms=2))
    async with serve_app(sim_app) as sim:
        app = build_app(gateway_config(sim, path))
        async with serve_app(app) as base, aiohttp.ClientSession() as s:
            client = AsyncOpenAI(base_url=base + "/v1", api_key="k-acme", max_retries=0)
            refusal = None
            for _ in range(30):  # the estimator learns the prefill; then the next is refused
                try:
                    stream = await client.chat.completions.create(
                        model="m", stream=True, max_tokens=4,
                        messages=[{"role": "user", "content": "x" * 8000}])
                    async for _chunk in stream:
                        pass
                except openai.RateLimitError as e:
                    refusal = e
                    break
            assert refusal is not None, "admission never refused"
            refused_id = refusal.response.headers["x-slogate-request-id"]
            assert refusal.response.headers["x-slogate-admission"] == "ttft_infeasible"

            status, body = await decisions(s, base, "?outcome=rejected&limit=5")
            assert status == 200
            rec = body["decisions"][0]  # newest first
            assert rec["request_id"] == refused_id and rec["status"] == 429
            assert (rec["tenant"], rec["slo_class"], rec["model"]) == ("acme", "tight", "m")
            assert rec["max_tokens"] == 4 and rec["estimated_prompt_tokens"] > 100
            adm = rec["admission"]
            assert (adm["decision"], adm["reason"], adm["chosen"]) == ("rejected",
                                                                       "ttft_infeasible", None)
            [cand] = adm["candidates"]
            assert cand["replica"] == "sim" and cand["why"] == "ttft_wait"
            assert cand["predicted_ttft_ms"] > 30 and cand["limit"] >= 1
            assert "x" * 20 not in orjson.dumps(body).decode()  # no prompt text

            # the requests served before it: admitted, on sim, with their TTFT
            _, served = await decisions(s, base, "?outcome=ok")
            assert served["decisions"], served
            ok = served["decisions"][-1]
            assert ok["admission"]["chosen"] == "sim" and ok["ttft_ms"] > 0
            assert ok["attempts"][-1] == {"backend": "sim", "result": "ok",
                                          "ms": ok["attempts"][-1]["ms"]}
            assert body["recorder"]["file"]["path"] == str(path)

            # a tenant's key is not an admin key; no key is none
            assert (await decisions(s, base, headers={"Authorization": "Bearer k-acme"}))[0] \
                in (401, 403)
            assert (await decisions(s, base, headers={}))[0] == 401
            assert (await decisions(s, base, "?limit=100000"))[0] == 400
            assert (await decisions(s, base, "?slo_class=none"))[1]["decisions"] == []

            async with s.get(base + "/console/state") as r:
                snap = await r.json()
            why = next(row for row in snap["explained"] if row["request_id"] == refused_id)
            assert why["why"].startswith("refused: ttft_infeasible; best predicted TTFT ")
            assert "on sim against a 30 ms target" in why["why"]
    ids = {orjson.loads(line)["request_id"] for line in path.read_bytes().splitlines()}
    assert refused_id in ids and {d["request_id"] for d in served["decisions"]} <= ids
