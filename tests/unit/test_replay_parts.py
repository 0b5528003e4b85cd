"""The pieces of `slogate replay` / `bench` that need no processes: trace lines of both formats,
--set / --alt, the replay gateway's config and keys, the knee per class."""
from __future__ import annotations

import hashlib

import pytest

from gateway.ops import bench, replay

ACCESS = {"t": 100.5, "request_id": "a", "route": "/v1/chat/completions", "model": "m",
          "stream": True, "status": 200, "outcome": "ok", "tenant": "team-a",
          "slo_class": "chat", "verdict": "met", "ms": {"ttft": 41.0, "e2e": 600.0},
          "prompt_tokens": 900, "completion_tokens": 64, "body_bytes": 4000}
RECORDER = {"t": 101.0, "request_id": "b", "tenant": "team-b", "slo_class": "batch",
            "model": "m", "route": "/v1/chat/completions", "stream": False,
            "prompt_tokens": None, "estimated_prompt_tokens": 300, "max_tokens": 50,
            "completion_tokens": None, "admission": {"decision": "rejected"}, "status": 429,
            "outcome": "rejected", "ttft_ms": None, "tpot_ms": None, "verdict": None}


def test_both_trace_formats() -> None:
    a = replay.parse_line(ACCESS)
    b = replay.parse_line(RECORDER)
    assert a is not None and b is not None
    assert (a[0].prompt_tokens, a[0].output_tokens, a[0].tenant, a[0].stream) == \
        (900, 64, "team-a", True)
    assert (a[1].ttft_ms, a[1].e2e_ms, a[1].refused) == (41.0, 600.0, False)
    assert (b[0].prompt_tokens, b[0].output_tokens, b[0].stream) == (300, 50, False)
    assert b[1].refused and b[1].ttft_ms is None
    # refused before any usage: the body size stands in for the prompt
    c = replay.parse_line({**ACCESS, "prompt_tokens": None, "completion_tokens": None})
    assert c is not None and (c[0].prompt_tokens, c[0].output_tokens) == (1000, 128)
    assert replay.parse_line({k: v for k, v in ACCESS.items() if k != "t"}) is None


def test_summary_counts_goodput_per_second_of_the_window() -> None:
    a, b = replay.parse_line(ACCESS), replay.parse_line(RECORDER)
    assert a is not None and b is not None
    s = replay.summarize([a[1], b[1]], window_s=2.0)
    assert (s["met"], s["requests"], s["goodput_rps"], s["refused"]) == (1, 2, 0.5, 1)
    assert s["classes"]["chat"]["ttft_p99_ms"] == 41.0
    assert s["classes"]["batch"]["goodput_rps"] == 0.0


def test_sets_and_alts() -> None:
    assert replay.parse_alt("cap8: admission.max_concurrency=8, admission.safety=1.2") == \
        ("cap8", [("admission.max_concurrency", 8), ("admission.safety", 1.2)])
    assert replay.parse_sets(["slo.default=chat"]) == [("slo.default", "chat")]
    with pytest.raises(ValueError):
        replay.parse_alt("no colon here")
    with pytest.raises(ValueError):
        replay.parse_sets(["admission.enabled"])
    raw = {"backends": [{"name": "sim"}], "slo_classes": [{"name": "chat", "ttft_ms": 1}]}
    replay.apply_set(raw, "slo_classes.chat.ttft_ms", 500)
    replay.apply_set(raw, "backends.sim.max_concurrency", 4)
    replay.apply_set(raw, "admission.enabled", True)
    assert raw["slo_classes"][0]["ttft_ms"] == 500 and raw["backends"][0]["max_concurrency"] == 4
    assert raw["admission"] == {"enabled": True}
    with pytest.raises(ValueError, match="no entry named"):
        replay.apply_set(raw, "backends.nope.pool_size", 1)


def test_replay_gateway_config_gets_throwaway_keys_and_the_simulator() -> None:
    raw = {"server": {"port": 80}, "auth": {"mode": "keys", "keys": [
        {"tenant": "team-a", "sha256": "0" * 64}, {"tenant": "team-b", "sha256": "1" * 64}]},
        "admission": {"redis_url": "redis://prod:6379"},
        "backends": [{"name": "sim", "base_url": "http://prod/v1"}]}
    cfg, keys = replay.gateway_config(raw, 9999, {"sim": "http://127.0.0.1:1/v1"},
                                      [("admission.max_concurrency", 8)])
    assert set(keys) == {"team-a", "team-b"}
    assert [k["sha256"] for k in cfg["auth"]["keys"]] == \
        [hashlib.sha256(keys[t].encode()).hexdigest() for t in ("team-a", "team-b")]
    assert cfg["server"]["port"] == 9999 and cfg["server"]["access_log_format"] == "json"
    assert cfg["admission"] == {"redis_url": "", "max_concurrency": 8}
    assert cfg["backends"][0] == {"name": "sim", "base_url": "http://127.0.0.1:1/v1",
                                  "forward_headers": ["x-sim-*"]}
    assert raw["server"]["port"] == 80  # the operator's config is not changed


def _point(met: int, n: int) -> dict[str, object]:
    return {"goodput_rps": met / 2, "e2e_mean_ms": 800.0,
            "classes": {"chat": {"requests": n, "met": met, "goodput_rps": met / 2,
                                 "ttft_p99_ms": 100.0, "refused": 0}}}


def test_knee_is_the_last_load_where_targets_held() -> None:
    points = [(0.5, _point(10, 10)), (1.0, _point(19, 20)), (2.0, _point(10, 40))]
    assert bench.knees(points, ["chat"]) == {"chat": 1.0}
    advice = bench.recommend(points, ["chat"], 10.0, {"chat": (300.0, 40.0)})
    assert "feasible up to 1x capacity (10.0 req/s offered)" in advice[0]
    assert "max_concurrency = 8" in advice[1]  # 9.5 req/s x 0.8 s
    assert bench.knees([(0.5, _point(1, 10))], ["chat"]) == {"chat": None}
