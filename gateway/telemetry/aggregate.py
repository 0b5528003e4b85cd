"""One `/metrics` for the worker processes of one host (`slogate serve --workers N`).

prometheus_client's multiprocess mode covers its own Counter/Gauge/Histogram classes through
mmap files, but not collectors of our own (telemetry/prometheus.py's bulk `Histogram`, the
process collector). So each worker publishes its whole registry instead: every `interval_s`,
and on every scrape it answers, it writes what its registry collects (families and samples,
exemplars included, as JSON: about a tenth of the cost of rendering the text format) to
`<dir>/w<i>.json` (write, then rename: a reader never sees half a file). The worker that
answers a scrape collects its own registry, publishes exactly that, reads the others' files and
merges them (`merge`), then renders the result in whichever format the scraper asked for:

- counters, histograms and summaries: summed per series (`_created` takes the earliest);
- gauges: summed (requests in flight, queued, open connections, queue depth, memory, fds),
  except those that describe one worker's own state, which keep a `worker` label
  (`PER_WORKER_GAUGES`: breaker state, health-check verdict, shared-state mode, process start
  time and fd limit);
- exemplars: the newest one of a bucket, whichever worker had it.

Counters never go backwards, whichever worker answers and whichever dies:

- a worker exposes only what it has published (it publishes before it answers), so a value a
  scrape saw is on disk, and the next scrape — answered by this worker or another — sees it or
  more;
- a worker that died leaves its counters behind: the supervisor folds its last file into
  `dead.json` (counters and histograms only; its gauges describe nothing any more), then
  removes its file. Every file names the process that wrote it (`source`: pid and start time,
  never reused) and `dead.json` lists the ones folded into it (`covers`); a reader reads
  `dead.json` last and skips any worker file it covers, so a fold that happens while a scrape
  reads counts the dead worker once — never twice, never not at all.

What a SIGKILLed worker counted after its last publish (at most `interval_s` of its work) is
lost: no scrape saw it, so no counter goes down, but the host's totals miss it. A worker that
exits on its own publishes on its way out. The supervisor's own series (restarts, workers
alive) are in `supervisor.json`. A scrape sees other workers' series at most `interval_s` old.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
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
TALLY = "slogate_requests_total"  # the counter slogate_worker_requests_total splits by worker


def worker_file(index: int) -> str:
    return f"w{index}.json"


def _ts(t: Any) -> float:
    return 0.0 if t is None else float(t)


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)  # JSON has no inf / nan


@dataclass
class Published:
    """One published file: a registry's families, the process that wrote it (`source`), and
    for dead.json the processes folded into it (`covers`) and their finished requests per
    worker index (`tallies`)."""

    metrics: list[Metric]
    source: str = ""
    covers: frozenset[str] = frozenset()
    tallies: dict[str, float] = field(default_factory=dict)


def source_id() -> str:
    """This process, as no other process of the host's life will be (a pid can be reused)."""
    return f"{os.getpid()}-{time.time_ns()}"


def dump(metrics: Iterable[Metric], source: str = "", covers: Iterable[str] = (),
         tallies: dict[str, float] | None = None) -> bytes:
    """Families and samples as JSON, with who wrote them (what `load` reads back)."""
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
    return orjson.dumps({"source": source, "covers": sorted(covers),
                         "tallies": tallies or {}, "metrics": out})


def load(data: bytes) -> Published:
    doc = orjson.loads(data)
    out = []
    for name, doc_, typ, unit, samples in doc["metrics"]:
        m = Metric(name, doc_, typ, unit)
        for sname, labels, value, ts, ex in samples:
            exemplar = None if ex is None else Exemplar(ex[0], float(ex[1]), ex[2])
            m.samples.append(Sample(sname, labels, float(value), ts, exemplar))
        out.append(m)
    return Published(out, str(doc["source"]), frozenset(doc["covers"]),
                     {str(k): float(v) for k, v in doc["tallies"].items()})


def snapshot(registry: CollectorRegistry, source: str = "") -> bytes:
    """What a worker publishes: its registry, collected now."""
    return dump(registry.collect(), source)


def render_openmetrics(registry: CollectorRegistry) -> bytes:
    text: bytes = om_latest(registry)  # type: ignore[no-untyped-call]
    return text


def publish(directory: str | os.PathLike[str], name: str, data: bytes) -> None:
    """Write `data` to directory/name atomically (a reader sees the old or the new file)."""
    path = Path(directory) / name
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


Source = tuple[str, bool, Iterable[Metric]]  # (worker name, alive, its metric families)


def exact_partials(values: Iterable[float]) -> list[float]:
    """`values` as a few non-overlapping floats whose exact sum is the exact sum of `values`
    (Shewchuk's algorithm, as in math.fsum): what dead.json keeps of a series, so that adding
    a dead worker to it rounds nothing."""
    partials: list[float] = []
    for x in values:
        if not math.isfinite(x):
            partials.append(x)
            continue
        i = 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]
    return partials


def merge(sources: Iterable[Source], tally: str | None = None,
          tallied: dict[str, float] | None = None, exact: bool = False) -> list[Metric]:
    """Merge registries: `sources` are (worker name, alive, its metric families). Dead sources
    contribute counters and histograms, never gauges. A sample's value is the correctly rounded
    sum of its sources' values (math.fsum): the same whichever order the sources come in, so a
    sum of counters that grew is never smaller (`exact`: the exact partials instead, one sample
    each, for dead.json). A source may give a sample more than once: its values add. With
    `tally` (a counter's sample name), add `slogate_worker_requests_total{worker}`: that
    counter's total per live source, plus what `tallied` says the dead of each worker index
    had, which says how the host's load spread over its workers."""
    families: dict[str, Metric] = {}
    tallies: dict[str, list[float]] = {k: [v] for k, v in (tallied or {}).items()}
    # family -> {series key (labels without le/quantile) -> {sample key -> [Sample fields]}}
    # where a sample's value is the list of what its sources gave
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
                if s.name == tally and alive:
                    tallies.setdefault(worker, []).append(s.value)
                labels = dict(s.labels)
                if per_worker:
                    labels[WORKER_LABEL] = worker
                group = tuple(sorted((k, v) for k, v in labels.items()
                                     if k not in ("le", "quantile")))
                key = (s.name, tuple(sorted(labels.items())))
                samples = groups.setdefault(group, {})
                cur = samples.get(key)
                if cur is None:
                    samples[key] = [s.name, labels, [s.value], s.timestamp, s.exemplar]
                    continue
                if s.name.endswith("_created"):
                    cur[2][0] = min(cur[2][0], s.value)
                else:
                    cur[2].append(s.value)
                ex = s.exemplar
                if ex is not None and (cur[4] is None or _ts(ex.timestamp) >=
                                       _ts(cur[4].timestamp)):
                    cur[4] = ex
    out = []
    for name, fam in families.items():
        for samples in series[name].values():
            for n, labels, values, ts, ex in samples.values():
                if not exact:
                    fam.samples.append(Sample(n, labels, math.fsum(values), ts, ex))
                    continue
                for i, v in enumerate(exact_partials(values) or [0.0]):
                    fam.samples.append(Sample(n, labels, v, ts, ex if i == 0 else None))
        out.append(fam)
    if tally is not None:
        fam = Metric("slogate_worker_requests", "Finished requests per worker index of this "
                     "host (the processes that had that index, dead ones included).", "counter")
        for worker, values in sorted(tallies.items(), key=lambda kv: (len(kv[0]), kv[0])):
            fam.samples.append(Sample("slogate_worker_requests_total", {WORKER_LABEL: worker},
                                      math.fsum(values), None, None))
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


def _read(path: Path) -> Published | None:
    try:
        return load(path.read_bytes())
    except (OSError, orjson.JSONDecodeError, ValueError, TypeError, KeyError):
        return None  # gone (folded since it was listed), or not ours


def read_sources(directory: str | os.PathLike[str],
                 skip: str | None = None) -> tuple[list[Source], dict[str, float]]:
    """The published registries in `directory` and the dead's tallies per worker index: live
    workers' files and the supervisor's first, the dead workers' fold last (so a worker file
    that a fold removed while this read is in that fold, and a worker file read before its
    fold is skipped as covered by it); `skip` (the caller's own file) is left out."""
    d = Path(directory)
    found: list[tuple[str, Published]] = []
    for path in sorted(d.glob("*.json")):
        if path.name in (skip, DEAD):
            continue
        published = _read(path)
        if published is not None:
            found.append((path.stem[1:] if path.name.startswith("w") else path.stem, published))
    dead = _read(d / DEAD)
    covers = dead.covers if dead is not None else frozenset()
    out: list[Source] = [(name, True, p.metrics) for name, p in found
                         if not p.source or p.source not in covers]
    if dead is None:
        return out, {}
    out.append(("dead", False, dead.metrics))
    return out, dead.tallies


def host_exposition(own: CollectorRegistry, own_index: int, directory: str,
                    encoder: Callable[[CollectorRegistry], bytes], source: str = "") -> bytes:
    """What GET /metrics answers on a worker: every worker's series, merged. The worker's own
    series are published first, as collected for this answer: what a scrape saw of a worker
    is on disk for the next scrape, whichever worker answers it."""
    metrics = list(own.collect())
    # If this cannot be written, the scrape fails (Prometheus: a failed scrape, not a reset).
    publish(directory, worker_file(own_index), dump(metrics, source))
    sources: list[Source] = [(str(own_index), True, metrics)]
    others, tallied = read_sources(directory, skip=worker_file(own_index))
    sources += others
    return encoder(merged_registry(merge(sources, tally=TALLY, tallied=tallied)))


def fold_dead(directory: str, index: int) -> None:
    """The supervisor, when worker `index` died: fold its last counters into dead.json (which
    then covers its source), then remove its file and any half-written one it left."""
    d = Path(directory)
    path = d / worker_file(index)
    last = _read(path)
    if last is not None:
        dead = _read(d / DEAD) or Published([])
        if not last.source or last.source not in dead.covers:
            tallies = dict(dead.tallies)
            key = str(index)
            tallies[key] = math.fsum([tallies.get(key, 0.0)] + [
                s.value for m in last.metrics for s in m.samples if s.name == TALLY])
            merged = merge([("dead", False, dead.metrics), ("dead", False, last.metrics)],
                           exact=True)
            covers = dead.covers | ({last.source} if last.source else set())
            publish(d, DEAD, dump(merged, covers=covers, tallies=tallies))
    path.unlink(missing_ok=True)
    for tmp in d.glob(f".{worker_file(index)}.*.tmp"):
        tmp.unlink(missing_ok=True)
