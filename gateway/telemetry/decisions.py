"""The flight recorder of admission and routing decisions: for every finished request, the
replicas admission weighed (predicted TTFT, load, why not), its decision and reason, the queue
wait against the predicted one, the replica chosen, the attempts and the outcome that followed.

A sink that reads the finished record (like access_log.py), fed once per request from
`Finisher.finish`, after the response. Each record is serialised once, to JSON bytes, and those
bytes serve both places it goes:
- a ring of the newest `ring_size` records in memory (GET /admin/decisions, the console), with
  the few fields its filters read beside them, so memory is bounded whatever the rate;
- when `[recorder] path` is set, a JSON-lines file (`slogate replay` reads it), rotated at
  `max_bytes` with `backups` older files kept. Lines are buffered on the event loop and written
  by one thread of their own a few times a second: the request path never waits on a disk. A
  disk slower than the request rate drops lines past MAX_PENDING (counted), never the gateway.

No content, no keys: a record holds sizes, times, bounded labels and the model name as the
client wrote it, sanitised and clipped as the access log does it.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

import orjson

from gateway.edge.ingress import max_output_tokens
from gateway.telemetry import durations
from gateway.telemetry.access_log import arrival_wall_s, sanitised

if TYPE_CHECKING:
    from gateway.config import RecorderConfig
    from gateway.exchange import Exchange
    from gateway.telemetry.attribution import TTFTSplit

log = logging.getLogger("slogate")

MODEL_CHARS = 64  # a client's model name in a record, at most
ERROR_CHARS = 64
MAX_QUERY = 1000  # records one GET /admin/decisions answers at most
FLUSH_S = 0.25  # how often buffered lines go to the file
MAX_PENDING = 20_000  # lines buffered for the file at most (~20 s at 1,000 requests/s)
MISSED = ("ttft_missed", "tpot_missed", "both_missed", "e2e_missed", "failed")


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e6  # exact to the ns: no rounding needed


def decision_record(ex: Exchange, split: TTFTSplit | None,
                    wall_now: float | None = None) -> dict[str, Any]:
    """The record of one finished request (the schema `slogate replay` reads)."""
    decision, reason = ex.admission if ex.admission is not None else (None, None)
    cands = [{"replica": name, "predicted_ttft_ms": None if pred is None else round(pred * 1e3, 1),
              "in_flight": in_flight, "limit": limit, "why": why}
             for name, pred, in_flight, limit, why in ex.candidates or ()]
    # the attempts that ended before the last one (their own times), then the last one
    attempts = [{"backend": a.backend, "result": a.result,
                 "ms": _ms(a.t_end - a.t_sent) if a.t_sent else None} for a in ex.attempts]
    if ex.attempt is not None:
        attempts.append({"backend": ex.attempt.backend, "result": ex.outcome,
                         "ms": _ms(ex.t_end - ex.t_sent) if ex.t_sent and ex.t_end else None})
    tpot = durations.tpot_s(ex)
    wait_s = ex.predicted_wait_s
    slo = ex.slo
    rec: dict[str, Any] = {
        "t": round(arrival_wall_s(ex, wall_now), 3),
        "request_id": ex.request_id,
        "tenant": ex.tenant_label,
        "slo_class": slo.name if slo is not None else None,
        "model": sanitised(ex.model, MODEL_CHARS) if ex.model else None,
        "route": ex.route,
        "stream": ex.stream,
        "prompt_tokens": ex.prompt_tokens,
        "estimated_prompt_tokens": None if ex.estimated_tokens is None
        else round(ex.estimated_tokens, 1),
        "max_tokens": max_output_tokens(ex.parsed),
        "completion_tokens": ex.completion_tokens,
        "admission": {
            "decision": decision, "reason": reason,
            "queue_wait_ms": _ms(durations.ADMISSION_WAIT.ns(ex)) or 0.0,
            "predicted_wait_ms": None if wait_s is None else round(wait_s * 1e3, 3),
            # a refusal's best case from received (its wait for a turn included), padded
            "predicted_ttft_ms": None if ex.predicted_ttft_s is None
            else round(ex.predicted_ttft_s * 1e3, 1),
            "candidates": cands,
            "chosen": attempts[0]["backend"] if attempts else None,
        },
        "attempts": attempts,
        "status": ex.status,
        "outcome": ex.outcome,
        "ttft_ms": _ms(durations.TTFT.ns(ex)),
        "tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
        "verdict": ex.verdict,
        # beyond what replay reads: what the console's explanation needs
        "error_type": sanitised(ex.error_type, ERROR_CHARS) if ex.error_type else None,
        "target_ttft_ms": slo.ttft_ms if slo is not None else None,
        "body_bytes": len(ex.body),
    }
    if split is not None:
        rec["ttft_stages_ms"] = split.ms()
        rec["ttft_largest_stage"] = split.largest
    return rec


# What a ring entry keeps beside the record's bytes, for the filters (in this order).
FILTERS = ("outcome", "slo_class", "tenant", "verdict", "decision")
_Entry = tuple[str | None, str | None, str, str | None, str | None, bytes]


class DecisionLog:
    """The ring of the newest decisions and, when configured, their JSON-lines file."""

    def __init__(self, ring_size: int, file: RotatingLines | None = None) -> None:
        self.ring: deque[_Entry] = deque(maxlen=ring_size)
        self.file = file
        self.total = 0

    def record(self, ex: Exchange, split: TTFTSplit | None) -> None:
        """The sink: once per finished request, after its response."""
        rec = decision_record(ex, split)
        # A copy of exactly its size (orjson's own buffer holds 8 KiB), ending in a newline:
        # the file's line as it is, and whitespace between the items of a JSON array.
        line = orjson.dumps(rec) + b"\n"
        self.ring.append((rec["outcome"], rec["slo_class"], rec["tenant"], rec["verdict"],
                          rec["admission"]["decision"], line))
        self.total += 1
        if self.file is not None:
            self.file.add(line)

    def newest(self, limit: int = 100, **match: str | None) -> Iterator[bytes]:
        """The newest records first, those whose FILTERS fields equal every given value."""
        wanted = [(FILTERS.index(k), v) for k, v in match.items() if v is not None]
        n = 0
        for entry in reversed(self.ring):
            if n >= limit:
                return
            if all(entry[i] == v for i, v in wanted):
                n += 1
                yield entry[-1]

    def explainable(self, limit: int) -> list[dict[str, Any]]:
        """The newest records of requests refused by admission or that missed their SLO (for
        the console's "why" table)."""
        out: list[dict[str, Any]] = []
        for entry in reversed(self.ring):
            if len(out) >= limit:
                break
            if entry[4] == "rejected" or entry[3] in MISSED:
                out.append(orjson.loads(entry[-1]))
        return out

    def body(self, limit: int, **match: str | None) -> bytes:
        """What GET /admin/decisions answers: the matching records (newest first) and the
        recorder's state, built from the stored bytes without parsing them again."""
        records = b",".join(self.newest(limit, **match))
        state = {"ring_size": self.ring.maxlen, "held": len(self.ring),
                 "recorded_total": self.total,
                 "file": self.file.state() if self.file is not None else None}
        return (b'{"recorder":' + orjson.dumps(state) + b',"decisions":[' + records + b"]}")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class RotatingLines:
    """Appends lines (each ending in a newline) to a size-bounded file off the event loop:
    `add` buffers (a list append), one writer thread writes the buffer every FLUSH_S and
    rotates path → path.1 … path.N when the next line would take the file past max_bytes."""

    def __init__(self, path: str, max_bytes: int, backups: int, flush_s: float = FLUSH_S,
                 max_pending: int = MAX_PENDING) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.dropped = 0  # lines the writer could not keep up with
        self.errors = 0  # writes the disk refused
        self.written = 0
        self._pending: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="slogate-decisions")
        self._file: IO[bytes] | None = None  # the writer thread's
        self._size = 0

    def add(self, line: bytes) -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(line)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop (a tool): written now, still by the thread
                self.flush()
                return
            self._timer = loop.call_later(self.flush_s, self.flush)

    def flush(self) -> Future[None] | None:
        """Hand what is buffered to the writer thread (its Future, or None: nothing)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        batch, self._pending = self._pending, []
        return self._pool.submit(self._write, batch) if batch else None

    def state(self) -> dict[str, Any]:
        return {"path": self.path, "written": self.written, "dropped": self.dropped,
                "errors": self.errors, "pending": len(self._pending)}

    def close(self) -> None:
        """Write what is left and close the file (blocks: call it off the event loop)."""
        self.flush()
        self._pool.shutdown(wait=True)
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the writer thread -------------------------------------------------------------------
    def _write(self, batch: list[bytes]) -> None:
        try:
            chunk: list[bytes] = []
            size = self._open()
            for line in batch:
                n = len(line)
                if size and size + n > self.max_bytes:
                    self._emit(chunk)
                    chunk = []
                    self._rotate()
                    size = 0
                chunk.append(line)
                size += n
            self._emit(chunk)
            self._size = size
            self.written += len(batch)
        except OSError as e:
            self.errors += 1
            if self.errors == 1:  # once: a full disk must not flood the log as well
                log.warning("decision log: cannot write %s: %s", self.path, e)
            if self._file is not None:
                self._file.close()
                self._file = None

    def _open(self) -> int:
        if self._file is None:
            self._file = open(self.path, "ab")  # noqa: SIM115 (kept open across batches)
            self._size = self._file.tell()
        return self._size

    def _emit(self, chunk: list[bytes]) -> None:
        if chunk and self._file is not None:
            self._file.write(b"".join(chunk))
            self._file.flush()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            older = f"{self.path}.{i}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{i + 1}")
        if self.backups:
            os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "wb")  # noqa: SIM115
        self._size = 0


def from_config(cfg: RecorderConfig, worker_index: int | None = None) -> DecisionLog | None:
    """The decision log `[recorder]` asks for (None: off). Each of `--workers N` writes a file
    of its own (`decisions.w0.jsonl`, …): one file has one writer, so rotation stays exact."""
    if not cfg.enabled:
        return None
    file = None
    if cfg.path:
        path = cfg.path
        if worker_index is not None:
            root, ext = os.path.splitext(path)
            path = f"{root}.w{worker_index}{ext}"
        file = RotatingLines(path, cfg.max_bytes, cfg.backups)
    return DecisionLog(cfg.ring_size, file)
