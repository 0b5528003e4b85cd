"""`slogate serve --workers N`: the host-local slot table, the metrics merge, and the supervisor
with real worker processes on one port (SO_REUSEPORT) in front of the simulator."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway import config
from gateway.admission.hostlocal import SlotTable
from gateway.ops import cli
from gateway.ops.workers import WorkerContext, parse_workers, worker_env
from gateway.telemetry import aggregate
from gateway.telemetry.prometheus import Metrics
from tests.support.procs import Proc, slogate
from tests.support.waiting import wait_until

# -- the slot table --------------------------------------------------------------------------


def _hammer(path: str, workers: int, index: int, cap: int, rounds: int, q: object) -> None:
    table = SlotTable(path, workers, index)
    held, worst = 0, 0
    for i in range(rounds):
        if table.try_acquire("backend:sim", cap):
            held += 1
            worst = max(worst, table.in_use("backend:sim"))
        if held and i % 3 == 0:
            table.release("backend:sim")
            held -= 1
    q.put((index, held, worst))  # type: ignore[attr-defined]


def test_slot_table_holds_a_cap_exactly_across_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "slots")
    SlotTable(path, 4).close()
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(path, 4, i, 5, 3000, q)) for i in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    table = SlotTable(path, 4)
    snap = table.snapshot()["backend:sim"]
    assert max(worst for _i, _held, worst in results) == 5  # the cap was reached, never passed
    assert snap["by_worker"] == [held for _i, held, _w in sorted(results)]
    assert snap["total"] <= 5
    # A dead worker's slots free when the supervisor clears its column.
    busiest = max(range(4), key=lambda i: snap["by_worker"][i])
    held = snap["by_worker"][busiest]
    assert table.clear_worker(busiest) == ({"backend:sim": held} if held else {})
    assert table.in_use("backend:sim") == snap["total"] - held


def test_slot_table_keys_and_release_are_per_worker(tmp_path: Path) -> None:
    a = SlotTable(tmp_path / "t", 2, 0)
    b = SlotTable(tmp_path / "t", 2, 1)
    assert a.try_acquire("tenant:team-a", 2) and b.try_acquire("tenant:team-a", 2)
    assert not a.try_acquire("tenant:team-a", 2)
    assert b.try_acquire("backend:x", 1)
    assert not a.release("backend:x")  # never another worker's slot
    assert b.release("tenant:team-a") and b.in_use("tenant:team-a") == 1
    a.force_acquire("backend:x")
    assert a.snapshot() == {"tenant:team-a": {"total": 1, "by_worker": [1, 0]},
                            "backend:x": {"total": 2, "by_worker": [1, 1]}}
    with pytest.raises(ValueError, match="is for 2 workers"):
        SlotTable(tmp_path / "t", 3, 0)


# -- the metrics merge -----------------------------------------------------------------------


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_merge_sums_counters_and_histograms_and_keeps_per_worker_gauges(tmp_path: Path) -> None:
    ms = [Metrics([0.5], ["interactive"], ["b"]) for _ in range(3)]
    labels = ("b", "m", "/v1/chat/completions", "interactive")
    for i, m in enumerate(ms):
        m.requests.labels("b", "m", "/v1/chat/completions", "ok").inc(i + 1)
        m.ttft.observe(labels, 0.1 * (i + 1), trace_id=f"t{i}")
        m.in_flight.set(10 * (i + 1))
        m.breaker.labels("b").set(i)
    d = tmp_path / "metrics"
    d.mkdir()
    for i in (1, 2):
        aggregate.publish(d, aggregate.worker_file(i), aggregate.snapshot(ms[i].registry))
    # worker 2 dies: its counters stay, its gauges go
    aggregate.fold_dead(str(d), 2)
    assert not (d / "w2.json").exists() and (d / aggregate.DEAD).exists()
    body = aggregate.host_exposition(ms[0].registry, 0, str(d),
                                     generate_latest)
    v = _values(body.decode())
    req = ("slogate_requests_total", (("backend", "b"), ("model", "m"), ("outcome", "ok"),
                                      ("route", "/v1/chat/completions")))
    assert v[req] == 1 + 2 + 3
    hl = (("backend", "b"), ("model", "m"), ("route", "/v1/chat/completions"),
          ("slo_class", "interactive"))
    assert v[("slogate_time_to_first_token_seconds_count", hl)] == 3
    assert v[("slogate_time_to_first_token_seconds_sum", hl)] == pytest.approx(0.6)
    bucket = tuple(sorted((("le", "0.25"),) + hl))
    assert v[("slogate_time_to_first_token_seconds_bucket", bucket)] == 2
    assert v[("slogate_requests_in_flight", ())] == 10 + 20  # worker 2's gauge is gone
    assert v[("slogate_backend_breaker_state", (("backend", "b"), ("worker", "0")))] == 0
    assert v[("slogate_backend_breaker_state", (("backend", "b"), ("worker", "1")))] == 1
    assert ("slogate_backend_breaker_state", (("backend", "b"), ("worker", "2"))) not in v
    assert v[("slogate_worker_requests_total", (("worker", "0"),))] == 1
    assert v[("slogate_worker_requests_total", (("worker", "2"),))] == 3  # its index keeps it
    # OpenMetrics keeps exemplars through the merge
    om = aggregate.host_exposition(ms[0].registry, 0, str(d),
                                   aggregate.render_openmetrics).decode()
    assert 'trace_id="t0"' in om and 'trace_id="t2"' in om


def test_a_merged_sum_is_the_same_whichever_worker_answers_and_after_a_fold(
        tmp_path: Path) -> None:
    """Float sums depend on their order (1 + 2^-53 + 2^-53 is 1, 2^-53 + 2^-53 + 1 is not):
    a histogram's _sum must come out the same from every worker, and after a worker's fold,
    or Prometheus sees the smaller one as a counter reset."""
    d = tmp_path / "metrics"
    d.mkdir()
    labels = ("b", "m", "/v1/chat/completions", "interactive")
    ms = [Metrics([0.5], ["interactive"], ["b"]) for _ in range(3)]
    for m, value in zip(ms, (2.0 ** -53, 2.0 ** -53, 1.0), strict=True):
        m.ttft.observe(labels, value)
    hl = (("backend", "b"), ("model", "m"), ("route", "/v1/chat/completions"),
          ("slo_class", "interactive"))

    def ttft_sum(index: int) -> float:
        for i, m in enumerate(ms):
            if i != index:
                aggregate.publish(d, aggregate.worker_file(i), aggregate.snapshot(m.registry))
        v = _values(aggregate.host_exposition(ms[index].registry, index, str(d),
                                              generate_latest).decode())
        return v[("slogate_time_to_first_token_seconds_sum", hl)]

    exact = 1.0 + 2.0 ** -52
    assert [ttft_sum(i) for i in range(3)] == [exact] * 3
    # Workers 0 and 2 die (dead.json: 2^-53, then 1; rounded, that would be 1 and the host's
    # sum 1 once worker 1 is added); their successors have observed nothing yet.
    for i in (0, 2):
        aggregate.fold_dead(str(d), i)
        ms[i] = Metrics([0.5], ["interactive"], ["b"])
        assert [ttft_sum(i) for i in range(3)] == [exact] * 3


def _die_and_fold(directory: str, incarnations: int, q: object) -> None:
    """Worker 1 over and over: publish a few growing snapshots, die, be folded (the
    supervisor's part), and come back as a new process; reports how many requests it made."""
    import random

    rng = random.Random(7)
    labels = ("b", "m", "/v1/chat/completions", "interactive")
    total = 0
    for k in range(incarnations):
        m = Metrics([0.5], ["interactive"], ["b"])
        for _ in range(rng.randint(1, 4)):
            for _ in range(rng.randint(1, 5)):
                m.requests.labels("b", "m", "/v1/chat/completions", "ok").inc()
                m.ttft.observe(labels, rng.random() / 3)  # sums that round differently
                total += 1
            aggregate.publish(directory, aggregate.worker_file(1),
                              aggregate.snapshot(m.registry, f"w1-{k}"))
        aggregate.fold_dead(directory, 1)
    q.put(total)  # type: ignore[attr-defined]


def test_a_scrape_never_goes_backwards_while_workers_die_and_are_folded(tmp_path: Path) -> None:
    """A reader (worker 0 answering scrapes) against a process that plays worker 1 dying 300
    times and the supervisor folding it: whenever the fold lands in a read, no counter or
    histogram sample goes down, and at the end the host counts every request once."""
    d = tmp_path / "metrics"
    d.mkdir()
    own = Metrics([0.5], ["interactive"], ["b"])
    own_requests = own.requests.labels("b", "m", "/v1/chat/completions", "ok")
    labels = ("b", "m", "/v1/chat/completions", "interactive")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    writer = ctx.Process(target=_die_and_fold, args=(str(d), 300, q))
    writer.start()
    last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    decreases, scrapes = [], 0
    while True:
        done = not writer.is_alive()
        own_requests.inc()
        own.ttft.observe(labels, 0.1 + scrapes % 7 / 70)
        v = _values(aggregate.host_exposition(own.registry, 0, str(d), generate_latest,
                                              "w0").decode())
        scrapes += 1
        for key, value in v.items():
            if key[0].endswith(("_total", "_bucket", "_count", "_sum")) and \
                    value < last.get(key, 0.0):
                decreases.append((key, last[key], value))
            last[key] = value
        if done:
            break
    writer.join(10)
    made = q.get(timeout=10)
    req = ("slogate_requests_total", (("backend", "b"), ("model", "m"), ("outcome", "ok"),
                                      ("route", "/v1/chat/completions")))
    assert scrapes > 50
    assert not decreases, decreases[:10]
    assert v[req] == made + own_requests.value
    assert v[("slogate_worker_requests_total", (("worker", "1"),))] == made


def test_workers_argument() -> None:
    assert parse_workers("3") == 3
    assert parse_workers("auto") == len(os.sched_getaffinity(0))
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError):
            parse_workers(bad)
    assert cli.main(["serve", "--config", "/nonexistent.toml", "--workers", "0"]) == 2
    # ... or `[server] workers` in the config, which --workers overrides.
    backends = [{"name": "b", "base_url": "http://127.0.0.1:9/v1"}]

    def workers_key(value: object) -> object:
        return config.parse({"auth": {"mode": "open"}, "server": {"workers": value},
                             "backends": backends}).server.workers

    assert workers_key(4) == 4 and workers_key("auto") == "auto"
    assert config.parse({"auth": {"mode": "open"}, "backends": backends}).server.workers == 1
    for wrong in (0, -2, "many", True, 2.0):
        with pytest.raises(config.ConfigError, match="server.workers"):
            workers_key(wrong)
    ctx = WorkerContext("/tmp/x", 1, 4)
    assert ctx.split_connections(4096, 256) == (1024, 85)  # 64 + 3 sigma of Binomial(256, 1/4)
    assert WorkerContext("/tmp/x", 0, 2).split_connections(4096, 256) == (2048, 152)
    assert WorkerContext("/tmp/x", 0, 2).split_connections(4096, 4) == (2048, 4)
    assert ctx.split_connections(3, 0) == (1, 0)
    assert WorkerContext.parse("/tmp/a,b,2,3,77") == WorkerContext("/tmp/a,b", 2, 3, 77)
    assert WorkerContext("/tmp", 0, 2, os.getppid()).orphaned() is False
    assert WorkerContext("/tmp", 0, 2, os.getpid()).orphaned() is True
    env = worker_env({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,"
                      "service.instance.id=pod-7", "X": "y"}, 1)
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == \
        "deployment.environment=prod,service.instance.id=pod-7/w1" and env["X"] == "y"
    from opentelemetry.sdk.resources import Resource

    os.environ["OTEL_RESOURCE_ATTRIBUTES"] = worker_env({}, 0)["OTEL_RESOURCE_ATTRIBUTES"]
    try:
        rid = Resource.create({"service.name": "slogate"}).attributes["service.instance.id"]
    finally:
        del os.environ["OTEL_RESOURCE_ATTRIBUTES"]
    assert str(rid).endswith(f":{os.getpid()}/w0")


# -- real workers ----------------------------------------------------------------------------

CAP = 3
CONFIG = """
[auth]
mode = "open"
[server]
access_log = true
drain_timeout_s = 20
[admission]
enabled = true
[[slo_classes]]
name = "relaxed"
ttft_ms = 60000
tpot_ms = 60000
[[backends]]
name = "sim"
base_url = "{sim}/v1"
models = ["m"]
max_concurrency = {cap}
"""


class Host:
    def __init__(self, sim: Proc, gw: Proc, s: aiohttp.ClientSession) -> None:
        self.sim, self.gw, self.s = sim, gw, s

    async def at_sim(self) -> int:
        async with self.s.get(self.sim.url + "/sim/stats") as r:
            st = await r.json()
        return int(st["running"] + st["waiting"])

    async def stream(self, max_tokens: int) -> dict:
        body = {"model": "m", "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "hello " * 20}]}
        # a new connection per stream: SO_REUSEPORT spreads connections, not requests
        async with aiohttp.ClientSession() as s, s.post(
                self.gw.url + "/v1/chat/completions", json=body,
                headers={"x-slo-class": "relaxed"}) as r:
            out: dict = {"status": r.status, "done": False, "error": False}
            async for line in r.content:
                out["done"] |= line.startswith(b"data: [DONE]")
                out["error"] |= line.startswith(b'data: {"error"')
            return out

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with self.s.get(self.gw.url + "/metrics") as r:
            return _values(await r.text())

    async def admission(self) -> dict:
        async with self.s.get(self.gw.url + "/admin/admission") as r:
            return await r.json()


@contextlib.asynccontextmanager
async def host(workers: int = 2, in_config: bool = False) -> AsyncIterator[Host]:
    """A simulator and a gateway of `workers` workers (`--workers`, or `[server] workers`)."""
    async with slogate("sim", "--decode-base-ms", "20", "--decode-per-seq-ms", "0",
                       ready_path="/health") as sim:
        cfg = Path(tempfile.mkstemp(prefix="slogate-workers-", suffix=".toml")[1])
        text = CONFIG.format(sim=sim.url, cap=CAP)
        if in_config:
            text = text.replace("[server]\n", f"[server]\nworkers = {workers}\n")
        cfg.write_text(text)
        flag = [] if in_config else ["--workers", str(workers)]
        try:
            async with slogate("serve", "--config", str(cfg), *flag,
                               ready_path="/readyz") as gw, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                h = Host(sim, gw, s)

                async def all_up() -> bool:
                    view = await h.admission()
                    return len(view["host"]["by_worker"]) == workers

                await wait_until(all_up, 10, interval=0.1, what="every worker published")
                yield h
        finally:
            cfg.unlink(missing_ok=True)


async def test_the_config_says_how_many_workers() -> None:
    async with host(2, in_config=True) as h:
        v = await h.metrics()
        assert v[("slogate_workers_configured", ())] == 2


async def test_workers_share_one_port_one_cap_one_metrics_and_one_log() -> None:
    async with host(2) as h:
        peak = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, await h.at_sim())
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*[h.stream(30) for _ in range(24)])
        stop.set()
        await watcher
        assert all(r["status"] == 200 and r["done"] for r in results), results
        # Two workers, one cap of 3 on the host: never 2 x 3 at the engine.
        assert peak == CAP, peak

        async def counted() -> bool:
            v = await h.metrics()
            return sum(n for (name, _l), n in v.items() if name == "slogate_requests_total") == 24

        await wait_until(counted, 5, interval=0.2, what="every request in /metrics")
        v = await h.metrics()
        per_worker = {dict(lab)["worker"]: n for (name, lab), n in v.items()
                      if name == "slogate_worker_requests_total"}
        assert set(per_worker) == {"0", "1"} and sum(per_worker.values()) == 24, per_worker
        assert all(n > 0 for n in per_worker.values()), per_worker  # both served
        assert v[("slogate_workers", ())] == 2 and v[("slogate_workers_configured", ())] == 2
        view = await h.admission()
        assert view["host"]["workers"] == 2
        assert view["host"]["slots"]["backend:sim"]["total"] == 0
        assert view["shared"]["state"] == "host"


async def test_supervisor_restarts_a_killed_worker_frees_its_slots_and_drains_on_sigterm(
        tmp_path: Path) -> None:
    log = tmp_path / "gw.log"
    async with slogate("sim", "--decode-base-ms", "20", "--decode-per-seq-ms", "0",
                       ready_path="/health") as sim:
        cfg = tmp_path / "gw.toml"
        cfg.write_text(CONFIG.format(sim=sim.url, cap=CAP))
        from tests.support.procs import free_port, wait_ready

        port = free_port()
        with open(log, "wb") as out:
            sup = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config",
                                    str(cfg), "--workers", "2", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            await wait_ready(f"http://127.0.0.1:{port}/readyz", sup, log)
            gw = Proc(sup, f"http://127.0.0.1:{port}", log)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                h = Host(sim, gw, s)

                async def both() -> bool:
                    return len((await h.admission())["host"]["by_worker"]) == 2

                await wait_until(both, 10, interval=0.1, what="both workers published")
                # Long streams until some worker holds slots, then SIGKILL that worker.
                longs = [asyncio.create_task(h.stream(400)) for _ in range(CAP)]

                async def held() -> bool:
                    return await h.at_sim() == CAP

                await wait_until(held, 10, interval=0.02, what="the cap in use")
                slots = (await h.admission())["host"]["slots"]["backend:sim"]["by_worker"]
                victim = max(range(2), key=lambda i: slots[i])
                view = (await h.admission())["host"]["by_worker"]
                pid = view[str(victim)]["pid"]
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()

                async def freed() -> bool:
                    try:
                        v = await h.admission()
                    except aiohttp.ClientError:  # a connection the dead worker held
                        return False
                    return v["host"]["slots"]["backend:sim"]["by_worker"][victim] == 0

                await wait_until(freed, 5, interval=0.05, what="the dead worker's slots freed")
                assert time.monotonic() - t_kill < 3

                async def restarted() -> bool:
                    try:
                        v = await h.metrics()
                        w = (await h.admission())["host"]["by_worker"]
                    except aiohttp.ClientError:  # a connection the dead worker held
                        return False
                    return v.get(("slogate_worker_restarts_total", ())) == 1 and \
                        str(victim) in w and w[str(victim)]["pid"] != pid

                await wait_until(restarted, 10, interval=0.1, what="the worker restarted")
                # New streams are served by the host meanwhile (the survivor, then both).
                more = await asyncio.gather(*[h.stream(10) for _ in range(6)])
                assert all(r["status"] == 200 and r["done"] for r in more), more
                # SIGTERM the supervisor while a stream runs: it finishes, exit 0.
                running = asyncio.create_task(h.stream(60))

                async def streaming() -> bool:
                    return await h.at_sim() >= 1 + sum(not t.done() for t in longs)

                await wait_until(streaming, 5, interval=0.02, what="a stream at the sim")
                sup.send_signal(signal.SIGTERM)
                r = await running
                assert r["status"] == 200 and r["done"] and not r["error"], r
                await asyncio.gather(*longs, return_exceptions=True)
            assert await asyncio.to_thread(sup.wait, 40) == 0
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
    text = log.read_text()
    assert "worker " + str(victim) + f" (pid {pid}) exited (killed by SIGKILL); restarting" \
        in text, text[-3000:]
    assert "freed its admission slots" in text
    assert "all workers stopped" in text
    # Access-log lines of both workers arrive whole: every line that starts as JSON is JSON.
    access = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert len(access) >= 6
    for ln in access:
        assert orjson.loads(ln)["route"] == "/v1/chat/completions"
    for ln in text.splitlines():
        assert ln.startswith(("{", "20")), ln  # a JSON line or a timestamped log line


async def test_a_taken_port_stops_the_supervisor_with_one_line(tmp_path: Path) -> None:
    import socket

    cfg = tmp_path / "gw.toml"
    cfg.write_text(CONFIG.format(sim="http://127.0.0.1:9", cap=CAP))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--workers", "2",
            "--port", str(port)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in r.stderr


async def _peak_with_redis(url: str, state: str, cap: int) -> int:
    """2 workers with `redis_url = url`, redis_share 0.5: once both workers are in `state`,
    16 streams; returns the most the simulator held at once."""
    async with slogate("sim", "--decode-base-ms", "20", "--decode-per-seq-ms", "0",
                       ready_path="/health") as sim:
        cfg = Path(tempfile.mkstemp(prefix="slogate-workers-", suffix=".toml")[1])
        cfg.write_text(CONFIG.format(sim=sim.url, cap=cap).replace(
            "[admission]\nenabled = true\n",
            f'[admission]\nenabled = true\nredis_url = "{url}"\nredis_share = 0.5\n'
            "lease_s = 3.0\n"))
        try:
            async with slogate("serve", "--config", str(cfg), "--workers", "2",
                               ready_path="/readyz") as gw, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                h = Host(sim, gw, s)

                async def ready() -> bool:
                    w = (await h.admission())["host"]["by_worker"]
                    return len(w) == 2 and all(
                        v["admission"]["shared"]["state"] == state for v in w.values())

                await wait_until(ready, 10, interval=0.1, what=f"both workers {state}")
                peak = 0
                stop = asyncio.Event()

                async def watch() -> None:
                    nonlocal peak
                    while not stop.is_set():
                        peak = max(peak, await h.at_sim())
                        await asyncio.sleep(0.005)

                watcher = asyncio.create_task(watch())
                results = await asyncio.gather(*[h.stream(30) for _ in range(16)])
                stop.set()
                await watcher
                assert all(r["status"] == 200 and r["done"] for r in results), results
                if state == "local":  # the host's fallback share lives in the slot table
                    slots = (await h.admission())["host"]["slots"]["redis-fallback:sim"]
                    assert slots["total"] == 0 and len(slots["by_worker"]) == 2, slots
                return peak
        finally:
            cfg.unlink(missing_ok=True)


async def test_workers_with_redis_share_caps_there_and_bound_the_fallback_host_wide() -> None:
    """With Redis, each worker is one gateway in Redis (the cap holds across workers); with
    Redis unreachable, the fallback share floor(cap x redis_share) holds for the host, not
    per worker."""
    from tests.support.prometheus_server import free_port
    from tests.support.redis_server import redis_server

    with redis_server() as rs:
        assert await _peak_with_redis(rs.url, "redis", 4) == 4
    dead_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    assert await _peak_with_redis(dead_url, "local", 4) == 2  # not 2 workers x 2


async def test_workers_drain_and_exit_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    from tests.support.procs import free_port, wait_ready

    cfg = tmp_path / "gw.toml"
    cfg.write_text(CONFIG.format(sim="http://127.0.0.1:9", cap=CAP))
    port = free_port()
    log = tmp_path / "gw.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg),
                                "--workers", "2", "--port", str(port)],
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        await wait_ready(f"http://127.0.0.1:{port}/healthz", sup, log)

        def workers() -> list[int]:
            out = []
            for task in Path(f"/proc/{sup.pid}/task").glob("*"):
                with contextlib.suppress(OSError):
                    out += [int(c) for c in (task / "children").read_text().split()]
            return out

        async def both() -> bool:
            return len(workers()) == 2

        await wait_until(both, 10, interval=0.1, what="two workers")
        pids = workers()
        sup.kill()
        sup.wait()

        def alive(pid: int) -> bool:
            try:  # a zombie (exited, not yet reaped by init) counts as gone
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False

        async def gone() -> bool:
            return not any(alive(p) for p in pids)

        await wait_until(gone, 10, interval=0.1, what="the orphaned workers to exit")
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_a_worker_stuck_in_shutdown_exits_with_its_stacks() -> None:
    code = ("import logging, time; logging.basicConfig(); "
            "from gateway.ops.workers import WorkerContext; "
            "WorkerContext('/tmp', 3, 4, 1).exit_if_stuck(0.2); time.sleep(30)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert r.returncode == 1 and time.monotonic() - t0 < 10
    assert "worker 3: still shutting down after 0 s" in r.stderr
    assert "time.sleep" in r.stderr or "<string>" in r.stderr  # the stuck stack


# -- counters across a worker's death --------------------------------------------------------

Series = tuple[str, tuple[tuple[str, str], ...]]


class Scraper:
    """Scrapes the host's /metrics, each time on a new connection (so every worker answers
    some), and records every counter or histogram sample that went down from one scrape to
    the next (a counter reset to Prometheus)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.scrapes = 0
        self.last: dict[Series, float] = {}
        self.decreases: list[tuple[int, Series, float, float]] = []
        self.series: set[Series] = set()
        self.failed = 0

    async def scrape(self, s: aiohttp.ClientSession) -> dict[Series, float]:
        async with s.get(self.url + "/metrics", headers={"Connection": "close"}) as r:
            text = await r.text()
        now: dict[Series, float] = {}
        for fam in text_string_to_metric_families(text):
            if fam.type not in ("counter", "histogram", "summary"):
                continue
            for smp in fam.samples:
                if smp.name.endswith("_created"):
                    continue
                key = (smp.name, tuple(sorted(smp.labels.items())))
                now[key] = smp.value
                before = self.last.get(key)
                if before is not None and smp.value < before:
                    self.decreases.append((self.scrapes, key, before, smp.value))
        for key in self.last.keys() - now.keys():  # a counter series that vanished
            self.decreases.append((self.scrapes, key, self.last[key], 0.0))
        self.last.update(now)
        self.series |= now.keys()
        self.scrapes += 1
        return now

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            while not stop.is_set():
                try:
                    await self.scrape(s)
                except aiohttp.ClientError:
                    # the killed worker had accepted this scrape's connection: a failed
                    # scrape, as Prometheus records one (what is checked is the next)
                    self.failed += 1
                await asyncio.sleep(0.02)


def _requests_total(v: dict[Series, float]) -> float:
    return sum(n for (name, _l), n in v.items() if name == "slogate_requests_total")


async def test_counters_never_go_backwards_when_a_worker_is_killed() -> None:
    """Scrapes every 20 ms (each answered by either worker) while streams run and a worker is
    SIGKILLed twice: once in the middle of a load of short streams, once while it holds long
    streams (and has nothing finished that it has not published). No counter or histogram
    sample ever goes down; the dead worker's gauges go; after the second kill the host's
    request count grows by exactly the requests the clients saw completed."""
    async with host(2) as h:
        served = 0
        loading = asyncio.Event()

        async def client() -> None:
            nonlocal served
            while loading.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    r = await h.stream(4)
                    served += r["status"] == 200 and r["done"]

        async def load(seconds: float, during: float | None = None) -> None:
            loading.set()
            clients = [asyncio.create_task(client()) for _ in range(6)]
            if during is not None:
                await asyncio.sleep(during)
                await kill(busiest=False)
                seconds -= during
            await asyncio.sleep(seconds)
            loading.clear()
            await asyncio.gather(*clients)

        async def workers() -> dict[str, Any]:
            return (await h.admission())["host"]["by_worker"]

        restarts = 0

        async def kill(busiest: bool) -> int:
            nonlocal restarts
            view = await workers()
            slots = (await h.admission())["host"]["slots"]["backend:sim"]["by_worker"]
            victim = max(range(2), key=lambda i: slots[i]) if busiest else restarts % 2
            pid = view[str(victim)]["pid"]
            os.kill(pid, signal.SIGKILL)
            restarts += 1

            async def back() -> bool:
                try:
                    w = await workers()
                except aiohttp.ClientError:  # a connection the dead worker held, or accepted
                    return False
                return str(victim) in w and w[str(victim)]["pid"] != pid

            await wait_until(back, 15, interval=0.1, what="the killed worker restarted")
            return victim

        stop = asyncio.Event()
        scraper = Scraper(h.gw.url)
        scraping = asyncio.create_task(scraper.run(stop))
        try:
            # 1. A kill in the middle of a load: what the victim counted since its last
            # publish (at most a second's worth) is lost, but no counter goes down.
            await load(4.0, during=1.5)
            # Its own scrapes: two in flight at once, one scraper would compare an answer
            # that read the files first but came last with one that came before it.
            probe = Scraper(h.gw.url)
            async with aiohttp.ClientSession() as s:
                async def settled() -> float | None:
                    a = _requests_total(await probe.scrape(s))
                    await asyncio.sleep(1.2)  # > the publish interval
                    b = _requests_total(await probe.scrape(s))
                    return b if a == b else None

                base = await wait_until(settled, 15, interval=0.1, what="the count settled")
            lost = served - base
            assert 0 <= lost <= 40, (served, base)
            served_before = served
            # 2. Long streams on both workers, nothing else finishing: then a kill loses
            # nothing that any client saw completed.
            longs = [asyncio.create_task(h.stream(150)) for _ in range(CAP)]

            async def busy() -> bool:
                return await h.at_sim() == CAP

            await wait_until(busy, 10, interval=0.02, what="the long streams at the sim")
            await asyncio.sleep(1.3)  # every worker has published what it finished
            victim = await kill(busiest=True)
            for r in await asyncio.gather(*longs, return_exceptions=True):
                served += isinstance(r, dict) and r["status"] == 200 and r["done"]
            await load(2.0)

            async def exact() -> bool:
                return _requests_total(await h.metrics()) - base == served - served_before

            await wait_until(exact, 5, interval=0.1,
                             what=lambda: f"{served - served_before} requests counted")
        finally:
            stop.set()
            await scraping
        print(f"\n{scraper.scrapes} scrapes ({scraper.failed} failed), "
              f"{len(scraper.decreases)} decreases")
        assert scraper.scrapes > 100 and scraper.failed <= 10
        assert not scraper.decreases, scraper.decreases[:20]
        v = await h.metrics()
        assert v[("slogate_worker_restarts_total", ())] == 2
        per_worker = {dict(lab)["worker"]: n for (name, lab), n in v.items()
                      if name == "slogate_worker_requests_total"}
        assert set(per_worker) == {"0", "1"}, per_worker  # the dead are in their index's
        assert sum(per_worker.values()) == _requests_total(v)
        starts = {dict(lab).get("worker") for (name, lab) in v
                  if name == "process_start_time_seconds"}
        assert starts == {"0", "1"}  # one per live worker: the dead ones' gauges are gone
        print(f"{scraper.scrapes} scrapes, {len(scraper.series)} counter series; "
              f"served {served}, lost to the kill mid-load {lost}; victim {victim}")
