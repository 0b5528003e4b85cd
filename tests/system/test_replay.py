"""`slogate replay` reproduces a recorded run: a seeded open-loop load is driven through a
gateway with its JSON access log on (the recording), then replayed from that log under the same
config against a fresh simulator; the goodput must come out within 10 %. The class's TTFT target
splits the prompt lengths (short prompts meet it by a margin, long ones miss it by one: a busy
machine's jitter does not move a request across it), so a replay that got the prompt lengths
wrong gets a different goodput, and one that got the output lengths or arrival times wrong a
different TTFT (the gateway's access log says)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gateway.ops import loadgen, replay
from tests.support.procs import sim_and_gateway
from tests.support.waiting import wait_until

# The heaviest load tests run one after another on one xdist worker (`--dist loadgroup`),
# so two of them never share the 2 cores and each keeps its timing margins.
pytestmark = pytest.mark.xdist_group("heavy-load")

SIM_ARGS = ("--max-batch", "8", "--prefill-tokens-per-s", "20000", "--decode-base-ms", "8")
CONFIG = """
[server]
access_log = true
access_log_format = "json"
[auth]
mode = "keys"
[[auth.keys]]
tenant = "team-a"
sha256 = "%s"
classes = ["tight"]
[[slo_classes]]
name = "tight"
ttft_ms = 60
tpot_ms = 40
[slo]
default = "tight"
[[backends]]
name = "sim"
base_url = "SIM_URL/v1"
models = ["*"]
forward_headers = ["x-sim-*"]
"""


async def test_replay_reproduces_recorded_goodput() -> None:
    import hashlib

    cfg_text = CONFIG % hashlib.sha256(b"key-a").hexdigest()
    # 48 arrivals: half short prompts (5-20 ms of prefill), half long (70-85 ms). A short one
    # that lands during a long one's prefill misses too, by how much depends on the overlap to
    # the ms: at 3 /s (not 6) fewer land there, and two flipped by jitter no longer make 10 %.
    plan = loadgen.poisson(3.0, 16.0, seed=7, prompt=(100, 400), output=(16, 64))
    plan = [loadgen.Planned(p.t, p.prompt_tokens + (1300 if i % 2 else 0), p.output_tokens, None,
                            "team-a") for i, p in enumerate(plan)]
    async with sim_and_gateway(SIM_ARGS, cfg_text) as (_, gw):
        sent = await loadgen.send_open(f"{gw.url}/v1/chat/completions", plan,
                                       {"team-a": "key-a"})
        assert all(s.status == 200 for s in sent), [s.status for s in sent]
        # every request's access-log line has reached the file
        trace = Path(tempfile.mkstemp(suffix=".jsonl")[1])

        def logged() -> bool:
            trace.write_text(gw.log_text())
            return len(replay.load_trace(str(trace))[1]) >= len(plan)
        await wait_until(logged, what="the access log's lines")
    _, recorded = replay.load_trace(str(trace))
    want = replay.summarize(recorded)
    assert len(recorded) == len(plan)
    assert 0.3 < want["met"] / want["requests"] < 0.7, want  # the target splits the mix
    cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
    cfg.write_text(cfg_text.replace("SIM_URL", "http://127.0.0.1:1"))
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "gateway", "replay", str(trace),
                         "--config", str(cfg), "--sim-args", " ".join(SIM_ARGS),
                         "--alt", "cap1: admission.enabled=true,admission.max_concurrency=1",
                         "--json", str(out)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "| goodput req/s |" in proc.stdout and "cap1" in proc.stdout
    cur = got["current"]
    assert cur["requests"] == len(plan)
    assert abs(cur["goodput_rps"] - want["goodput_rps"]) <= 0.1 * want["goodput_rps"], \
        (cur, want)
    for f in (trace, cfg, out):
        f.unlink()
