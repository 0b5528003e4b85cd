"""Prometheus exposition for one simulator app (its own CollectorRegistry).

Gauges and counters are read from the engine's plain integers at scrape time (no per-token
metric calls); the latency histograms are observed once per finished request.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import PHASES, Engine, Seq

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
PHASE_BUCKETS = [0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineCollector(Collector):
    def __init__(self, sim: Any) -> None:
        self.sim = sim  # server.SimState: engine, cfg, counters

    def collect(self) -> Iterator[Metric]:
        sim = self.sim
        eng: Engine = sim.engine
        labels = ["model_name", "engine"]
        lv = [eng.cfg.served_model_names[0], "0"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    eng.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    eng.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    eng.kv_usage())
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      eng.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      eng.generation_tokens_total)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      eng.prefix_queries_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      eng.prefix_hits_tokens)
        rs = CounterMetricFamily("vllm:request_success",
                                 "Count of successfully processed requests.",
                                 labels=[*labels, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            rs.add_metric(lv + [reason], eng.finished_by_reason.get(reason, 0))
        yield rs
        cc = CounterMetricFamily("sim_cancellations", "Requests removed from the simulated engine "
                                 "because the client went away, by phase.", labels=["phase"])
        for p in PHASES:
            cc.add_metric([p], eng.cancellations[p])
        yield cc
        yield CounterMetricFamily("sim_requests", "Completion requests received by the simulator.",
                                  value=sim.requests_total)
        fc = CounterMetricFamily("sim_faults", "Injected faults, by kind.", labels=["kind"])
        for kind, n in sorted(sim.faults.items()):
            fc.add_metric([kind], n)
        yield fc


class SimMetrics:
    def __init__(self, sim: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(sim))
        eng: Engine = sim.engine
        ln = ["model_name", "engine"]
        lv = (eng.cfg.served_model_names[0], "0")
        r = self.registry

        def hist(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(name, doc, ln, buckets=buckets, registry=r).labels(*lv)

        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", PHASE_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", PHASE_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", PHASE_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", PHASE_BUCKETS)
        eng.on_finished = self.observe

    def observe(self, s: Seq) -> None:
        self.ttft.observe(s.t_first - s.t_arrival)
        self.e2e.observe(s.t_end - s.t_arrival)
        self.queue.observe(s.t_scheduled - s.t_arrival)
        self.prefill.observe(s.t_first - s.t_scheduled)
        self.decode.observe(s.t_last - s.t_first)
        if s.generated > 1:
            self.tpot.observe((s.t_last - s.t_first) / (s.generated - 1))
