"""The flight recorder of admission decisions: the record's schema (what `slogate replay`
reads), the ring's bound and filters, the JSON-lines file's rotation, bounded memory at 1,000
requests/s, the [recorder] config, and the console's explanation of a refused or slow request."""
from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import orjson
import pytest

from gateway import config
from gateway.config import RecorderConfig, SLOClass, SLOTarget
from gateway.console import Console, ConsoleRecorder
from gateway.console.why import explain
from gateway.exchange import MAX_CANDIDATES, Attempt, Exchange
from gateway.telemetry.attribution import ttft_split
from gateway.telemetry.decisions import DecisionLog, RotatingLines, decision_record, from_config
from tests.support.waiting import wait_until

MS = 1_000_000
INTERACTIVE = SLOClass("interactive", 400, 60)
SCHEMA = {"t", "request_id", "tenant", "slo_class", "model", "route", "stream", "prompt_tokens",
          "estimated_prompt_tokens", "max_tokens", "completion_tokens", "admission", "attempts",
          "status", "outcome", "ttft_ms", "tpot_ms", "verdict"}
ADMISSION = {"decision", "reason", "queue_wait_ms", "predicted_wait_ms", "predicted_ttft_ms",
             "candidates", "chosen"}


def refused(i: int = 0, tenant: str = "acme", cls: SLOClass = INTERACTIVE) -> Exchange:
    """A request admission refused: both replicas weighed, neither could make its TTFT."""
    ex = Exchange("/v1/chat/completions")
    ex.request_id = f"req-{i}"
    ex.model, ex.stream, ex.tenant_label = "m", True, tenant
    ex.slo = SLOTarget(cls, cls.ttft_ms, cls.tpot_ms, None)
    ex.parsed = {"model": "m", "max_tokens": 64, "messages": [{"role": "user",
                                                               "content": "secret prompt"}]}
    ex.body = orjson.dumps(ex.parsed)
    ex.considered("a", 0.812, 3, 8, "ttft_wait")
    ex.considered("b", None, 8, 8, "concurrency_cap")
    ex.admission = ("rejected", "ttft_infeasible")
    ex.estimated_tokens = 12.25
    ex.status, ex.outcome, ex.error_type = 429, "rejected", "slo_ttft_infeasible"
    ex.t_end = ex.t_received + 2 * MS
    return ex


def served(i: int = 0, *, verdict: str = "met", tenant: str = "acme") -> Exchange:
    """A streamed answer that waited 120 ms in the queue, failed once on `a`, then ran on `b`."""
    ex = refused(i, tenant)
    ex.candidates = None
    ex.considered("a", 0.05, 1, 8, "")
    ex.considered("b", 0.07, 1, 8, "")
    ex.admission = ("admitted", "after_queue")
    ex.t_queued, ex.t_admitted = ex.t_received + 1 * MS, ex.t_received + 121 * MS
    ex.predicted_wait_s = 0.08
    replica = type("R", (), {"name": "a"})()
    first = Attempt(replica, "m", None, None)  # type: ignore[arg-type]
    first.t_sent, first.t_end, first.result = ex.t_received + 121 * MS, ex.t_received + 151 * MS, \
        "connect_error"
    ex.attempts = [first]
    second = Attempt(type("R", (), {"name": "b"})(), "m", None, None)  # type: ignore[arg-type]
    ex.attempt = second
    ex.t_dispatched = first.t_sent
    ex.t_sent = ex.t_received + 152 * MS
    ex.t_headers = ex.t_received + 160 * MS
    ex.t_first_token = ex.t_received + 500 * MS
    ex.t_last_token = ex.t_received + 800 * MS
    ex.t_end = ex.t_received + 801 * MS
    ex.prompt_tokens, ex.completion_tokens = 11, 31
    ex.status, ex.outcome, ex.error_type, ex.verdict = 200, "ok", None, verdict
    return ex


def test_a_refusals_record_says_why_and_holds_no_content() -> None:
    ex = refused()
    rec = decision_record(ex, None, wall_now=1000.0)
    assert set(rec) >= SCHEMA and set(rec["admission"]) == ADMISSION
    adm = rec["admission"]
    assert (adm["decision"], adm["reason"], adm["chosen"]) == ("rejected", "ttft_infeasible",
                                                               None)
    assert adm["candidates"] == [
        {"replica": "a", "predicted_ttft_ms": 812.0, "in_flight": 3, "limit": 8,
         "why": "ttft_wait"},
        {"replica": "b", "predicted_ttft_ms": None, "in_flight": 8, "limit": 8,
         "why": "concurrency_cap"}]
    assert adm["queue_wait_ms"] == 0.0 and adm["predicted_wait_ms"] is None
    assert rec["max_tokens"] == 64 and rec["estimated_prompt_tokens"] == 12.2
    assert rec["tenant"] == "acme" and rec["slo_class"] == "interactive"
    assert rec["attempts"] == [] and rec["ttft_ms"] is None
    assert 999.0 < rec["t"] <= 1000.0
    assert b"secret" not in orjson.dumps(rec)


def test_a_served_records_queue_wait_attempts_and_ttft_stages() -> None:
    ex = served(verdict="ttft_missed")
    split = ttft_split(ex)
    rec = decision_record(ex, split)
    adm = rec["admission"]
    assert adm["queue_wait_ms"] == 120.0 and adm["predicted_wait_ms"] == 80.0
    assert adm["chosen"] == "a"  # where admission sent it first
    assert rec["attempts"] == [{"backend": "a", "result": "connect_error", "ms": 30.0},
                               {"backend": "b", "result": "ok", "ms": 649.0}]
    assert rec["ttft_ms"] == 500.0 and rec["tpot_ms"] == 10.0
    assert rec["ttft_largest_stage"] == "first_token_after_headers"
    why = explain(rec)["why"]
    assert why.startswith("ttft_missed; waited 120 ms in the admission queue (predicted 80 ms)")
    assert "on a (predicted TTFT 50 ms)" in why and "TTFT 500 ms of a 400 ms target" in why
    assert "largest stage first_token_after_headers (340 ms)" in why and "2 attempts" in why


def test_a_stream_that_was_preempted_says_it_paused() -> None:
    rec = decision_record(served(verdict="tpot_missed"), None)
    rec["attempts"] = [{"backend": "a", "result": "preempted", "ms": 300.0}]
    assert "its stream paused once to give its slot to a less served class (preempted), " \
        "then continued" in explain(rec)["why"]
    rec["attempts"] *= 2
    assert "paused 2 times" in explain(rec)["why"]


def test_the_refusal_is_explained_from_its_candidates() -> None:
    row = explain(decision_record(refused(), None))
    assert row["why"] == ("refused: ttft_infeasible; best predicted TTFT 812 ms on a against a "
                          "400 ms target; b at its limit (8/8)")
    assert row["decision"] == "rejected" and len(row["candidates"]) == 2


def test_a_refusal_on_arrival_says_what_its_best_case_was() -> None:
    """Refused before any replica was weighed (its turn at a slot comes too late): the record
    keeps the best case admission predicted, and the console says it against the target."""
    ex = refused()
    ex.candidates = None
    ex.predicted_wait_s, ex.predicted_ttft_s = 0.31, 0.4624
    rec = decision_record(ex, None)
    assert rec["admission"]["predicted_ttft_ms"] == 462.4
    assert rec["admission"]["predicted_wait_ms"] == 310.0
    assert explain(rec)["why"] == (
        "refused: ttft_infeasible; its best case a TTFT of 462 ms from arrival (its turn at "
        "a slot and the stated error included) against a 400 ms target")


def test_a_client_model_name_is_clipped_and_printable() -> None:
    ex = refused()
    ex.model = "m\x1b[2J\n" + "x" * 300
    model = decision_record(ex, None)["model"]
    assert len(model) <= 64 and model.isprintable() and model.startswith("m?[2J?x")


def test_candidates_keep_each_replicas_latest_look_and_are_capped() -> None:
    ex = Exchange("/v1/chat/completions")
    ex.considered("a", 0.5, 8, 8, "ttft_wait")
    ex.considered("a", 0.1, 2, 8, "")  # the next pass of the queue: its newer look
    for i in range(20):
        ex.considered(f"r{i}", 0.2, 0, 8, "")
    assert ex.candidates is not None and len(ex.candidates) == MAX_CANDIDATES
    assert ex.candidates[0] == ("a", 0.1, 2, 8, "")


def test_the_ring_keeps_the_newest_and_filters_newest_first() -> None:
    log = DecisionLog(ring_size=5)
    for i in range(12):
        log.record(served(i, verdict="met") if i % 2 else refused(i, "acme" if i % 4 else "beta"),
                   None)
    assert len(log.ring) == 5 and log.total == 12
    ids = [orjson.loads(b)["request_id"] for b in log.newest(100)]
    assert ids == ["req-11", "req-10", "req-9", "req-8", "req-7"]
    rejected = [orjson.loads(b)["request_id"] for b in log.newest(100, outcome="rejected")]
    assert rejected == ["req-10", "req-8"]
    assert [orjson.loads(b)["request_id"] for b in log.newest(100, outcome="rejected",
                                                              tenant="beta")] == ["req-8"]
    assert len(list(log.newest(2))) == 2
    assert list(log.newest(100, slo_class="batch")) == []
    body = orjson.loads(log.body(3, decision="admitted"))
    assert [d["request_id"] for d in body["decisions"]] == ["req-11", "req-9", "req-7"]
    assert body["recorder"]["held"] == 5 and body["recorder"]["ring_size"] == 5
    assert [r["request_id"] for r in log.explainable(10)] == ["req-10", "req-8"]


def test_the_file_rotates_at_max_bytes_and_keeps_n_backups(tmp_path: Path) -> None:
    path = str(tmp_path / "decisions.jsonl")
    lines = RotatingLines(path, max_bytes=4096, backups=2)
    rec = decision_record(refused(), None)
    n = 60
    for i in range(n):
        rec["request_id"] = f"req-{i:03d}"
        lines.add(orjson.dumps(rec) + b"\n")  # no event loop here: handed to the thread at once
    lines.close()
    files = sorted(os.listdir(tmp_path))
    assert files == ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2"]
    kept: list[str] = []
    for name in ("decisions.jsonl.2", "decisions.jsonl.1", "decisions.jsonl"):
        data = (tmp_path / name).read_bytes()
        assert len(data) <= 4096
        kept += [orjson.loads(line)["request_id"] for line in data.splitlines()]
    # the newest lines, in order, none torn: the oldest went with the files rotated away
    assert kept == [f"req-{i:03d}" for i in range(n - len(kept), n)] and len(kept) < n
    assert lines.state()["written"] == n and lines.state()["errors"] == 0


async def test_on_the_event_loop_lines_are_buffered_then_written_by_the_thread(
        tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = RotatingLines(str(path), max_bytes=1 << 20, backups=1, flush_s=0.01)
    for i in range(100):
        lines.add(b'{"i":%d}\n' % i)
    assert lines.state()["pending"] == 100  # nothing written on the loop itself
    await wait_until(lambda: lines.state()["written"] == 100)
    lines.close()
    assert len(path.read_bytes().splitlines()) == 100


def test_a_writer_that_cannot_keep_up_drops_and_counts(tmp_path: Path) -> None:
    lines = RotatingLines(str(tmp_path / "d.jsonl"), 1 << 20, 1, max_pending=3)
    lines._timer = object()  # type: ignore[assignment]  # a flush is already due: buffer only
    for _ in range(5):
        lines.add(b"{}\n")
    assert lines.state()["pending"] == 3 and lines.dropped == 2
    lines._timer = None
    lines.close()


def test_an_unwritable_path_is_counted_not_raised(tmp_path: Path) -> None:
    lines = RotatingLines(str(tmp_path / "missing-dir" / "d.jsonl"), 1 << 20, 1)
    lines.add(b"{}")
    lines.close()
    assert lines.errors == 1


def test_memory_stays_bounded_at_1000_requests_per_second() -> None:
    """60 s at 1,000 requests/s into the default ring: memory after 20 s and after 60 s are
    the same (the ring is full at 2 s); each record costs a few µs (printed, not asserted)."""
    log = DecisionLog(ring_size=2000)
    exs = [served(i, verdict="ttft_missed") if i % 3 else refused(i) for i in range(50)]
    splits = [ttft_split(ex) for ex in exs]
    t0 = time.perf_counter()
    for k in range(5000):
        log.record(exs[k % 50], splits[k % 50])
    per_record_us = (time.perf_counter() - t0) / 5000 * 1e6
    tracemalloc.start()
    try:
        sizes = []
        for second in range(60):
            for j in range(1000):
                k = (second * 1000 + j) % 50
                log.record(exs[k], splits[k])
            if second in (19, 59):
                sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert len(log.ring) == 2000
    assert abs(sizes[1] - sizes[0]) < 64 * 1024, sizes
    assert sizes[1] < 4 * 1024 * 1024, sizes  # ~1 KiB a record
    print(f"decision record: {per_record_us:.1f} µs each, "
          f"{sizes[1] / 2000:.0f} B held per record")


def test_the_recorder_config_and_its_errors() -> None:
    base = {"auth": {"mode": "open"}, "backends": [{"name": "a", "base_url": "http://x/v1",
                                                    "models": ["m"]}]}
    assert config.parse(base, env={}).recorder == RecorderConfig()
    cfg = config.parse({**base, "recorder": {"path": "/var/log/d.jsonl", "ring_size": 10,
                                              "max_bytes": 1 << 20, "backups": 0}}, env={})
    assert cfg.recorder == RecorderConfig(True, 10, "/var/log/d.jsonl", 1 << 20, 0)
    env = config.parse(base, env={"SLOGATE_RECORDER_RING_SIZE": "7"}).recorder
    assert env.ring_size == 7
    for bad, key in (({"ring_size": 0}, "recorder.ring_size"),
                     ({"max_bytes": 10}, "recorder.max_bytes"),
                     ({"backups": -1}, "recorder.backups"),
                     ({"enabled": "yes"}, "recorder.enabled"),
                     ({"path": " x"}, "recorder.path"), ({"ring": 5}, "recorder.ring")):
        with pytest.raises(config.ConfigError) as e:
            config.parse({**base, "recorder": bad}, env={})
        assert key in str(e.value)
    assert from_config(RecorderConfig(enabled=False)) is None
    log = from_config(RecorderConfig(path="/tmp/d.jsonl"), worker_index=3)
    assert log is not None and log.file is not None and log.file.path == "/tmp/d.w3.jsonl"
    log.close()


def test_the_console_snapshot_explains_the_newest_refused_and_slow_requests() -> None:
    log = DecisionLog(ring_size=100)
    log.record(refused(1), None)
    log.record(served(2, verdict="met"), None)  # met its SLO: nothing to explain
    slow = served(3, verdict="ttft_missed")
    log.record(slow, ttft_split(slow))
    explained = Console(ConsoleRecorder(), lambda: None, decisions=log).snapshot()["explained"]
    assert [r["request_id"] for r in explained] == ["req-3", "req-1"]
    assert explained[0]["largest_stage"] == "first_token_after_headers"
    assert explained[0]["queue_wait_ms"] == 120.0 and explained[0]["replica"] == "a"
    assert explained[1]["why"].startswith("refused: ttft_infeasible; best predicted TTFT 812 ms")
    assert Console(ConsoleRecorder(), lambda: None).snapshot()["explained"] == []
