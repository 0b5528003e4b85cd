"""`slogate serve --config gateway/examples/sim.toml`, the example a new user runs first, writes
one short readable line per request to the terminal, not the JSON record."""
from __future__ import annotations

import re
from pathlib import Path

from openai import AsyncOpenAI, NotFoundError

from tests.support.procs import slogate
from tests.support.waiting import wait_until

SIM_TOML = str(Path(__file__).resolve().parents[2] / "gateway" / "examples" / "sim.toml")
LINE = re.compile(r"^\d\d:\d\d:\d\d 200 ok /v1/chat/completions sim-llama-8b@sim "
                  r"ttft=\d+ms e2e=\d+ms \d+\+5 tok$")


async def test_the_sim_example_logs_one_short_line_per_request() -> None:
    async with slogate("sim", "--served-model-name", "sim-llama-8b",
                       ready_path="/health") as sim, \
            slogate("serve", "--config", SIM_TOML, ready_path="/readyz",
                    env={"SLOGATE_BACKEND_SIM_BASE_URL": sim.url + "/v1"}) as gw:
        client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="any", max_retries=0)
        stream = await client.chat.completions.create(
            model="sim-llama-8b", stream=True, max_tokens=5,
            messages=[{"role": "user", "content": "hello"}])
        async for _ in stream:
            pass
        try:
            await client.chat.completions.create(model="nope\x1b[31m", messages=[])
        except NotFoundError:
            pass
        await client.close()
        lines = await wait_until(
            lambda: [x for x in gw.log_text().splitlines() if "/v1/chat/completions" in x][1:],
            what=gw.log_text)
        text = gw.log_text()
    ok = next(x for x in text.splitlines() if " 200 ok " in x)
    assert LINE.match(ok), ok
    refused = next(x for x in text.splitlines() if " 404 " in x)
    assert " 404 model_not_found /v1/chat/completions nope?[31m@- " in refused, refused
    assert "\x1b" not in text  # a client's model name never reaches the terminal raw
    assert all(len(x) <= 120 for x in lines)
    assert not any(x.startswith("{") for x in text.splitlines())
