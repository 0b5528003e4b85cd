#!/usr/bin/env python3
"""Writes dashboards/grafana/slogate.json, the slogate Grafana dashboard.

The JSON is generated so that every panel is built the same way (datasource variable, filters,
units, legends) and stays consistent as metrics are added; the JSON is committed, so Grafana
provisioning and "Import dashboard" use it without running this. Edit this file, then run

    python dashboards/grafana/generate.py

tests/system/test_dashboards.py fails if slogate.json differs from what this writes, runs every
PromQL expression in it against a real Prometheus scraping a real gateway, and type-checks it
against Grafana's own schema (dashboards/schema-check).

Standard library only.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("slogate.json")

PROM = {"type": "prometheus", "uid": "${datasource}"}
# The Jaeger datasource provisioned by dashboards/grafana/provisioning (uid "jaeger").
JAEGER = {"type": "jaeger", "uid": "jaeger"}
RI = "$__rate_interval"

# Label filters from the template variables. Every selector carries job=~"$job" so that one
# Prometheus can hold several slogate deployments.
JOB = 'job=~"$job"'
BM = JOB + ', backend=~"$backend", model=~"$model"'
BMS = BM + ', slo_class=~"$slo_class"'
MS = JOB + ', model=~"$model", slo_class=~"$slo_class"'
CLS = JOB + ', slo_class=~"$slo_class"'
BK = JOB + ', backend=~"$backend"'
MET = 'verdict="met"'
COMPLETION = 'kind="completion"'


def sel(metric: str, filters: str, extra: str = "") -> str:
    return f"{metric}{{{filters}{', ' + extra if extra else ''}}}"


def rate(metric: str, filters: str, extra: str = "", window: str = RI) -> str:
    return f"rate({sel(metric, filters, extra)}[{window}])"


def quantile(q: float, hist: str, filters: str, by: str) -> str:
    return (f"histogram_quantile({q}, sum by (le, {by}) "
            f"({rate(hist + '_bucket', filters)}))")


def ratio_or_zero(num: str, den: str, by: str) -> str:
    """sum by (by) (num) / sum by (by) (den), 0 (not "no data") where num has no series yet:
    a counter that has never been incremented for a label set does not exist."""
    return (f"(sum by ({by}) ({num}) or 0 * sum by ({by}) ({den}))\n"
            f"  / sum by ({by}) ({den})")


def goodput(window: str) -> str:
    num = f"increase({sel('slogate_slo_requests_total', BMS, MET)}[{window}])"
    den = f"increase({sel('slogate_slo_requests_total', BMS)}[{window}])"
    return ratio_or_zero(num, den, "slo_class")


def mean(hist: str, filters: str, per: str | None = None) -> str:
    """Mean seconds per observation (or per observation of `per`)."""
    den = per or hist
    return f"sum({rate(hist + '_sum', filters)}) / sum({rate(den + '_count', filters)})"


# -- panels --------------------------------------------------------------------------------------

_ids = iter(range(1, 1000))


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False,
           fmt: str = "time_series", exemplar: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"refId": ref, "datasource": PROM, "expr": expr, "legendFormat": legend,
                         "range": not instant, "instant": instant, "format": fmt,
                         "editorMode": "code"}
    if exemplar:
        t["exemplar"] = True
    return t


def targets(*specs: tuple[str, str] | dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate(specs):
        t = s if isinstance(s, dict) else target(s[0], s[1])
        t["refId"] = chr(ord("A") + i)
        out.append(t)
    return out


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


LEGEND = {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []}
LEGEND_TABLE = {"displayMode": "table", "placement": "right", "showLegend": True,
                "calcs": ["mean", "max", "lastNotNull"]}
HIDE = {"legend": False, "tooltip": False, "viz": False}


def trace_links() -> list[dict[str, Any]]:
    """Data links from a latency point to the traces at least that slow, in Jaeger."""
    return [{
        "title": "Traces of ${__field.labels.backend} / ${__field.labels.model} slower than this",
        "url": "",
        "internal": {
            "datasourceUid": JAEGER["uid"], "datasourceName": "Jaeger",
            "query": {"queryType": "search", "service": "slogate",
                      "tags": "slogate.backend=${__field.labels.backend} "
                              "gen_ai.request.model=${__field.labels.model}",
                      "minDuration": "${__value.raw}s", "limit": 20},
        },
    }]


def timeseries(title: str, description: str, tgts: list[dict[str, Any]], unit: str, *,
               w: int = 12, h: int = 8, stack: bool = False, fill: int = 10,
               minimum: float | None = 0, maximum: float | None = None,
               lines: tuple[tuple[float, str], ...] = (),
               links: list[dict[str, Any]] | None = None,
               draw: str = "line", table_legend: bool = False,
               overrides: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": draw, "lineWidth": 1, "fillOpacity": 70 if stack else fill,
        "gradientMode": "none", "showPoints": "never", "pointSize": 4, "spanNulls": False,
        "lineInterpolation": "linear", "axisPlacement": "auto", "axisLabel": "",
        "barAlignment": 0, "scaleDistribution": {"type": "linear"}, "hideFrom": HIDE,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if lines else "off"},
    }
    defaults: dict[str, Any] = {
        "unit": unit, "color": {"mode": "palette-classic"}, "custom": custom,
        "thresholds": thresholds((None, "green"), *((v, c) for v, c in lines)),
        "mappings": [], "links": links or [],
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries", "title": title, "description": description, "id": next(_ids),
        "datasource": PROM, "targets": tgts, "_w": w, "_h": h,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {"legend": LEGEND_TABLE if table_legend else LEGEND,
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def stat(title: str, description: str, tgts: list[dict[str, Any]], unit: str,
         steps: tuple[tuple[float | None, str], ...], *, w: int = 6, h: int = 5,
         decimals: int | None = None,
         mappings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"},
                                "thresholds": thresholds(*steps), "mappings": mappings or []}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat", "title": title, "description": description, "id": next(_ids),
        "datasource": PROM, "targets": tgts, "_w": w, "_h": h,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "orientation": "auto", "textMode": "value_and_name", "colorMode": "value",
                    "graphMode": "area", "justifyMode": "auto", "wideLayout": True,
                    "showPercentChange": False, "percentChangeColorMode": "standard"},
    }


def heatmap(title: str, description: str, tgts: list[dict[str, Any]], *, w: int = 12,
            h: int = 8) -> dict[str, Any]:
    return {
        "type": "heatmap", "title": title, "description": description, "id": next(_ids),
        "datasource": PROM, "targets": tgts, "_w": w, "_h": h,
        "fieldConfig": {"defaults": {"custom": {"scaleDistribution": {"type": "linear"},
                                                "hideFrom": HIDE}},
                        "overrides": []},
        "options": {
            "calculate": False, "cellGap": 1,
            "color": {"exponent": 0.5, "fill": "dark-orange", "mode": "scheme", "reverse": False,
                      "scale": "exponential", "scheme": "Oranges", "steps": 64},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "showValue": "never",
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
            "yAxis": {"axisPlacement": "left", "reverse": False, "unit": "s"},
        },
    }


def state_timeline(title: str, description: str, tgts: list[dict[str, Any]],
                   mappings: list[dict[str, Any]], *, w: int = 12,
                   h: int = 8) -> dict[str, Any]:
    return {
        "type": "state-timeline", "title": title, "description": description, "id": next(_ids),
        "datasource": PROM, "targets": tgts, "_w": w, "_h": h,
        "fieldConfig": {"defaults": {"color": {"mode": "thresholds"},
                                     "thresholds": thresholds((None, "green")),
                                     "mappings": mappings,
                                     "custom": {"fillOpacity": 70, "lineWidth": 0,
                                                "hideFrom": HIDE}},
                        "overrides": []},
        "options": {"mergeValues": True, "showValue": "auto", "alignValue": "left",
                    "rowHeight": 0.9, "legend": LEGEND,
                    "tooltip": {"mode": "single", "sort": "none"}},
    }


def text(title: str, content: str, *, w: int = 24, h: int = 4) -> dict[str, Any]:
    return {"type": "text", "title": title, "id": next(_ids), "targets": [], "_w": w, "_h": h,
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"mode": "markdown", "content": content}}


def row(title: str, panels: list[dict[str, Any]], *, collapsed: bool = False) -> dict[str, Any]:
    return {"type": "row", "title": title, "id": next(_ids), "collapsed": collapsed,
            "panels": panels}


def value_map(*entries: tuple[str, str, str]) -> list[dict[str, Any]]:
    return [{"type": "value", "options": {
        v: {"text": t, "color": c, "index": i} for i, (v, t, c) in enumerate(entries)}}]


def quantiles(hist: str, filters: str, by: str, legend: str, *, exemplar: bool = False,
              qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[dict[str, Any]]:
    return targets(*(target(quantile(q, hist, filters, by), f"p{round(q * 100)} {legend}",
                            exemplar=exemplar and q == qs[-1]) for q in qs))


# -- the dashboard ------------------------------------------------------------------------------

def slo_row() -> dict[str, Any]:
    budget = (f"1 - (\n  (1 - (\n{goodput('$__range')}\n  ))\n"
              "  / on() group_left() (1 - slogate:slo_objective:ratio)\n)")
    return row("SLO: goodput and error budget", [
        stat("Goodput over the selected range",
             "Share of finished requests that met their SLO class's TTFT and TPOT targets "
             "(DistServe goodput; failed, rejected and cancelled requests count as misses), "
             "over the dashboard's time range, per SLO class.",
             targets(target(goodput("$__range"), "{{slo_class}}", instant=True)),
             "percentunit", ((None, "red"), (0.95, "orange"), (0.99, "green")), decimals=2,
             h=8),
        stat("Error budget remaining over the selected range",
             "1 − (misses ÷ misses allowed by the objective) over the dashboard's time range: "
             "100% = nothing spent, 0% = spent, below 0 = overspent. The objective is the "
             "recording rule slogate:slo_objective:ratio (dashboards/prometheus/alerts.yml).",
             targets(target(budget, "{{slo_class}}", instant=True)),
             "percentunit", ((None, "red"), (0.25, "orange"), (0.5, "green")), decimals=1,
             h=8),
        timeseries("Goodput ratio by SLO class",
                   "Requests meeting their SLO ÷ all finished requests, per class, against "
                   "the objective.",
                   targets((goodput(RI), "{{slo_class}}"),
                           ("slogate:slo_objective:ratio", "objective")),
                   "percentunit", maximum=1, minimum=None),
        timeseries("Goodput rate vs demand",
                   "Requests per second that met their SLO (DistServe's goodput) and all "
                   "finished requests, per class.",
                   targets((f"sum by (slo_class) "
                            f"({rate('slogate_slo_requests_total', BMS, MET)})",
                            "{{slo_class}} met SLO"),
                           (f"sum by (slo_class) ({rate('slogate_slo_requests_total', BMS)})",
                            "{{slo_class}} all")),
                   "reqps"),
        timeseries("Error-budget burn rate (recorded)",
                   "How many times faster than allowed the error budget is being spent "
                   "(1 = exactly on budget over the SLO period). The fast-burn alert pages "
                   "when both the 1h and 5m rates exceed 14.4, the slow-burn alert when both "
                   "the 6h and 30m rates exceed 6 (Google SRE workbook, ch. 5). Recorded per "
                   "SLO class over all backends and models.",
                   targets(*((f'slo_class:slogate_goodput_burn_rate:rate{w}'
                              f'{{slo_class=~"$slo_class"}}', f"{{{{slo_class}}}} {w}")
                             for w in ("5m", "30m", "1h", "6h"))),
                   "x", lines=((6, "orange"), (14.4, "red"))),
        timeseries("Verdicts: why requests missed",
                   "Finished requests per second by SLO verdict: met, ttft_missed, "
                   "tpot_missed, both_missed, e2e_missed, failed.",
                   targets((f"sum by (verdict) ({rate('slogate_slo_requests_total', BMS)})",
                            "{{verdict}}")),
                   "reqps", stack=True, w=24, h=7),
    ])


def latency_row() -> dict[str, Any]:
    def lat(title: str, hist: str, filters: str, what: str) -> dict[str, Any]:
        return timeseries(title, what + " P50 / P95 / P99 per backend and model, from the "
                          "classic histogram (buckets summed before the quantile). Click a "
                          "point to open the traces at least that slow in Jaeger.",
                          quantiles(hist, filters, "backend, model", "{{backend}} {{model}}",
                                    exemplar=True),
                          "s", links=trace_links())
    return row("Latency", [
        lat("Time to first token", "slogate_time_to_first_token_seconds", BMS,
            "Request received → first generated token (content, reasoning or tool call)."),
        lat("Time per output token", "slogate_time_per_output_token_seconds", BMS,
            "Per request: (last token − first token) ÷ (output tokens − 1)."),
        lat("Inter-token latency", "slogate_inter_token_latency_seconds", BM,
            "Every gap between successive token events of a stream."),
        lat("End-to-end request duration", "slogate_request_duration_seconds", BMS,
            "Request received → end of the response (streamed and non-streamed)."),
        timeseries("P99 end-to-end duration, streamed vs not",
                   "A non-streamed answer has no first token: it is measured here (stream = "
                   "false), never in the TTFT panels.",
                   targets(target(quantile(0.99, "slogate_request_duration_seconds", BMS,
                                           "stream"), "stream={{stream}}")),
                   "s", w=24, h=6),
        heatmap("Time to first token: distribution",
                "Requests per TTFT bucket over time (all selected backends, models and "
                "classes). Exemplars, where the gateway exposes them, link to their trace.",
                targets(target("sum by (le) (increase("
                               f"{sel('slogate_time_to_first_token_seconds_bucket', BMS)}"
                               f"[{RI}]))",
                               "{{le}}", fmt="heatmap", exemplar=True)),
                w=24),
    ])


def stages_row() -> dict[str, Any]:
    sent = "slogate_gateway_queue_seconds"  # observed once per request sent upstream
    return row("Stages: where a request's time goes", [
        timeseries("Mean time per stage (stacked)",
                   "Mean seconds per request in each stage: gateway queue (received → sent "
                   "upstream, including admission wait), upstream connect (new connections, "
                   "spread over all requests sent), and the provider-reported queue, prefill "
                   "and decode (Groq x_groq.usage, Cerebras time_info, vLLM metrics; absent "
                   "for providers that report nothing — the gateway does not invent them). "
                   "Select one backend to read its split.",
                   targets((mean(sent, BM), "gateway queue"),
                           (f"sum({rate('slogate_upstream_connect_seconds_sum', BM)}) / "
                            f"sum({rate(sent + '_count', BM)})", "upstream connect"),
                           (mean("slogate_provider_queue_seconds", BM), "provider queue"),
                           (mean("slogate_provider_prefill_seconds", BM), "prefill"),
                           (mean("slogate_provider_decode_seconds", BM), "decode")),
                   "s", stack=True),
        timeseries("Time to first token and its gateway-measured parts (mean)",
                   "What the gateway measures for every provider: mean TTFT, the part spent "
                   "before the request left the gateway, and the wait for upstream response "
                   "headers (sent → headers).",
                   targets((mean("slogate_time_to_first_token_seconds", BMS), "TTFT"),
                           (mean(sent, BM), "gateway queue"),
                           (mean("slogate_upstream_headers_seconds", BM), "upstream headers")),
                   "s"),
        timeseries("P99 per stage by backend",
                   "P99 of the gateway queue, upstream headers wait and provider-reported "
                   "queue and prefill, per backend.",
                   targets(*(target(quantile(0.99, h, BM, "backend"), f"{name} {{{{backend}}}}")
                             for h, name in ((sent, "gateway queue"),
                                             ("slogate_upstream_headers_seconds", "headers"),
                                             ("slogate_provider_queue_seconds", "provider queue"),
                                             ("slogate_provider_prefill_seconds", "prefill")))),
                   "s", w=24),
    ])


def waited_row() -> dict[str, Any]:
    """Why P99 TTFT is high: the TTFT of every answer that missed its class's target is split
    into stages that add up to it (gateway/telemetry/attribution.py); the largest one is
    counted. Prompt length and prefix-cache hits are the other two suspects."""
    miss = "slogate_ttft_miss_total"
    stage_s = "slogate_ttft_miss_stage_seconds_total"
    by_prompt = "slogate_time_to_first_token_by_prompt_seconds"
    cache = "slogate_prompt_cache_tokens_total"
    return row("What the slowest requests waited for", [
        timeseries("Share of missed TTFTs' time by stage",
                   "Of all the TTFT seconds of answers that missed their class's TTFT target, "
                   "the share spent in each stage: gateway_queue (received → first send: body, "
                   "admission wait), retries (failed attempts and backoff), upstream_connect, "
                   "upstream_headers (send → headers, less connect), engine_queue and prefill "
                   "(as the provider reported them; absent when it reports nothing) and "
                   "first_token_after_headers. The stages add up to each request's TTFT.",
                   # clamp_min: a window without misses shows 0, not "no data"
                   targets((f"sum by (stage) ({rate(stage_s, CLS)})\n"
                            f"  / ignoring(stage) group_left() "
                            f"clamp_min(sum({rate(stage_s, CLS)}), 1e-9)",
                            "{{stage}}")),
                   "percentunit", stack=True, maximum=1),
        timeseries("Missed TTFTs by largest stage",
                   "Answers per second that missed their TTFT target, by the stage with the "
                   "largest share of their TTFT (slogate_ttft_miss_total; the access log's "
                   "ttft_miss_stage and the span attribute slogate.ttft.miss_stage name the "
                   "same stage per request).",
                   targets((f"sum by (slo_class, stage) ({rate(miss, CLS)})",
                            "{{slo_class}}: {{stage}}")),
                   "reqps", stack=True),
        timeseries("P99 TTFT by prompt length",
                   "P99 time to first token per prompt-length bucket (prompt tokens as the "
                   "provider counted them, cached ones included; unknown: no usage reported).",
                   targets(target(quantile(0.99, by_prompt, BM, "prompt_length"),
                                  "{{prompt_length}}")),
                   "s", w=8),
        timeseries("P99 TTFT by prefix cache",
                   "P99 time to first token per prefix-cache bucket: hit (at least 75% of the "
                   "prompt read from the provider's prefix cache), partial (some), miss (none), "
                   "unknown (the provider reported no cache figure).",
                   targets(target(quantile(0.99, by_prompt, BM, "prefix_cache"),
                                  "{{prefix_cache}}")),
                   "s", w=8),
        timeseries("Prefix-cache hit ratio",
                   "Cached ÷ all prompt tokens of the answers whose provider reported its "
                   "prefix cache (OpenAI and vLLM prompt_tokens_details, Responses "
                   "input_tokens_details, Anthropic cache_read_input_tokens, Groq, Cerebras), "
                   "per backend and model.",
                   targets((ratio_or_zero(rate(cache, BM, 'kind="cached"'), rate(cache, BM),
                                          "backend, model"), "{{backend}} {{model}}")),
                   "percentunit", maximum=1, w=8),
    ])


def admission_row() -> dict[str, Any]:
    dec = "slogate_admission_decisions_total"
    return row("Admission", [
        timeseries("Admission decisions by reason",
                   "Decisions per second: admitted, queued, rejected, with the reason "
                   "(admission_off while admission control is off).",
                   targets((f"sum by (decision, reason) ({rate(dec, MS)})",
                            "{{decision}}: {{reason}}")),
                   "reqps", stack=True),
        timeseries("Rejected share by SLO class",
                   "Rejected ÷ all admission decisions, per class. The alert fires above 20% "
                   "for 10 minutes.",
                   targets((ratio_or_zero(rate(dec, MS, 'decision="rejected"'), rate(dec, MS),
                                          "slo_class"), "{{slo_class}}")),
                   "percentunit", maximum=1, lines=((0.2, "red"),)),
        timeseries("Admission queue depth",
                   "Requests waiting for admission, per SLO class, per gateway summed.",
                   targets((f"sum by (slo_class) ({sel('slogate_admission_queue_depth', CLS)})",
                            "{{slo_class}}"),
                           (f"sum({sel('slogate_requests_queued', JOB)})", "all classes")),
                   "short"),
        timeseries("Admission queue wait",
                   "Time requests waited for admission, P50 / P99 per class.",
                   quantiles("slogate_admission_queue_wait_seconds",
                             CLS, "slo_class", "{{slo_class}}",
                             qs=(0.5, 0.99)),
                   "s"),
        timeseries("Predicted vs actual TTFT",
                   "How far the admission controller's TTFT prediction was from the actual "
                   "TTFT (|predicted − actual|, P50 and P99), next to the actual P50 TTFT, per "
                   "backend and model. An error that grows against the TTFT means the "
                   "estimator has not adapted to the backend.",
                   targets(*(target(quantile(q, "slogate_ttft_prediction_error_seconds", BM,
                                             "backend, model"),
                                    f"|error| p{round(q * 100)} {{{{backend}}}} {{{{model}}}}")
                             for q in (0.5, 0.99)),
                           target(quantile(0.5, "slogate_time_to_first_token_seconds", BMS,
                                           "backend, model"),
                                  "actual TTFT p50 {{backend}} {{model}}")),
                   "s", w=24),
        timeseries("Admission prediction error (signed)",
                   "Actual − predicted, per SLO class: the queue wait admission predicted "
                   "from the request's place in the fair order (kind=queue_wait) and the TTFT "
                   "it predicted from arrival (kind=ttft); P10 / P50 / P90. Above 0: later "
                   "than predicted (it admits requests that then miss); below 0: earlier (it "
                   "refuses requests that would have made it). A P50 far from 0 is a bias.",
                   targets(*(target(quantile(q, "slogate_admission_prediction_error_seconds",
                                             CLS, "slo_class, kind"),
                                    f"p{round(q * 100)} {{{{slo_class}}}} {{{{kind}}}}")
                             for q in (0.1, 0.5, 0.9))),
                   "s", w=24, lines=((0.0, "orange"),)),
    ])


def traffic_row() -> dict[str, Any]:
    req = "slogate_requests_total"
    return row("Traffic", [
        timeseries("Requests per second by backend and model", "Finished requests per second.",
                   targets((f"sum by (backend, model) ({rate(req, BM)})",
                            "{{backend}} {{model}}")),
                   "reqps"),
        timeseries("Tokens per second",
                   "Prompt and completion tokens per second, per backend and model (from the "
                   "usage the provider reported).",
                   targets((f"sum by (backend, model, kind) ({rate('slogate_tokens_total', BM)})",
                            "{{kind}} {{backend}} {{model}}")),
                   "short"),
        timeseries("In flight and queued, per gateway",
                   "Requests being served now and requests waiting in the admission queue, "
                   "per gateway process.",
                   targets((f"sum by (instance) ({sel('slogate_requests_in_flight', JOB)})",
                            "in flight {{instance}}"),
                           (f"sum by (instance) ({sel('slogate_requests_queued', JOB)})",
                            "queued {{instance}}")),
                   "short"),
        timeseries("Requests per second by route", "Finished requests per second per API route.",
                   targets((f"sum by (route) ({rate(req, BM)})", "{{route}}")), "reqps", w=8),
        stat("Gateways up", "Scrape targets of the slogate job that answered the last scrape, "
             "out of all configured.",
             targets(target(f"sum(up{{{JOB}}})", "up", instant=True),
                     target(f"count(up{{{JOB}}})", "configured", instant=True)),
             "short", ((None, "red"), (1, "green")), w=4, h=8),
    ])


def failures_row() -> dict[str, Any]:
    req = "slogate_requests_total"
    backend_errors = ratio_or_zero(rate(req, BM, 'backend!="none", outcome=~"upstream_.*|timeout"'),
                                   rate(req, BM, 'backend!="none"'), "backend")
    return row("Failures", [
        timeseries("Outcomes", "Finished requests per second by outcome (ok, client_cancelled, "
                   "upstream_error, upstream_truncated, timeout, gateway_error, rejected).",
                   targets((f"sum by (outcome) ({rate(req, BM)})", "{{outcome}}")),
                   "reqps", stack=True),
        timeseries("Backend error ratio",
                   "Requests that ended in an upstream error, a truncated stream or a timeout ÷ "
                   "requests sent to the backend. The alert fires above 5% for 5 minutes.",
                   targets((backend_errors, "{{backend}}")),
                   "percentunit", maximum=1, lines=((0.05, "red"),)),
        timeseries("Stream interruptions by reason",
                   "Committed streams that ended with an error event in the client's format.",
                   targets((f"sum by (reason) ({rate('slogate_stream_interruptions_total', BM)})",
                            "{{reason}}")),
                   "reqps", w=8),
        timeseries("Client cancellations by phase",
                   "Client disconnects by the phase they happened in (queued, prefill, decode).",
                   targets((f"sum by (phase) ({rate('slogate_cancellations_total', BM)})",
                            "{{phase}}")),
                   "reqps", w=8),
        timeseries("Upstream attempts by result",
                   "Upstream attempts per second: ok, or why one was retried or failed.",
                   targets((f"sum by (backend, result) "
                            f"({rate('slogate_upstream_attempts_total', BK)})",
                            "{{backend}} {{result}}")),
                   "reqps", w=8),
        state_timeline("Circuit breaker by backend",
                       "Worst breaker state of each backend across gateways: closed, half-open "
                       "(probing), open (not sent traffic).",
                       targets((f"max by (backend) "
                                f"({sel('slogate_backend_breaker_state', BK)})",
                                "{{backend}}")),
                       value_map(("0", "closed", "green"), ("1", "half-open", "yellow"),
                                 ("2", "open", "red")),
                       w=24, h=6),
        # The trust boundary: what hostile clients and upstreams ran into.
        timeseries("Limits hit by name",
                   "Requests and upstream attempts refused or ended by a limit (body timeout, "
                   "request or response too large, event too large, redirect, string too "
                   "long): README, The trust boundary.",
                   targets((f"sum by (limit) "
                            f"({rate('slogate_limits_exceeded_total', JOB)})", "{{limit}}")),
                   "reqps", w=8),
        timeseries("Client connections refused or closed",
                   "Listener limits: header deadline, idle keep-alive, connection caps in "
                   "total and per client address.",
                   targets((f"sum by (reason) "
                            f"({rate('slogate_connections_rejected_total', JOB)})",
                            "{{reason}}")),
                   "cps", w=8),
        timeseries("Open client connections",
                   "Client connections open now, per gateway (the caps are per gateway).",
                   targets((f"sum by (instance) ({sel('slogate_open_connections', JOB)})",
                            "{{instance}}")),
                   "short", w=8),
    ])


def overhead_row() -> dict[str, Any]:
    over = "slogate_gateway_overhead_seconds"
    return row("Gateway overhead", [
        timeseries("Gateway overhead per request",
                   "Time spent in gateway code for a request (ingress to upstream send, plus "
                   "relaying each read), P50 and P99 per backend.",
                   quantiles(over, BM, "backend", "{{backend}}", qs=(0.5, 0.99)), "s", w=8),
        timeseries("Gateway overhead per streamed token",
                   "Gateway CPU time per completion token (the design target is at most "
                   "20 µs per token with parsing and telemetry on).",
                   targets((f"sum({rate(over + '_sum', BM)}) / "
                            f"sum({rate('slogate_tokens_total', BM, COMPLETION)})",
                            "per token")),
                   "s", w=8, lines=((20e-6, "red"),)),
        timeseries("Gateway share of request time",
                   "Gateway overhead ÷ end-to-end duration, summed over requests.",
                   targets((f"sum({rate(over + '_sum', BM)}) / "
                            f"sum({rate('slogate_request_duration_seconds_sum', BMS)})",
                            "gateway share")),
                   "percentunit", w=8),
    ])


def traces_row() -> dict[str, Any]:
    return row("Traces", [
        text("How to get from here to a trace",
             "Every request's JSON access-log line carries its `trace_id`. Paste one into the "
             "**Trace id** box above to open that trace below (Jaeger, joined by vLLM's own "
             "spans when the engine exports to the same collector). On the latency panels, "
             "click a point for the traces of that backend and model at least that slow. "
             "Exemplars on the TTFT heatmap and P99 series link straight to their trace when "
             "the gateway exposes exemplars (the Prometheus datasource maps `trace_id` to "
             "Jaeger).", h=4),
        {"type": "traces", "title": "Trace ${trace_id}", "id": next(_ids), "_w": 24, "_h": 14,
         "datasource": JAEGER,
         "targets": [{"refId": "A", "datasource": JAEGER, "query": "${trace_id}"}],
         "fieldConfig": {"defaults": {}, "overrides": []}, "options": {}},
    ], collapsed=True)


def tenants_row() -> dict[str, Any]:
    """Per tenant (configured tenants + `other`): goodput, traffic, sheds, quotas."""
    def own(counter: str) -> str:
        judged_own = 'judged="own"'
        return f"sum by (tenant) ({rate(counter, JOB, judged_own)})"

    slo_req = "slogate_tenant_slo_requests_total"
    return row("Tenants", [
        timeseries("Goodput by tenant",
                   "Share of each tenant's judged requests that met their SLO class's TTFT and "
                   "TPOT targets. One tenant low while the others hold: its own traffic (see "
                   "its sheds and quota usage); every tenant low: capacity or a backend.",
                   targets((ratio_or_zero(rate(slo_req, JOB, MET), rate(slo_req, JOB), "tenant"),
                            "{{tenant}}")),
                   "percentunit", maximum=1),
        timeseries("Tenant goodput burn rate (1h)",
                   "How fast each tenant burns the goodput error budget over the last hour; "
                   "the SlogateTenantGoodputBudgetBurn alert fires above 14.4x (and 14.4x over "
                   "5 minutes).",
                   targets((sel("tenant:slogate_tenant_goodput_burn_rate:rate1h", JOB),
                            "{{tenant}}")),
                   "short", lines=((14.4, "red"),)),
        timeseries("Requests per second by tenant and outcome",
                   "Finished requests per second, per tenant and outcome.",
                   targets((f"sum by (tenant, outcome) "
                            f"({rate('slogate_tenant_requests_total', JOB)})",
                            "{{tenant}} {{outcome}}")),
                   "reqps", stack=True),
        timeseries("Tokens per second by tenant",
                   "Prompt and completion tokens per second per tenant (reported usage).",
                   targets((f"sum by (tenant, kind) ({rate('slogate_tenant_tokens_total', JOB)})",
                            "{{tenant}} {{kind}}")),
                   "short"),
        timeseries("Sheds by tenant and reason",
                   "Requests admission refused per second: over a quota (quota_*), the queue "
                   "full with this tenant's flow the one over its share, or its TTFT out of "
                   "reach.",
                   targets((f"sum by (tenant, reason) ({rate('slogate_tenant_sheds_total', JOB)})",
                            "{{tenant}} {{reason}}")),
                   "reqps", stack=True),
        timeseries("Quota usage by tenant",
                   "Share of each tenant's quotas in use (requests and tokens per minute, in "
                   "flight, queued), the highest of the gateways.",
                   targets((f"max by (tenant, quota) "
                            f"({sel('slogate_tenant_quota_usage_ratio', JOB)})",
                            "{{tenant}} {{quota}}")),
                   "percentunit", lines=((1.0, "red"),)),
        timeseries("Judged the tenant's own",
                   "What one tenant's requests did that the gateway kept from judging the "
                   "backend by, per second: first tokens far later than predicted (stalls) and "
                   "streams far slower than predicted that admission's estimators did not learn "
                   "(no other tenant saw them), and requests refused at once while the tenant "
                   "was held off a backend by its own failures. One tenant here while the "
                   "others' goodput holds: its traffic, not the engine.",
                   targets((own("slogate_tenant_ttft_stalls_total"), "{{tenant}} TTFT stalls"),
                           (own("slogate_tenant_tpot_slow_total"), "{{tenant}} slow streams"),
                           (f"sum by (tenant) "
                            f"({rate('slogate_tenant_held_requests_total', JOB)})",
                            "{{tenant}} refused while held")),
                   "reqps"),
    ])


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": PROM,
                "query": query, "refresh": 2, "includeAll": True, "multi": True,
                "allValue": ".*", "sort": 1, "regex": "", "hide": 0, "options": [],
                "current": {"text": ["All"], "value": ["$__all"]}}
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "refresh": 1, "regex": "", "hide": 0, "includeAll": False, "multi": False,
         "options": []},
        query_var("job", "Job", "label_values(slogate_requests_in_flight, job)"),
        query_var("backend", "Backend",
                  'label_values(slogate_requests_total{job=~"$job"}, backend)'),
        query_var("model", "Model",
                  'label_values(slogate_requests_total{job=~"$job", backend=~"$backend"}, model)'),
        query_var("slo_class", "SLO class",
                  'label_values(slogate_slo_requests_total{job=~"$job"}, slo_class)'),
        {"name": "trace_id", "label": "Trace id", "type": "textbox", "query": "", "hide": 0,
         "current": {"text": "", "value": ""}, "options": []},
    ]


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Place panels left to right in rows of 24 columns; strip the private _w/_h keys."""
    y = 0
    out = []
    for r in panels:
        r["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
        y += 1
        x, row_h, placed = 0, 0, []
        for p in r["panels"]:
            w, h = p.pop("_w"), p.pop("_h")
            if x + w > 24:
                x, y, row_h = 0, y + row_h, 0
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            x += w
            row_h = max(row_h, h)
            placed.append(p)
        y += row_h
        if r["collapsed"]:
            out.append(r)  # a collapsed row holds its panels
        else:
            r["panels"] = []
            out.extend([r, *placed])
    return out


def dashboard() -> dict[str, Any]:
    rows = [slo_row(), latency_row(), waited_row(), stages_row(), admission_row(),
            tenants_row(), traffic_row(), failures_row(), overhead_row(), traces_row()]
    return {
        "id": None,
        "uid": "slogate",
        "title": "slogate: LLM gateway SLOs",
        "description": "Goodput and error budget per SLO class, TTFT/TPOT/ITL/E2E latency, "
                       "per-stage split, admission, traffic, failures and gateway overhead of "
                       "the slogate streaming gateway. Generated by "
                       "dashboards/grafana/generate.py.",
        "tags": ["slogate", "llm", "slo"],
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "schemaVersion": 42,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "weekStart": "",
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": variables()},
        "panels": layout(rows),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
