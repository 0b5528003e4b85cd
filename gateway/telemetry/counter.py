"""A labelled Prometheus counter without prometheus_client's per-increment lock and checks.

The gateway counts a dozen things per request, all on its one event-loop thread, and
prometheus_client's Counter takes a lock and re-checks its labels on every `inc` (~0.9 µs
each; this one is a float add). The exposition is prometheus_client's own: the family's
`<name>_total` and `<name>_created` samples per series, in the order the series were created
(`tests/test_unit_counter.py` compares the two).
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, metrics as _client_metrics
from prometheus_client.core import CounterMetricFamily, Metric
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
