"""The Grafana dashboard as its users get it.

- Every PromQL expression in dashboards/grafana/slogate.json (template variables and Grafana's
  $__ variables substituted) runs against a real Prometheus that scraped a real gateway under a
  short mixed load, with dashboards/prometheus/alerts.yml loaded as rules: each must parse and
  return data, except those over the metrics in PENDING. Every recording rule must produce its
  series, every rule must evaluate without error, every template-variable query must find values.
- The JSON type-checks against Grafana's own schema (@grafana/schema, `tsc --noEmit`; see
  dashboards/schema-check/check.ts), and the check is shown to catch mistakes.
- slogate.json is what dashboards/grafana/generate.py writes.
"""
from __future__ import annotations

import asyncio
import datetime
import importlib.util
import json
import math
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.support.procs import slogate
from tests.support.prometheus_server import free_port, prometheus
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "grafana" / "slogate.json"
GENERATOR = ROOT / "dashboards" / "grafana" / "generate.py"
RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"
SCHEMA_CHECK = ROOT / "dashboards" / "schema-check"

# The one list of metrics that nothing observes yet, with why. A dashboard or rule expression
# over one of them must parse but may return no data; as soon as it returns data this test
# fails, asking for the entry to be removed, so the list shrinks as the features land.
# Empty now: admission control (queue wait, TTFT prediction error) and retries (upstream
# attempts) have landed. A panel added ahead of the code that feeds it goes here, e.g.
#   "slogate_some_metric_total": "counted once <feature> lands (issue N)",
PENDING: dict[str, str] = {}

# Grafana's own variables, as Grafana would set them for a short range on a 1 s scrape.
GRAFANA_VARS = {"__rate_interval": "30s", "__interval": "5s", "__range": "5m"}
ALL = ".*"  # what a multi-value variable set to "All" becomes (allValue)

GATEWAY_TOML = """
[auth]
mode = "open"
# A quota nobody reaches: the Tenants row's quota-usage panel gets data.
requests_per_minute = 1000000
[server]
access_log = false
# The load's scripted failures (error events, cuts, 503s) must not open the breaker: with it
# open the rest of the load gets 503s and the latency panels get no data.
[breaker]
failures = 1000
[slo]
default = "batch"
# Admission on, with a small per-replica cap so that requests queue (and interactive ones may
# be rejected): the admission panels get data.
[admission]
enabled = true
max_concurrency = 4
[[slo_classes]]
name = "interactive"
ttft_ms = 300
tpot_ms = 50
[[slo_classes]]
name = "batch"
ttft_ms = 5000
tpot_ms = 200
[[backends]]
name = "sim"
base_url = "{sim}/v1"
models = ["m"]
forward_headers = ["x-sim-*"]
"""

# -- the dashboard's queries ---------------------------------------------------------------------

def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def prom_targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every Prometheus query in the dashboard."""
    out = []
    for p in all_panels(dash):
        for t in p.get("targets", []):
            if (t.get("datasource") or p.get("datasource") or {}).get("type") == "prometheus":
                out.append((f"panel {p['title']!r} query {t['refId']}", t["expr"]))
    return out


def substitute(expr: str, variables: set[str]) -> str:
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_VARS:
            return GRAFANA_VARS[name]
        assert name in variables, f"{expr!r} uses ${name}, which the dashboard does not define"
        return ALL
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)
    assert "$" not in out, out
    return out


def pending_metric(expr: str) -> str | None:
    for metric in PENDING:
        if re.search(rf"\b{metric}(_bucket|_sum|_count)?\b", expr):
            return metric
    return None


def test_dashboard_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("slogate_dashboard_generator", GENERATOR)
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render() == DASHBOARD.read_text(), (
        "dashboards/grafana/slogate.json is out of date: run "
        "`python dashboards/grafana/generate.py`")


def test_dashboard_structure() -> None:
    dash = load_dashboard()
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "backend", "model", "slo_class"} <= variables
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [p["title"] for p in all_panels(dash) if p["type"] == "row"]
    for word in ("SLO", "Latency", "Stages", "Admission", "Traffic", "Failures", "overhead"):
        assert any(word in r for r in rows), (word, rows)
    for p in all_panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            if t["datasource"]["type"] == "prometheus":
                # Panels follow the datasource variable, so the dashboard imports anywhere.
                assert t["datasource"]["uid"] == "${datasource}", p["title"]
    assert len(prom_targets(dash)) >= 40


# -- Grafana's own schema ------------------------------------------------------------------------

def _panel(dash: dict[str, Any], kind: str, nth: int = 0) -> dict[str, Any]:
    return [p for p in all_panels(dash) if p["type"] == kind][nth]


# Mistakes that the type check must catch, each with a word of tsc's message that names it.
def _mistakes(dash: dict[str, Any]) -> list[str]:
    _panel(dash, "timeseries", 0)["options"]["legend"]["displayMode"] = "tabel"
    _panel(dash, "timeseries", 1)["options"]["tooltipp"] = {"mode": "multi"}
    _panel(dash, "timeseries", 2)["fieldConfig"]["defaults"]["thresholds"]["mode"] = "absolut"
    _panel(dash, "timeseries", 3)["targets"][0]["exprr"] = "up"
    _panel(dash, "timeseries", 4)["fieldConfig"]["defaults"]["custom"]["drawStyle"] = "lines"
    _panel(dash, "stat")["options"]["textMode"] = "valu"
    _panel(dash, "heatmap")["options"]["color"]["mode"] = "schema"
    _panel(dash, "row")["colapsed"] = False
    dash["templating"]["list"][1]["refresh"] = 7
    return ['"tabel"', '"tooltipp"', '"absolut"', '"exprr"', '"lines"', '"valu"', '"schema"',
            '"colapsed"', "'7'"]


def test_dashboard_type_checks_against_grafanas_schema(tmp_path: Path) -> None:
    """tsc --noEmit over the dashboard as a `satisfies SlogateDashboard` literal: Grafana's
    dashboard kind plus each panel plugin's options (dashboards/schema-check/check.ts). The same
    check over a copy with known mistakes must report each of them."""
    node = shutil.which("node")
    assert node, "Node.js is not installed"
    if not (SCHEMA_CHECK / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=SCHEMA_CHECK, check=True,
                       timeout=600)
    # A private folder under the npm project (module resolution finds node_modules from there),
    # so parallel runs do not collide.
    (SCHEMA_CHECK / "build").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=SCHEMA_CHECK / "build"))
    try:
        dash = load_dashboard()
        expected = _mistakes(dash)
        broken = tmp_path / "mistakes.json"
        broken.write_text(json.dumps(dash))
        gen = SCHEMA_CHECK / "gen.mjs"
        subprocess.run([node, str(gen), str(DASHBOARD), str(work / "dashboard.gen.ts")], check=True)
        subprocess.run([node, str(gen), str(broken), str(work / "mistakes.gen.ts")], check=True)
        (work / "tsconfig.json").write_text(json.dumps({
            "extends": "../../tsconfig.json",
            "files": ["../../check.ts", "dashboard.gen.ts", "mistakes.gen.ts"]}))
        tsc = SCHEMA_CHECK / "node_modules" / "typescript" / "bin" / "tsc"
        r = subprocess.run([node, str(tsc), "-p", str(work / "tsconfig.json"), "--pretty", "false"],
                           capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    errors = [line for line in r.stdout.splitlines() if ": error TS" in line]
    real = [e for e in errors if "dashboard.gen.ts" in e or "check.ts" in e]
    assert not real, "slogate.json does not match Grafana's schema:\n" + "\n".join(real)
    caught = [e for e in errors if "mistakes.gen.ts" in e]
    for word in expected:
        assert any(word in e for e in caught), (word, caught)
    assert len(caught) == len(expected), caught


# -- against a real Prometheus scraping a real gateway -------------------------------------------

async def _request(s: aiohttp.ClientSession, url: str, model: str = "m", *,
                   headers: dict[str, str] | None = None, stream: bool = True,
                   cancel_after_chunks: int | None = None) -> None:
    body = {"model": model, "stream": stream, "max_tokens": 6,
            "messages": [{"role": "user", "content": "hello " * 30}]}
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        n = 0
        async for _ in r.content.iter_any():
            n += 1
            if cancel_after_chunks is not None and n >= cancel_after_chunks:
                r.close()  # the client walks away mid-stream
                return


async def _load(gw: str) -> int:
    """A short mixed load: both SLO classes, both backends, and every failure the dashboard
    shows (missed TTFT, interruptions, upstream errors, cancellations, rejections)."""
    inter = {"x-slo-class": "interactive"}
    n = 0
    async with aiohttp.ClientSession() as s:
        for _wave in range(3):
            # The walk-away first: admitted before the failures below open the breaker.
            jobs = [_request(s, gw, headers={"x-sim-token-delay-ms": "100"},
                             cancel_after_chunks=2)]
            jobs += [_request(s, gw, headers=inter if i % 2 else None) for i in range(10)]
            # Groq-flavoured answers report the engine's queue, prefill and decode (in the
            # batch class: admitted whatever the queue, so the stage panels always get data).
            jobs += [_request(s, gw, headers={"x-sim-provider": "groq"}) for _ in range(3)]
            jobs += [_request(s, gw, stream=False),
                     _request(s, gw, headers={**inter, "x-sim-stall-ms": "400"}),
                     _request(s, gw, headers={"x-sim-error-after": "2"}),
                     _request(s, gw, headers={"x-sim-cut-after": "2"}),
                     _request(s, gw, headers={"x-sim-status": "503"}),
                     _request(s, gw, "no-such-model")]
            await asyncio.gather(*jobs)
            n += len(jobs)
            await asyncio.sleep(1.2)  # a scrape between waves: rates see the counters move
    return n


def _rfc3339(ts: str) -> float:
    """Prometheus's timestamps (nanosecond fractions, `Z`) as Unix seconds."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z", ts)
    assert m, ts
    whole = datetime.datetime.fromisoformat(m[1] + "+00:00").timestamp()
    return whole + float("0." + (m[2] or "0"))


async def _rules_evaluated_since(session: aiohttp.ClientSession, prom_url: str, t0: float,
                                 times: int) -> bool:
    """Has every rule group been evaluated `times` times since t0 (Unix seconds)? Groups run
    every `interval`, so that is: the last evaluation is at least (times - 1) intervals after
    t0."""
    async with session.get(prom_url + "/api/v1/rules") as r:
        groups = (await r.json())["data"]["groups"]
    assert groups, "no rule groups loaded"
    return all(_rfc3339(g["lastEvaluation"]) >= t0 + (times - 1) * g["interval"]
               for g in groups)


async def _query(session: aiohttp.ClientSession, prom_url: str, expr: str) -> dict[str, Any]:
    async with session.get(prom_url + "/api/v1/query", params={"query": expr}) as r:
        return await r.json()


def _has_numbers(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


async def test_every_dashboard_and_rule_expression_returns_data_from_a_real_gateway() -> None:
    dash = load_dashboard()
    variables = {v["name"] for v in dash["templating"]["list"]}
    rules = yaml.safe_load(RULES.read_text())["groups"]
    recorded = [r["record"] for g in rules for r in g["rules"] if "record" in r]
    alerts = [(r["alert"], r["expr"]) for g in rules for r in g["rules"] if "alert" in r]

    # Prometheus first, on the gateway's port-to-be: its target discovery takes seconds to
    # deliver the first target, time the processes spend starting.
    port = free_port()
    async with prometheus([f"127.0.0.1:{port}"], rule_files=[str(RULES)]) as prom, \
            slogate("sim", ready_path="/health") as sim:
        cfg = Path(tempfile.mkstemp(prefix="slogate-dash-", suffix=".toml")[1])
        cfg.write_text(GATEWAY_TOML.format(sim=sim.url))
        try:
            async with slogate("serve", "--config", str(cfg), ready_path="/readyz",
                               port=port) as gw, aiohttp.ClientSession() as s:
                deadline = time.monotonic() + 20

                async def scraped() -> bool:  # once before the load
                    return await prom.scalar('up{job="slogate"}') == 1

                await wait_until(scraped, timeout=20, interval=0.2,
                                 what="Prometheus scraping the gateway")
                n = await _load(gw.url)

                async def saw_every_request() -> bool:
                    return await prom.scalar("sum(slogate_requests_total)") == n

                await wait_until(saw_every_request, max(0.0, deadline + 15 - time.monotonic()),
                                 interval=0.2, what="Prometheus seeing every request")
                t_final = time.time()
                # Two more rule evaluations over the final counts.
                await wait_until(lambda: _rules_evaluated_since(s, prom.url, t_final, times=2),
                                 timeout=10, interval=0.2, what="two rule evaluations")
                await _check_everything(s, prom.url, dash, variables, recorded, alerts)
        finally:
            cfg.unlink(missing_ok=True)


async def _check_everything(s: aiohttp.ClientSession, prom_url: str, dash: dict[str, Any],
                            variables: set[str], recorded: list[str],
                            alerts: list[tuple[str, str]]) -> None:
    problems: list[str] = []
    came_alive: list[str] = []

    async def run(where: str, expr: str) -> list[dict[str, Any]] | None:
        body = await _query(s, prom_url, expr)
        if body.get("status") != "success":
            problems.append(f"{where}: does not run: {body.get('error')}\n  {expr}")
            return None
        return body["data"]["result"]

    # Every query of every panel.
    for where, raw in prom_targets(dash):
        expr = substitute(raw, variables)
        result = await run(where, expr)
        if result is None:
            continue
        metric = pending_metric(expr)
        if metric is None and not _has_numbers(result):
            problems.append(f"{where}: no data\n  {expr}")
        elif metric is not None and result:
            came_alive.append(metric)

    # Every template variable's query finds values.
    for v in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", str(v.get("query", "")))
        if v["type"] == "query":
            assert m, v
            result = await run(f"variable {v['name']}", substitute(m.group(1), variables))
            if result is not None and not [r for r in result if m.group(2) in r["metric"]]:
                problems.append(f"variable {v['name']}: no values for {m.group(2)}")

    # Every recorded series exists; every alert expression runs.
    for name in recorded:
        result = await run(f"recording rule {name}", name)
        if result is not None and not _has_numbers(result):
            problems.append(f"recording rule {name}: no data")
    for name, expr in alerts:
        await run(f"alert {name}", expr)

    # And Prometheus evaluated every rule without error.
    async with s.get(prom_url + "/api/v1/rules") as r:
        groups = (await r.json())["data"]["groups"]
    for g in groups:
        for rule in g["rules"]:
            if rule.get("health") != "ok" or rule.get("lastError"):
                problems.append(f"rule {rule['name']}: {rule.get('health')} "
                                f"{rule.get('lastError')}")
    assert sum(len(g["rules"]) for g in groups) == len(recorded) + len(alerts)

    for metric in sorted(set(came_alive)):
        problems.append(f"{metric} has data now: remove it from PENDING in "
                        "tests/system/test_dashboards.py")
    assert not problems, "\n".join(problems)
