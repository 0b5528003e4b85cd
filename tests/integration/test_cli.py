"""The first hour: the `slogate` command and config, tried as a new user would.

Proves: --version; `check` prints the resolved config (env overrides applied, secrets as ***)
and exits 2 on an error that names the environment variable it came from; an unknown SLOGATE_*
variable is warned about (with a "did you mean"); [fallbacks] naming an unserved model is an
error; a port in use is one line and exit 2 for `serve` and `sim` (no traceback, no unclosed
session); help texts say what the config is and that hash-key reads stdin; every shipped
example loads; a known route with the wrong method is a 405 with Allow in the API's format; an
unreachable backend is named with its address and the cause; `make demo` prints the console
URL first and a progress line while it drives load; `make clean` removes what make created.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import pytest

from gateway import config
from gateway.apis import PROVIDERS
from gateway.edge.auth import AuthPolicy
from gateway.errors import GatewayError
from gateway.ops import cli
from gateway.ops.server import build_app
from gateway.request.slo import SLOPolicy
from gateway.transport.netdiag import describe_connect_error, describe_listen_error
from tests.support.prometheus_server import free_port
from tests.support.servers import serve_app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "gateway" / "examples").glob("*.toml"))
KEY_HASH = "97558b8c36b68cce8881012c851e2bac285a1516e0e1202fc944e9df2970548c"
CONFIG = f"""
[server]
port = 8080
[auth]
mode = "keys"
[[auth.keys]]
tenant = "team-a"
sha256 = "{KEY_HASH}"
[admission]
redis_url = "redis://:hunter2@redis:6379/0"
[[backends]]
name = "vllm-a"
base_url = "http://10.0.0.5:8000/v1"
models = ["llama"]
api_key_env = "SLOGATE_TEST_CLI_KEY"
"""


def slogate(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True,
                          text=True, input=stdin, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    p = tmp_path / "gw.toml"
    p.write_text(CONFIG)
    return p


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("slogate ") and out.split()[1][0].isdigit()


def test_check_prints_resolved_config_with_env_and_secrets_masked(cfg_file, capsys,
                                                                    monkeypatch) -> None:
    monkeypatch.setenv("SLOGATE_SERVER_PORT", "9001")
    monkeypatch.setenv("SLOGATE_BACKEND_VLLM_A_BASE_URL", "http://10.9.9.9:8000/v1")
    monkeypatch.setenv("SLOGATE_TEST_CLI_KEY", "sk-upstream-secret")
    assert cli.main(["check", "--config", str(cfg_file)]) == 0
    out, err = capsys.readouterr()
    resolved = tomllib.loads(out)  # the output is TOML
    assert resolved["server"]["port"] == 9001
    assert resolved["backends"][0]["base_url"] == "http://10.9.9.9:8000/v1"
    assert resolved["auth"]["keys"][0] == {"tenant": "team-a", "sha256": "***",
                                           "models": ["*"]}
    assert resolved["admission"]["redis_url"] == "redis://***@redis:6379/0"
    assert resolved["backends"][0]["api_key_env"] == "SLOGATE_TEST_CLI_KEY"
    assert "set in the environment" in out
    for secret in (KEY_HASH, "hunter2", "sk-upstream-secret"):
        assert secret not in out + err
    assert "config OK" in err


def test_check_env_error_names_the_variable_and_exits_2(cfg_file) -> None:
    r = slogate("check", "--config", str(cfg_file), env={"SLOGATE_SERVER_PORT": "eighty"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "slogate: config error: SLOGATE_SERVER_PORT=eighty (server.port): expected an integer "
        "port 0-65535"]
    r = slogate("check", "--config", str(cfg_file),
                env={"SLOGATE_BACKEND_VLLM_A_POOL_SIZE": "0"})
    assert r.returncode == 2 and "SLOGATE_BACKEND_VLLM_A_POOL_SIZE=0 (backends[0].pool_size)" \
        in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_slogate_variables_are_warned_about(cfg_file, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SLOGATE_SERVR_PORT", "9000")
    monkeypatch.setenv("SLOGATE_BACKEND_VLLM_B_BASE_URL", "http://x:1/v1")
    assert cli.main(["check", "--config", str(cfg_file)]) == 0
    err = capsys.readouterr().err
    assert ("SLOGATE_SERVR_PORT overrides nothing and is ignored; did you mean "
            "SLOGATE_SERVER_PORT?") in err
    assert "SLOGATE_BACKEND_VLLM_B_BASE_URL overrides nothing" in err


def test_fallbacks_naming_unserved_models_are_config_errors() -> None:
    raw = {"auth": {"mode": "open"}, "backends": [
        {"name": "a", "base_url": "http://h:1/v1", "models": ["big", "small"],
         "aliases": {"tiny": "small"}}]}
    config.parse({**raw, "fallbacks": {"big": ["small", "tiny"]}}, env={})  # names and aliases
    for fallbacks, bad in (({"big": ["smol"]}, "smol"), ({"huge": ["small"]}, "huge")):
        with pytest.raises(config.ConfigError) as e:
            config.parse({**raw, "fallbacks": fallbacks}, env={})
        assert e.value.value == bad and e.value.key.startswith("fallbacks.")
        assert "served by a backend" in str(e.value)
    # A wildcard backend serves anything: nothing to check against.
    wild = {"auth": {"mode": "open"}, "backends": [{"name": "a", "base_url": "http://h:1/v1"}]}
    config.parse({**wild, "fallbacks": {"x": ["y"]}}, env={})


@pytest.mark.parametrize("command", ["serve", "sim"])
def test_port_in_use_is_one_line_and_exit_2(command, cfg_file) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ("serve", "--config", str(cfg_file)) if command == "serve" else ("sim",)
        r = slogate(*args, "--host", "127.0.0.1", "--port", str(port))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"slogate: cannot listen on 127.0.0.1:{port}: address already in use"], r.stderr
    assert r.stdout == ""


def test_help_texts(capsys) -> None:
    r = slogate("serve", "--help")
    assert "TOML" in r.stdout and "SLOGATE_SERVER_PORT" in r.stdout
    assert "SLOGATE_BACKEND_<NAME>_<KEY>" in r.stdout and "gateway/examples" in r.stdout
    r = slogate("hash-key", "--help")
    assert "standard input" in r.stdout and "slogate hash-key" in r.stdout
    r = slogate("hash-key", stdin="team-a-example-key\n")
    assert r.returncode == 0 and r.stdout.strip() == KEY_HASH


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_with_check(example, capsys) -> None:
    assert cli.main(["check", "--config", str(example)]) == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    for b in resolved["backends"]:
        assert "*" not in b["models"], f"{example.name}: name the models"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_what_check_prints_loads_back_as_the_same_config(example, capsys) -> None:
    """`slogate check` prints the resolved config in the file's own layout: loaded back (its
    hidden key hashes put back), it is the same config."""
    assert cli.main(["check", "--config", str(example)]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    original = tomllib.loads(example.read_text())
    for key, orig in zip(printed["auth"].get("keys", []), original["auth"].get("keys", []),
                         strict=True):
        key["sha256"] = orig["sha256"]
    assert config.parse(printed, env={}, providers=PROVIDERS) == \
        config.load(str(example), env={}, providers=PROVIDERS)


def test_the_multi_replica_examples_keys_may_use_the_classes_it_says() -> None:
    cfg = config.load(str(ROOT / "gateway/examples/multi-replica.toml"), env={})
    auth, slo = AuthPolicy(cfg.auth), SLOPolicy(cfg.slo)

    def target(key: str, asked: str | None = None) -> str:
        headers = {"Authorization": f"Bearer {key}"}
        policy = auth.policy(auth.authenticate(headers))
        return slo.target_for("/v1/chat/completions",
                              {"x-slo-class": asked} if asked else {}, policy).name

    assert target("team-a-example-key") == "interactive"
    assert target("team-a-example-key", "batch") == "batch"
    assert target("team-b-example-key") == "batch"
    with pytest.raises(GatewayError) as e:
        target("team-b-example-key", "interactive")
    assert e.value.code == "slo_class_not_allowed"


@pytest.mark.parametrize("admin", [False, True])
async def test_the_gateways_address_says_where_to_go(admin: bool) -> None:
    """GET / is what a person who opens the gateway's URL sees: the console, the metrics and
    the API routes (not a bare 404)."""
    server: dict[str, object] = {"access_log": False}
    if admin:
        server.update(admin_port=free_port(), admin_console=True)
    cfg = config.parse({"auth": {"mode": "open"}, "server": server, "backends": [
        {"name": "a", "base_url": "http://127.0.0.1:9/v1", "models": ["m"]}]}, env={})
    async with serve_app(build_app(cfg)) as base, aiohttp.ClientSession() as s:
        async with s.get(base + "/") as r:
            assert r.status == 200
            body = await r.json()
    assert body["service"] == "slogate" and "/v1/chat/completions" in body["api"]
    if admin:
        assert body["console"] == f"/console on the admin listener (port {server['admin_port']})"
    else:
        assert body["console"] == "/console" and body["metrics"] == "/metrics"


def test_examples_cover_every_provider_family() -> None:
    types = {b.get("type", "openai")
             for p in EXAMPLES for b in tomllib.loads(p.read_text())["backends"]}
    assert {"anthropic", "groq", "cerebras", "openai"} <= types
    names = {p.name for p in EXAMPLES}
    assert {"sim.toml", "responses-sim.toml", "multi-replica.toml", "production.toml"} <= names
    multi = tomllib.loads((ROOT / "gateway/examples/multi-replica.toml").read_text())
    assert multi["admission"]["enabled"] and len(multi["slo_classes"]) >= 2
    assert len({k["tenant"] for k in multi["auth"]["keys"]}) >= 2


async def test_wrong_method_on_a_known_route_is_405_with_allow() -> None:
    cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                        "backends": [{"name": "a", "base_url": "http://127.0.0.1:9/v1",
                                      "models": ["m"]}]}, env={})
    async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
        async with s.get(gw + "/v1/chat/completions") as r:
            body = await r.json()
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert body["error"]["code"] == "method_not_allowed"  # OpenAI's error shape
            assert r.headers["x-slogate-request-id"]
        async with s.get(gw + "/v1/messages", headers={"anthropic-version": "2023-06-01"}) as r:
            body = await r.json()
            assert r.status == 405 and body["type"] == "error"  # Anthropic's error shape
            assert body["error"]["type"] == "invalid_request_error"
        async with s.delete(gw + "/v1/models") as r:
            assert r.status == 405 and set(r.headers["Allow"].split(", ")) == {"GET", "HEAD"}
        async with s.get(gw + "/v1/nope") as r:
            assert r.status == 404  # unknown routes stay 404


async def test_unreachable_backend_names_address_and_cause() -> None:
    closed = free_port()
    cfg = config.parse({"auth": {"mode": "open"}, "server": {"access_log": False},
                        "retry": {"max_attempts": 1},
                        "backends": [{"name": "down", "base_url": f"http://127.0.0.1:{closed}/v1",
                                      "models": ["m"]}]}, env={})
    async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
        async with s.post(gw + "/v1/chat/completions",
                          json={"model": "m", "messages": [{"role": "user", "content": "x"}]}) as r:
            body = await r.json()
    assert r.status == 502
    assert body["error"]["message"] == (f"Backend 'down' is unreachable: 127.0.0.1:{closed}: "
                                        "connection refused.")


def test_connect_and_listen_errors_in_words() -> None:
    from collections import namedtuple

    from aiohttp import ClientConnectorError

    key = namedtuple("Key", "host port is_ssl ssl proxy proxy_auth proxy_headers_hash")(
        "h", 1, False, None, None, None, None)
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert describe_connect_error(ClientConnectorError(key, dns), "api.exampel.com", 443) == \
        "api.exampel.com:443: name not resolved"
    assert describe_connect_error(TimeoutError(), "10.0.0.5", 8000) == \
        "10.0.0.5:8000: timed out"
    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
    assert describe_connect_error(ClientConnectorError(key, refused), "127.0.0.1", 9) == \
        "127.0.0.1:9: connection refused"
    unreachable = OSError(113, "No route to host")
    assert describe_connect_error(unreachable, "::1", 80) == "[::1]:80: no route to host"
    for exc in (ClientConnectorError(key, dns), refused):
        assert type(exc).__name__ not in describe_connect_error(exc, "h", 1)
    assert describe_listen_error(OSError(98, "Address already in use"), "0.0.0.0", 80) == \
        "cannot listen on 0.0.0.0:80: address already in use"
    assert describe_listen_error(PermissionError(13, "Permission denied"), "0.0.0.0", 80) == \
        "cannot listen on 0.0.0.0:80: permission denied"


def test_demo_prints_the_console_url_first_and_a_progress_line() -> None:
    port = free_port()
    with socket.socket() as taken:  # the simulator's port is someone else's: the demo says so
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        sim_port = taken.getsockname()[1]
        r = slogate("demo", "--duration", "3", "--port", str(port), "--sim-port", str(sim_port),
                    "--concurrency", "2", timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0] == (f"slogate demo: live console at http://127.0.0.1:{port}/console "
                        "(open it in a browser now)")
    assert lines[1].startswith(f"slogate demo: port {sim_port} is taken; the simulator "
                               "listens on ")
    progress = [line for line in lines if line.startswith("  load ")]
    assert progress and "requests" in progress[-1] and "req/s" in progress[-1]
    assert len(set(progress)) == len(progress)  # no line printed twice


def test_make_clean_removes_what_make_created() -> None:
    r = subprocess.run(["make", "-n", "clean"], capture_output=True, text=True, cwd=ROOT)
    for path in (".venv", "*.egg-info", "node_modules", "bench-results", "__pycache__",
                 ".pytest_cache"):
        assert path in r.stdout, path


SIM_EXAMPLES = {  # example -> (route, body, extra headers)
    "sim.toml": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {}),
    "anthropic-sim.toml": ("/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}]}, {"anthropic-version": "2023-06-01"}),
    "groq-sim.toml": ("/openai/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}]}, {}),
    "cerebras-sim.toml": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}]}, {}),
    "responses-sim.toml": ("/v1/responses", {"input": "hi"}, {}),
}


@pytest.mark.parametrize("name", sorted(SIM_EXAMPLES))
async def test_simulator_examples_stream_through_the_gateway(name) -> None:
    """Each provider example, pointed at a live simulator (its base_url moved by the
    environment override, as a user would), streams its own API's format."""
    from backends.sim import SimConfig, build_app as build_sim

    route, body, headers = SIM_EXAMPLES[name]
    raw = tomllib.loads((ROOT / "gateway/examples" / name).read_text())
    backend = raw["backends"][0]
    model = backend["models"][0]
    async with serve_app(build_sim(SimConfig(decode_base_ms=1, served_model_names=[model],
                                             accept_any_model=False))) as sim:
        path = "/openai/v1" if backend["base_url"].endswith("/openai/v1") else "/v1"
        var = f"SLOGATE_BACKEND_{backend['name'].upper().replace('-', '_')}_BASE_URL"
        cfg = config.parse({**raw, "server": {"access_log": False}}, env={var: sim + path})
        async with serve_app(build_app(cfg)) as gw, aiohttp.ClientSession() as s:
            async with s.post(gw + route, json={**body, "model": model, "stream": True},
                              headers=headers) as r:
                text = await r.text()
            async with s.get(gw + "/v1/models") as m:
                listed = [x["id"] for x in (await m.json())["data"]]
    assert r.status == 200 and r.content_type == "text/event-stream", text[:300]
    assert text.endswith("\n\n") and len(text.split("\n\n")) > 3
    assert listed == [model]


def test_a_backends_key_variable_is_not_warned_about(caplog) -> None:
    raw = {"auth": {"mode": "open"}, "backends": [
        {"name": "a", "base_url": "http://h:1/v1", "models": ["m"],
         "api_key_env": "SLOGATE_UPSTREAM_KEY"}]}
    with caplog.at_level("WARNING", logger="slogate.config"):
        config.parse(raw, env={"SLOGATE_UPSTREAM_KEY": "sk-secret", "SLOGATE_SERVR_PORT": "1"})
    assert "SLOGATE_SERVR_PORT" in caplog.text
    assert "SLOGATE_UPSTREAM_KEY" not in caplog.text and "sk-secret" not in caplog.text
