"""The docker-compose stack, checked without a Docker engine: the compose file validates with
Debian's docker-compose and against the Compose Specification's schema, every config file it
mounts exists and is accepted by its own tool (slogate's config loader, promtool, amtool,
nginx -t), the pieces point at each other, and the nginx config streams a real gateway's SSE
without buffering."""
from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway import config as gateway_config
from tests.support.procs import sim_and_gateway
from tests.support.prometheus_server import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DASH = ROOT / "dashboards"
NGINX_CONF = DASH / "compose" / "nginx.conf"

SERVICES = {"sim", "gateway-1", "gateway-2", "nginx", "redis", "otel-collector", "jaeger",
            "prometheus", "alertmanager", "grafana"}


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists()
                                  else None)
    assert path, f"{name} is not installed (make test installs it; see scripts/)"
    return path


def run(*cmd: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


@functools.cache
def resolved(*profiles: str) -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors, variables, profiles)."""
    args = [a for p in profiles for a in ("--profile", p)]
    r = run(tool("docker-compose"), "-f", str(COMPOSE), *args, "config")
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_docker_compose_config_validates() -> None:
    for profiles in ((), ("--profile", "gpu")):
        r = run(tool("docker-compose"), "-f", str(COMPOSE), *profiles, "config", "-q")
        assert r.returncode == 0, r.stdout + r.stderr


def test_compose_spec_schema() -> None:
    checker = Path(sys.executable).with_name("check-jsonschema")
    r = run(str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert r.returncode == 0, r.stdout + r.stderr


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (long or short syntax)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, dict):
            out[v["target"]] = v["source"]
        else:
            source, target = v.split(":")[:2]
            out[target] = source
    return out


def test_services_profiles_and_mounted_files() -> None:
    services = resolved("gpu")["services"]
    assert set(services) == SERVICES | {"vllm"}
    # Only vLLM needs the gpu profile (docker-compose 1.x prints every service in `config`,
    # so the profiles are read from the file itself).
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {n for n, svc in raw.items() if svc.get("profiles")} == {"vllm"}
    assert raw["vllm"]["profiles"] == ["gpu"]
    vllm = services["vllm"]
    assert "--otlp-traces-endpoint=http://otel-collector:4317" in vllm["command"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    build = vllm["build"]
    assert (Path(build["context"]) / build["dockerfile"]).exists()
    for name in ("gateway-1", "gateway-2", "sim"):
        assert services[name]["image"] == "slogate:local"
    # Every bind mount's source is in the repository.
    for name, svc in services.items():
        for source in mounts(svc).values():
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts {source}, which does not exist"


def test_dockerfile_and_dockerignore() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "pip install ." in text
    assert 'ENTRYPOINT ["slogate"]' in text and '"serve", "--config"' in text
    # Everything `pip install .` needs is let through .dockerignore, nothing else.
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for needed in ("!pyproject.toml", "!README.md", "!gateway/", "!backends/"):
        assert needed in ignore
    assert ignore[0] == "*"


def test_gateway_config_of_the_stack_loads_with_its_environment() -> None:
    gw = resolved("gpu")["services"]["gateway-1"]
    cfg = gateway_config.load(mounts(gw)["/etc/slogate/slogate.toml"], env=gw["environment"])
    assert cfg.auth.mode == "open"
    assert cfg.server.host == "0.0.0.0" and cfg.server.port == 8080
    assert cfg.telemetry.otlp_endpoint == "http://otel-collector:4318"
    assert cfg.admission.redis_url == "redis://redis:6379/0"
    backends = {b.name: b for b in cfg.backends}
    assert backends["sim"].base_url == "http://sim:8000/v1"
    vllm_model = resolved("gpu")["services"]["vllm"]["command"][0].removeprefix("--model=")
    assert backends["vllm"].models == (vllm_model,)
    assert backends["vllm"].aliases == {"gpu": vllm_model}
    assert {"interactive", "batch"} <= set(cfg.slo.classes)


def test_prometheus_config_rules_and_alertmanager() -> None:
    prom_yml = DASH / "prometheus" / "prometheus.yml"
    r = run(tool("promtool"), "check", "config", str(prom_yml))
    assert r.returncode == 0, r.stdout + r.stderr
    prom = yaml.safe_load(prom_yml.read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = [t for sc in jobs["slogate"]["static_configs"] for t in sc["targets"]]
    assert sorted(targets) == ["gateway-1:8080", "gateway-2:8080"]
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "alertmanager:9093"]
    r = run(tool("amtool"), "check-config", str(DASH / "alertmanager.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_otel_collector_pipelines() -> None:
    otel = yaml.safe_load((DASH / "otel-collector.yaml").read_text())
    pipelines = otel["service"]["pipelines"]
    for kind in ("receivers", "processors", "exporters"):
        for p in pipelines.values():
            for component in p.get(kind, []):
                assert component in otel[kind], (kind, component)
    assert set(pipelines) >= {"traces", "metrics"}
    protocols = otel["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"    # vLLM (gRPC)
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"    # the gateways (http/protobuf)
    exporters = [otel["exporters"][e] for e in pipelines["traces"]["exporters"]]
    assert any(e.get("endpoint") == "jaeger:4317" for e in exporters)
    for e in otel["service"].get("extensions", []):
        assert e in otel["extensions"], e


def test_grafana_provisioning_matches_the_dashboard_and_the_stack() -> None:
    prov = DASH / "grafana" / "provisioning"
    sources = yaml.safe_load((prov / "datasources" / "slogate.yml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in sources}
    assert by_uid["prometheus"]["type"] == "prometheus"
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090"
    assert by_uid["jaeger"]["type"] == "jaeger" and by_uid["jaeger"]["url"] == "http://jaeger:16686"
    dest = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest == [{"name": "trace_id", "datasourceUid": "jaeger"}]
    # Every fixed datasource uid the dashboard names is provisioned.
    for uid in datasource_uids(json.loads((DASH / "grafana" / "slogate.json").read_text())):
        assert uid.startswith("$") or uid in by_uid or uid == "-- Grafana --", uid
    # The dashboard provider reads the folder where compose mounts the dashboard.
    provider = yaml.safe_load((prov / "dashboards" / "slogate.yml").read_text())["providers"][0]
    mounted = mounts(resolved()["services"]["grafana"])
    json_target = next(t for t, s in mounted.items() if s.endswith("slogate.json"))
    assert str(Path(json_target).parent) == provider["options"]["path"]
    assert mounted["/etc/grafana/provisioning"] == str(prov)


def datasource_uids(node: Any) -> set[str]:
    """The uids of every datasource reference and internal data link in a dashboard."""
    out: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("datasource"), dict) and "uid" in node["datasource"]:
            out.add(node["datasource"]["uid"])
        if "datasourceUid" in node:
            out.add(node["datasourceUid"])
        for v in node.values():
            out |= datasource_uids(v)
    elif isinstance(node, list):
        for v in node:
            out |= datasource_uids(v)
    return out


def nginx_conf_for(gateway: str, port: int, tmp: Path) -> Path:
    """The compose nginx config, pointed at a local gateway and port, with its temp files in
    tmp: everything else as shipped."""
    text = NGINX_CONF.read_text()
    text, n = re.subn(r"server gateway-\d:8080", f"server {gateway}", text)
    assert n == 2
    text, n = re.subn(r"listen 8080;", f"listen 127.0.0.1:{port};", text)
    assert n == 1
    text = text.replace("pid /tmp/nginx.pid;", f"pid {tmp}/nginx.pid;")
    temp = "".join(f"\n  {k}_temp_path {tmp}/{k};"
                   for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = text.replace("http {", "http {" + temp, 1)
    conf = tmp / "nginx.conf"
    conf.write_text(text)
    return conf


def test_nginx_config_is_valid() -> None:
    text = NGINX_CONF.read_text()
    for directive in ("proxy_buffering off;", "proxy_request_buffering off;", "gzip off;",
                      "proxy_http_version 1.1;", 'proxy_set_header Connection "";'):
        assert directive in text, directive
    read_timeout = re.search(r"proxy_read_timeout (\d+)s;", text)
    assert read_timeout and int(read_timeout.group(1)) >= 600  # reasoning models think long
    tmp = Path(tempfile.mkdtemp(prefix="slogate-nginx-t-"))
    try:
        conf = nginx_conf_for("127.0.0.1:9", free_port(), tmp)
        r = run(tool("nginx"), "-t", "-c", str(conf), "-p", str(tmp))
        assert r.returncode == 0, r.stderr
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def test_nginx_config_streams_sse_unbuffered() -> None:
    """Through the shipped nginx config, each token reaches the client when the engine makes
    it (200 ms apart), not all at once at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="slogate-nginx-"))
    port = free_port()
    proc = None
    try:
        # the engine makes a token every 200 ms (its own setting: the gateway forwards no
        # simulator header unless a backend lists it)
        async with sim_and_gateway(("--token-delay-ms", "200")) as (_, gw):
            conf = nginx_conf_for(gw.url.removeprefix("http://"), port, tmp)
            proc = subprocess.Popen([tool("nginx"), "-c", str(conf), "-p", str(tmp),
                                     "-g", "daemon off;"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(auto_decompress=False) as s:

                async def nginx_up() -> bool:
                    assert proc.poll() is None, proc.stderr.read().decode()
                    try:
                        async with s.get(url + "/healthz") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await wait_until(nginx_up, timeout=10, interval=0.05, what="nginx answering")
                arrivals: list[float] = []
                async with s.post(url + "/v1/chat/completions",
                                  json={"model": "m", "stream": True, "max_tokens": 5,
                                        "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    assert "Content-Encoding" not in r.headers
                    buf = b""
                    async for chunk in r.content.iter_any():
                        buf += chunk
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            if b'"content":"' in event and b'"content":""' not in event:
                                arrivals.append(time.monotonic())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    assert len(arrivals) == 5, arrivals
    # Buffered, they would arrive together at the end; allow one pair to bunch up on a busy
    # machine.
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert arrivals[-1] - arrivals[0] >= 0.5 and sum(g > 0.05 for g in gaps) >= 3, gaps
