"""Config validation: errors name the key, the value and what was expected."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gateway import config
from gateway.apis import PROVIDERS

BACKEND = {"name": "a", "base_url": "http://127.0.0.1:8000/v1"}
OPEN = {"mode": "open"}


def test_minimal_config_defaults() -> None:
    cfg = config.parse({"backends": [BACKEND], "auth": OPEN})
    assert cfg.server.port == 8080 and cfg.server.commit == "first_token"
    b = cfg.backends[0]
    assert b.type == "openai" and b.models == ("*",) and b.pool_size == 4096
    assert b.api_key_env is None and not b.forward_client_auth


@pytest.mark.parametrize("raw,key,fragment", [
    ({}, "backends", "at least one"),
    ({"backends": [BACKEND], "sever": {}}, "sever", "sections"),
    ({"server": {"port": "80"}, "backends": [BACKEND]}, "server.port", "integer port"),
    ({"server": {"port": 70000}, "backends": [BACKEND]}, "server.port", "integer port"),
    ({"server": {"commit": "never"}, "backends": [BACKEND]}, "server.commit", "first_token"),
    ({"server": {"access_log_format": "xml"}, "backends": [BACKEND]}, "server.access_log_format",
     "\"json\" or \"text\""),
    ({"server": {"hots": "x"}, "backends": [BACKEND]}, "server.hots", "one of the keys"),
    ({"backends": [{"name": "a", "base_url": "localhost:8000"}]}, "backends[0].base_url",
     "http(s) URL"),
    ({"backends": [{**BACKEND, "type": "grpc"}]}, "backends[0].type", "one of"),
    ({"backends": [{**BACKEND, "models": []}]}, "backends[0].models", "list of model names"),
    ({"backends": [{**BACKEND, "pool_size": 0}]}, "backends[0].pool_size", "positive"),
    ({"backends": [{**BACKEND, "aliases": {"x": 1}}]}, "backends[0].aliases", "table"),
    ({"backends": [BACKEND, BACKEND]}, "backends[1].name", "not used by another"),
])
def test_errors_name_key_value_and_expectation(raw, key, fragment) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, providers=PROVIDERS)
    assert e.value.key == key
    assert fragment in str(e.value)
    assert key in str(e.value)


@pytest.mark.parametrize("raw,key,hint", [
    ({"backends": [BACKEND], "sever": {}}, "sever", "did you mean 'server'?"),
    ({"server": {"prot": 80}, "backends": [BACKEND]}, "server.prot", "did you mean 'port'?"),
    ({"backends": [{**BACKEND, "modles": ["m"]}]}, "backends[0].modles",
     "did you mean 'models'?"),
    ({"server": {"zzz": 1}, "backends": [BACKEND]}, "server.zzz", None),
])
def test_a_mistyped_key_gets_a_did_you_mean(raw, key, hint) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw)
    assert e.value.key == key
    assert (hint in str(e.value)) if hint else "did you mean" not in str(e.value)


def test_environment_overrides() -> None:
    env = {"SLOGATE_SERVER_PORT": "9001", "SLOGATE_SERVER_COMMIT": "headers",
           "SLOGATE_BACKEND_VLLM_A_BASE_URL": "http://10.1.2.3:8000/v1",
           "SLOGATE_BACKEND_VLLM_A_MODELS": '["llama"]'}
    cfg = config.parse({"backends": [{"name": "vllm-a", "base_url": "http://x:1/v1"}],
                       "auth": OPEN}, env)
    assert cfg.server.port == 9001 and cfg.server.commit == "headers"
    assert cfg.backends[0].base_url == "http://10.1.2.3:8000/v1"
    assert cfg.backends[0].models == ("llama",)


def test_api_key_comes_from_the_named_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY_FOR_TEST", "sk-secret")
    cfg = config.parse({"backends": [{**BACKEND, "api_key_env": "UPSTREAM_KEY_FOR_TEST"}],
                       "auth": OPEN})
    assert cfg.backends[0].api_key() == "sk-secret"
    assert "sk-secret" not in repr(cfg)


def test_serve_with_bad_config_exits_nonzero(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[server]\nport = "eighty"\n[[backends]]\nname="a"\nbase_url="http://x/v1"\n')
    proc = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "server.port" in proc.stderr and "'eighty'" in proc.stderr


@pytest.mark.parametrize("auth,key,fragment", [
    (None, "auth", 'mode = "open"'),
    ({"mode": "closed"}, "auth.mode", '"keys"'),
    ({"mode": "keys"}, "auth.keys", "at least one"),
    ({"mode": "keys", "keys": [{"tenant": "t", "sha256": "sk-live-123"}]}, "auth.keys[0].sha256",
     "sha256"),
])
def test_auth_must_be_explicit(auth, key, fragment) -> None:
    raw = {"backends": [BACKEND]}
    if auth is not None:
        raw["auth"] = auth
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw)
    assert e.value.key == key and fragment in str(e.value)
    assert "sk-live-123" not in str(e.value)  # a pasted key is never echoed


def test_example_config_is_valid() -> None:
    from pathlib import Path

    import gateway

    cfg = config.load(str(Path(gateway.__file__).parent / "examples" / "sim.toml"), env={})
    assert cfg.backends[0].name == "sim"



def test_verdicts() -> None:
    from gateway.config import SLOClass, SLOTarget
    from gateway.errors import OK
    from gateway.exchange import Exchange
    from gateway.request.slo import verdict

    def ctx(stream: bool, ttft_ms: float, tpot_ms: float, n: int, e2e_ms: float) -> Exchange:
        c = Exchange("/v1/chat/completions")
        c.stream, c.outcome = stream, OK
        t0 = c.t_received
        c.t_first_token = t0 + int(ttft_ms * 1e6)
        c.t_last_token = c.t_first_token + int(tpot_ms * (n - 1) * 1e6)
        c.completion_tokens = n
        c.t_end = t0 + int(e2e_ms * 1e6)
        return c

    cls = SLOClass("i", ttft_ms=500, tpot_ms=50, e2e_ms=None)
    t = SLOTarget(cls, 500, 50, None)
    assert verdict(ctx(True, 400, 40, 10, 900), t) == "met"
    assert verdict(ctx(True, 600, 40, 10, 900), t) == "ttft_missed"
    assert verdict(ctx(True, 400, 60, 10, 900), t) == "tpot_missed"
    assert verdict(ctx(True, 600, 60, 10, 900), t) == "both_missed"
    assert verdict(ctx(True, 400, 999, 1, 900), t) == "met"  # one token: no TPOT
    with_e2e = SLOTarget(cls, 500, 50, 2000)
    assert verdict(ctx(True, 400, 40, 10, 2500), with_e2e) == "e2e_missed"
    assert verdict(ctx(False, 1500, 0, 1, 1500), with_e2e) == "met"  # judged on e2e only
    assert verdict(ctx(False, 1500, 0, 1, 1500), t) == "ttft_missed"
    failed = ctx(True, 400, 40, 10, 900)
    failed.outcome = "upstream_error"
    assert verdict(failed, t) == "failed"


def test_backend_env_overrides_pick_the_longest_matching_name() -> None:
    raw = {"auth": {"mode": "open"}, "backends": [
        {"name": "vllm", "base_url": "http://a:1/v1"},
        {"name": "vllm-a", "base_url": "http://b:1/v1"}]}
    cfg = config.parse(raw, {"SLOGATE_BACKEND_VLLM_A_BASE_URL": "http://c:1/v1",
                             "SLOGATE_BACKEND_VLLM_POOL_SIZE": "7"})
    assert cfg.backends[0].base_url == "http://a:1/v1" and cfg.backends[0].pool_size == 7
    assert cfg.backends[1].base_url == "http://c:1/v1" and cfg.backends[1].pool_size == 4096
