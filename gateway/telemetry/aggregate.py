"""One `/metrics` for the worker processes of one host (`slogate serve --workers N`).

prometheus_client's multiprocess mode covers its own Counter/Gauge/Histogram classes through
mmap files, but not collectors of our own (telemetry/prometheus.py's bulk `Histogram`, the
process collector). So each worker publishes its whole registry instead: every `interval_s` it
writes what its registry collects (families and samples, exemplars included, as JSON: about a
tenth of the cost of rendering the text format) to `<dir>/w<i>.json` (write, then rename: a
reader never sees half a file). The worker that answers a scrape collects its own registry
live, reads the others' files and merges them (`merge`), then renders the result in whichever
format the scraper asked for:

- counters, histograms and summaries: summed per series (`_created` takes the earliest);
- gauges: summed (requests in flight, queued, open connections, queue depth, memory, fds),
  except those that describe one worker's own state, which keep a `worker` label
  (`PER_WORKER_GAUGES`: breaker state, health-check verdict, shared-state mode, process start
  time and fd limit);
- exemplars: the newest one of a bucket, whichever worker had it.

A worker that died leaves its counters behind: the supervisor folds its last file into
`dead.json` (counters and histograms only; its gauges describe nothing any more), so host-wide
counters never go backwards when a worker is restarted — at most the increments of its last
`interval_s` are lost. The supervisor's own series (restarts, workers alive) are in
`supervisor.json`. A scrape therefore sees other workers' series at most `interval_s` old.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar, Sample

PER_WORKER_GAUGES = frozenset({
    "slogate_backend_breaker_state", "slogate_backend_healthy",
    "slogate_admission_shared_state", "process_start_time_seconds", "process_max_fds",
})
DEAD = "dead.json"
SUPERVISOR = "supervisor.json"
WORKER_LABEL = "worker"


def worker_file(index: int) -> str:
    return f"w{index}.json"


def _ts(t: Any) -> float:
    return 0.0 if t is None else float(t)


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)  # JSON has no inf / nan


def dump(metrics: Iterable[Metric]) -> bytes:
    """Families and samples as JSON (what `load` reads back)."""
    out = []
    for m in metrics:
        samples = []
        for s in m.samples:
            ex = s.exemplar
            samples.append([s.name, s.labels, _num(s.value),
                            None if s.timestamp is None else _ts(s.timestamp),
                            None if ex is None else [ex.labels, _num(ex.value),
                                                     None if ex.timestamp is None
                                                     else _ts(ex.timestamp)]])
        out.append([m.name, m.documentation, m.type, m.unit, samples])
    return orjson.dumps(out)


def load(data: bytes) -> list[Metric]:
    out = []
    for name, doc, typ, unit, samples in orjson.loads(data):
        m = Metric(name, doc, typ, unit)
        for sname, labels, value, ts, ex in samples:
            exemplar = None if ex is None else Exemplar(ex[0], float(ex[1]), ex[2])
            m.samples.append(Sample(sname, labels, float(value), ts, exemplar))
        out.append(m)
    return out


def snapshot(registry: CollectorRegistry) -> bytes:
    """What a worker publishes: its registry, collected now."""
    return dump(registry.collect())


def render_openmetrics(registry: CollectorRegistry) -> bytes:
    text: bytes = om_latest(registry)  # type: ignore[no-untyped-call]
    return text


def publish(directory: str | os.PathLike[str], name: str, data: bytes) -> None:
    """Write `data` to directory/name atomically (a reader sees the old or the new file)."""
    path = Path(directory) / name
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def merge(sources: Iterable[tuple[str, bool, Iterable[Metric]]],
          tally: str | None = None) -> list[Metric]:
    """Merge registries: `sources` are (worker name, alive, its metric families). Dead sources
    contribute counters and histograms, never gauges. With `tally` (a counter's sample name),
    add `slogate_worker_requests_total{worker}`: that counter's total per source, which says
    how the host's load spread over its workers."""
    families: dict[str, Metric] = {}
    tallies: dict[str, float] = {}
    # family -> {series key (labels without le/quantile) -> {sample key -> [Sample fields]}}
    series: dict[str, dict[tuple[Any, ...], dict[tuple[Any, ...], list[Any]]]] = {}
    for worker, alive, metrics in sources:
        for fam in metrics:
            gauge = fam.type == "gauge"
            if gauge and not alive:
                continue
            per_worker = gauge and fam.name in PER_WORKER_GAUGES
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                series[fam.name] = {}
            groups = series[fam.name]
            for s in fam.samples:
                if s.name == tally:
                    tallies[worker] = tallies.get(worker, 0.0) + s.value
                labels = dict(s.labels)
                if per_worker:
                    labels[WORKER_LABEL] = worker
                group = tuple(sorted((k, v) for k, v in labels.items()
                                     if k not in ("le", "quantile")))
                key = (s.name, tuple(sorted(labels.items())))
                samples = groups.setdefault(group, {})
                cur = samples.get(key)
                if cur is None:
                    samples[key] = [s.name, labels, s.value, s.timestamp, s.exemplar]
                    continue
                if s.name.endswith("_created"):
                    cur[2] = min(cur[2], s.value)
                else:
                    cur[2] += s.value
                ex = s.exemplar
                if ex is not None and (cur[4] is None or _ts(ex.timestamp) >=
                                       _ts(cur[4].timestamp)):
                    cur[4] = ex
    out = []
    for name, fam in families.items():
        for samples in series[name].values():
            for n, labels, value, ts, ex in samples.values():
                fam.samples.append(Sample(n, labels, value, ts, ex))
        out.append(fam)
    if tally is not None:
        fam = Metric("slogate_worker_requests", "Finished requests per worker process of this "
                     "host (dead: the workers that exited, together).", "counter")
        for worker, value in sorted(tallies.items()):
            fam.samples.append(Sample("slogate_worker_requests_total", {WORKER_LABEL: worker},
                                      value, None, None))
        out.append(fam)
    return out


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def merged_registry(metrics: list[Metric]) -> CollectorRegistry:
    """A registry that exposes `metrics` as they are (for either encoder)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(metrics))
    return registry


def read_sources(directory: str | os.PathLike[str],
                 skip: str | None = None) -> list[tuple[str, bool, list[Metric]]]:
    """The published registries in `directory`: live workers' files, the dead workers' fold
    and the supervisor's; `skip` (the caller's own file) is left out."""
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name == skip:
            continue
        with contextlib.suppress(OSError, orjson.JSONDecodeError, ValueError, TypeError):
            metrics = load(path.read_bytes())
            name = path.stem[1:] if path.name.startswith("w") else path.stem
            out.append((name, path.name != DEAD, metrics))
    return out


def host_exposition(own: CollectorRegistry, own_index: int, directory: str,
                    encoder: Callable[[CollectorRegistry], bytes]) -> bytes:
    """What GET /metrics answers on a worker: every worker's series, merged."""
    sources: list[tuple[str, bool, Iterable[Metric]]] = [
        (str(own_index), True, list(own.collect()))]
    sources += read_sources(directory, skip=worker_file(own_index))
    return encoder(merged_registry(merge(sources, tally="slogate_requests_total")))


def fold_dead(directory: str, index: int) -> None:
    """The supervisor, when worker `index` died: fold its last counters into dead.om."""
    d = Path(directory)
    path = d / worker_file(index)
    try:
        metrics = load(path.read_bytes())
    except (OSError, orjson.JSONDecodeError, ValueError, TypeError):
        return
    sources: list[tuple[str, bool, Iterable[Metric]]] = [("dead", False, metrics)]
    with contextlib.suppress(OSError, orjson.JSONDecodeError, ValueError, TypeError):
        sources.insert(0, ("dead", False, load((d / DEAD).read_bytes())))
    publish(d, DEAD, dump(merge(sources)))
    path.unlink(missing_ok=True)
