"""A continuous-batching inference engine, modelled in pure asyncio (no HTTP here).

One background task steps the engine. Each step:
  * decodes one token for every running sequence that has finished prefill (and is not held back
    by a stall or a per-request token delay),
  * spends up to `prefill_chunk_tokens` of prompt tokens on sequences still in prefill, oldest
    first, admitting waiting requests (FIFO) while the batch has room (chunked prefill),
  * takes `decode_base_ms + decode_per_seq_ms * batch + prefill_tokens / prefill_tokens_per_s`.
Tokens of a step are emitted when the step ends; the step that completes a prompt's prefill also
produces its first token (unless a stall holds it back). Steps are scheduled on absolute
deadlines, so timer jitter does not accumulate into a slower token rate.

Sequences report to the server through two callables: `on_token(tid)` per token and
`on_end(seq)` when finished; `seq.done` resolves with the outcome.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from .config import SimConfig

log = logging.getLogger("slogate.sim")

WAITING, PREFILL, DECODE, FINISHED = 0, 1, 2, 3
PHASES = ("queued", "prefill", "decode")
_PHASE_OF_STATE = {WAITING: "queued", PREFILL: "prefill", DECODE: "decode"}

# Outcomes a finished sequence can have.
STOP, LENGTH, CUT, ERROR, CANCELLED = "stop", "length", "cut", "error", "cancelled"

MAX_LAG_S = 0.010  # fall further behind than this and the engine stops catching up


class QueueFull(Exception):
    pass


class Seq:
    """One request inside the engine."""

    __slots__ = (
        "prompt_tokens", "cached_tokens", "cache_write_tokens", "prefix_key",
        "prefill_left",
        "target", "finish_reason", "tokens", "generated", "state", "next_at",
        "stall_s", "token_delay_s", "cut_after", "error_after", "fault_at",
        "t_arrival", "t_scheduled", "t_prefill_done", "t_first", "t_last", "t_end",
        "on_token", "on_end", "done", "outcome", "error_message",
    )

    def __init__(
        self,
        prompt_tokens: int,
        target: int,
        finish_reason: str,
        tokens: bytes,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
        prefix_key: Any = None,
        stall_s: float = 0.0,
        token_delay_s: float = 0.0,
        cut_after: int = -1,
        error_after: int = -1,
        on_token: Callable[[int], None] | None = None,
        on_end: Callable[[Seq], None] | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.cache_write_tokens = cache_write_tokens  # prefix tokens a miss writes to the cache
        self.prefix_key = prefix_key
        self.prefill_left = max(1, prompt_tokens - cached_tokens)
        self.target = target
        self.finish_reason = finish_reason
        self.tokens = tokens
        self.generated = 0
        self.state = WAITING
        self.next_at = 0.0
        self.stall_s = stall_s
        self.token_delay_s = token_delay_s
        self.cut_after = cut_after
        self.error_after = error_after
        # the token index at which a fault fires instead of a token (-1: none)
        fa = [k for k in (cut_after, error_after) if k >= 0]
        self.fault_at = min(fa) if fa else -1
        self.t_arrival = self.t_scheduled = self.t_prefill_done = 0.0
        self.t_first = self.t_last = self.t_end = 0.0
        self.on_token = on_token
        self.on_end = on_end
        self.done: asyncio.Future[str] | None = None
        self.outcome = ""
        self.error_message = ""

    @property
    def phase(self) -> str | None:
        return _PHASE_OF_STATE.get(self.state)


class Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.waiting: collections.deque[Seq] = collections.deque()
        self.prefilling: list[Seq] = []
        self.decoding: list[Seq] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self.prefix_cache: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.on_finished: Callable[[Seq], None] | None = None  # metrics hook
        # counters
        self.steps = 0
        self.submitted = 0
        self.completed = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.cancellations = dict.fromkeys(PHASES, 0)
        self.cancellation_times: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # --- queries -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        used = 0
        for s in self.prefilling:
            used += s.prompt_tokens - s.prefill_left
        for s in self.decoding:
            used += s.prompt_tokens + s.generated
        return min(1.0, used / self.cfg.kv_cache_tokens)

    def lookup_prefix(self, key: Any, tokens: int) -> int:
        """Cached prompt tokens for a prefix hash (0 on a miss). Counts the prefix-cache metrics."""
        self.prefix_queries_tokens += tokens
        if key in self.prefix_cache:
            self.prefix_cache.move_to_end(key)
            self.prefix_hits_tokens += tokens
            return tokens
        return 0

    # --- requests ------------------------------------------------------------------------
    def can_accept(self) -> bool:
        mw = self.cfg.max_waiting
        return not mw or len(self.waiting) < mw

    def submit(self, seq: Seq) -> asyncio.Future[str]:
        if not self.can_accept():
            raise QueueFull
        loop = self.loop
        seq.t_arrival = loop.time()
        seq.done = loop.create_future()
        seq.state = WAITING
        self.waiting.append(seq)
        self.submitted += 1
        self.prompt_tokens_total += seq.prompt_tokens
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)
        return seq.done

    def cancel(self, seq: Seq) -> str | None:
        """Remove `seq` at once (client went away). Returns the phase it was in, or None."""
        st = seq.state
        if st == FINISHED:
            return None
        if st == WAITING:
            with contextlib.suppress(ValueError):  # pragma: no cover
                self.waiting.remove(seq)
        elif st == PREFILL:
            self.prefilling.remove(seq)
        else:
            self.decoding.remove(seq)
        phase = _PHASE_OF_STATE[st]
        self._end(seq, CANCELLED)
        self.note_cancellation(phase)
        return phase

    def note_cancellation(self, phase: str) -> None:
        self.cancellations[phase] += 1
        self.cancellation_times.append({"phase": phase, "monotonic": time.monotonic(),
                                        "unix": time.time()})

    # --- the step loop -------------------------------------------------------------------
    def _end(self, seq: Seq, outcome: str) -> None:
        """Finish `seq`: notify the server, resolve its future. The caller prunes the lists."""
        seq.state = FINISHED
        seq.outcome = outcome
        seq.t_end = self.loop.time()
        if outcome in (STOP, LENGTH):
            self.completed += 1
            self.finished_by_reason[outcome] += 1
            if self.on_finished is not None:
                self.on_finished(seq)
        else:
            self.finished_by_reason["abort"] += 1
        cb = seq.on_end
        if cb is not None and outcome != CANCELLED:
            cb(seq)
        d = seq.done
        if d is not None and not d.done():
            d.set_result(outcome)

    async def _idle(self, until: float) -> None:
        loop = self.loop
        w = self._wake = loop.create_future()
        h = loop.call_at(until, _set_none, w) if until < math.inf else None
        try:
            await w
        finally:
            self._wake = None
            if h is not None:
                h.cancel()

    async def _run(self) -> None:
        loop = self.loop
        t = loop.time()
        while True:
            now = loop.time()
            if now - t > MAX_LAG_S:
                t = now
            cfg = self.cfg

            # 1. which decoding sequences produce a token this step
            next_wake = math.inf
            decode: list[Seq] = []
            for s in self.decoding:
                na = s.next_at
                if na <= now:
                    decode.append(s)
                elif na < next_wake:
                    next_wake = na

            # 2. chunked prefill: running prefills first, then admit from the queue
            budget = cfg.prefill_chunk_tokens
            chunks: list[tuple[Seq, int]] = []
            for s in self.prefilling:
                if budget <= 0:
                    break
                n = min(budget, s.prefill_left)
                chunks.append((s, n))
                budget -= n
            while budget > 0 and self.waiting and self.num_running < cfg.max_batch:
                s = self.waiting.popleft()
                s.state = PREFILL
                s.t_scheduled = now
                self.prefilling.append(s)
                n = min(budget, s.prefill_left)
                chunks.append((s, n))
                budget -= n

            if not decode and not chunks:
                await self._idle(next_wake)
                t = loop.time()
                continue

            prefill_tokens = cfg.prefill_chunk_tokens - budget
            dt = (cfg.decode_base_ms + cfg.decode_per_seq_ms * (len(decode) + len(chunks))) / 1000.0
            if prefill_tokens:
                dt += prefill_tokens / cfg.prefill_tokens_per_s
            t_end = t + dt
            delay = t_end - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self.steps += 1
            now = loop.time()
            try:
                self._complete(decode, chunks, now)
            except Exception:  # pragma: no cover - a bug in a callback must not stop the engine
                log.exception("sim engine step failed")
                self.prefilling = [s for s in self.prefilling if s.state == PREFILL]
                self.decoding = [s for s in self.decoding if s.state == DECODE]
            t = t_end

    def _complete(self, decode: list[Seq], chunks: list[tuple[Seq, int]], now: float) -> None:
        finished = False
        emitted = 0
        # decode tokens
        for s in decode:
            if s.state != DECODE:  # cancelled during the step
                continue
            g = s.generated
            if g == s.fault_at:
                self._fault(s)
                finished = True
                continue
            if g >= s.target:  # an answer of no tokens, after a stall
                self._end_empty(s, now)
                finished = True
                continue
            s.generated = g + 1
            emitted += 1
            if g == 0:
                s.t_first = now
            s.t_last = now
            cb = s.on_token
            if cb is not None:
                cb(s.tokens[g])
            if s.state != DECODE:  # the write failed and cancelled it
                continue
            if g + 1 >= s.target:
                self._end(s, s.finish_reason)
                finished = True
            elif s.token_delay_s:
                s.next_at = now + s.token_delay_s
        # prefill progress; the step that completes a prefill yields the first token
        moved = False
        for s, n in chunks:
            if s.state != PREFILL:
                continue
            s.prefill_left -= n
            if s.prefill_left > 0:
                continue
            s.state = DECODE
            s.t_prefill_done = now
            moved = True
            self.decoding.append(s)
            if s.prefix_key is not None:
                self._remember_prefix(s.prefix_key)
            if s.stall_s:
                s.next_at = now + s.stall_s
                continue
            if s.fault_at == 0:
                self._fault(s)
                finished = True
                continue
            if s.target <= 0:
                self._end_empty(s, now)
                finished = True
                continue
            s.generated = 1
            emitted += 1
            s.t_first = s.t_last = now
            cb = s.on_token
            if cb is not None:
                cb(s.tokens[0])
            if s.state != DECODE:
                continue
            if s.target <= 1:
                self._end(s, s.finish_reason)
                finished = True
            elif s.token_delay_s:
                s.next_at = now + s.token_delay_s
        self.generation_tokens_total += emitted
        if moved:
            self.prefilling = [s for s in self.prefilling if s.state == PREFILL]
        if finished:
            self.decoding = [s for s in self.decoding if s.state == DECODE]

    def _end_empty(self, s: Seq, now: float) -> None:
        """An answer of no tokens (a continued prefill that was the whole answer) ends where its
        first token would have come."""
        s.t_first = s.t_last = now
        self._end(s, s.finish_reason)

    def _fault(self, s: Seq) -> None:
        if s.fault_at == s.cut_after:
            self._end(s, CUT)
        else:
            s.error_message = f"Simulated engine failure after {s.generated} tokens"
            self._end(s, ERROR)

    def _remember_prefix(self, key: Any) -> None:
        pc = self.prefix_cache
        if key in pc:
            pc.move_to_end(key)
            return
        pc[key] = None
        while len(pc) > self.cfg.prefix_cache_entries:
            pc.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "prefilling": len(self.prefilling),
            "decoding": len(self.decoding),
            "submitted": self.submitted,
            "completed": self.completed,
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
            "prefix_cache": {"query_tokens": self.prefix_queries_tokens,
                             "hit_tokens": self.prefix_hits_tokens},
            "kv_cache_usage": self.kv_usage(),
            "finished": dict(self.finished_by_reason),
            "cancellations": dict(self.cancellations),
            "cancellation_times": list(self.cancellation_times),
        }


def _set_none(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)
