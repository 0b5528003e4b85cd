"""A labelled Prometheus counter, and an unlabelled gauge, without prometheus_client's
per-update lock and checks.

The gateway counts a dozen things per request, all on its one event-loop thread, and
prometheus_client's Counter and Gauge take a lock and re-check their labels on every update
(~0.9 µs each; these are a float add). The exposition is prometheus_client's own: a counter's
`<name>_total` and `<name>_created` samples per series, in the order the series were created,
a gauge's one sample (`tests/unit/test_counter.py` compares them).
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, metrics as _client_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class CounterChild:
    """One series: what `Counter.labels(...)` returns."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class Counter(Collector):
    """`Counter(name, documentation, labelnames, registry=...)`; `labels(*values).inc(n)`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], CounterChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        if len(values) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        key = tuple(str(v) for v in values)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = CounterChild()
        return child

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        # prometheus_client's switch (disable_created_metrics, PROMETHEUS_DISABLE_CREATED_SERIES)
        created = getattr(_client_metrics, "_use_created", True)
        for labels, child in list(self._series.items()):
            fam.add_metric(labels, child.value, created=child.created if created else None)
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class Gauge(Collector):
    """An unlabelled gauge: `Gauge(name, documentation, registry=...)`; inc, dec, set."""

    def __init__(self, name: str, documentation: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0.0
        if registry is not None:
            registry.register(self)

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=self.value)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation)
