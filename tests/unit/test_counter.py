"""gateway/telemetry/counter.py's Counter and Gauge are exposed exactly as prometheus_client's,
in both exposition formats (only the `_created` timestamps differ: each series has its own)."""
from __future__ import annotations

import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from gateway.telemetry.counter import Counter, Gauge


def _exposed(cls: type) -> tuple[str, str]:
    registry = CollectorRegistry(auto_describe=True)
    c = cls("slogate_things", "Things by kind.", ("backend", "kind"), registry=registry)
    cls("slogate_unused_total", "A family without series yet.", ("reason",), registry=registry)
    c.labels("b", "x").inc()
    c.labels("b", 'y "quoted"\n').inc(2.5)
    c.labels("a", "x").inc(0)
    c.labels("b", "x").inc(3)
    g = (Gauge if cls is Counter else prometheus_client.Gauge)(
        "slogate_level", "A level.", registry=registry)
    g.inc()
    g.inc(2)
    g.dec(0.5)
    created = re.compile(r"(_created\{[^}]*\}) \S+")
    return tuple(created.sub(r"\1 T", f(registry).decode())  # type: ignore[return-value]
                 for f in (generate_latest, om_latest))


def test_exposition_is_prometheus_clients() -> None:
    ours, theirs = _exposed(Counter), _exposed(prometheus_client.Counter)
    assert ours == theirs
    assert 'slogate_things_total{backend="b",kind="x"} 4.0' in ours[0]
    assert "slogate_level 2.5" in ours[0]


def test_a_counter_only_goes_up_and_takes_its_labels() -> None:
    c = Counter("slogate_c", "c", ("a",))
    with pytest.raises(ValueError):
        c.labels("x").inc(-1)
    with pytest.raises(ValueError):
        c.labels("x", "y")
    assert c.labels("x") is c.labels("x")
