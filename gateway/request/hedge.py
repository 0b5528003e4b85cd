"""The first-token race (hedging): a stream whose first token is late gets a second attempt on
another replica; the first of the two to produce a token is the answer, the other is cancelled
at once (its connection closed: the engine aborts it, as for a client that left).

- The attempt in flight (the primary) is relayed on the request's exchange as always. The
  hedge runs in a task of its own on a fork of the exchange: its upstream body goes to a
  `FirstTokenProbe`, which observes it on the fork's own Splicer (nothing goes to the client)
  and records each read with its arrival time.
- Whoever has a token (or a complete answer) first claims the `Race`: the primary in its
  relay's commit, the hedge in its probe. A primary that loses is ended by its watchdog (an
  attempt result `hedge_lost`); a hedge that wins hands its response, body and recorded reads
  to the proxy, which replays them into an ordinary relay on the exchange with their own
  times — the client's answer and the timeline are the hedge's, byte for byte.
- A primary that fails before commit while its hedge runs does not fail over: the hedge is
  its next attempt.
- `Hedging` decides whether a request may race at all: its class's `hedge_after_ms` (or
  "auto", the class's live P95 TTFT, at least twice its median), a budget per tenant (at most
  `retry.hedge_budget` extra upstream requests per request, banked up to a few), and never
  when admission has requests waiting or the other replica is full (a hedge must not make
  overload worse).
"""
from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.apis import failures
from gateway.apis.sse import DEFAULT_MAX_EVENT_BYTES
from gateway.edge.limits import EVENT_TOO_LARGE
from gateway.errors import (
    ATTEMPT_CUT,
    ATTEMPT_HEDGE_LOST,
    ATTEMPT_IN_BAND_ERROR,
    CLOSED_BEFORE_FIRST_TOKEN,
    OK,
    AttemptFailed,
    EventTooLarge,
)
from gateway.request.relay import Replay, Splicer, complete_at_eof
from gateway.timeline import now_ns
from gateway.transport.wire import UpstreamBody

if TYPE_CHECKING:
    from gateway.apis.base import Api
    from gateway.config import Config, SLOClass
    from gateway.exchange import Attempt, Exchange
    from gateway.request.deadlines import Watchdog
    from gateway.telemetry.prometheus import Metrics
    from gateway.transport.client import UpstreamResponse

PRIMARY, HEDGE = "primary", "hedge"
# slogate_hedges_total{result}: the hedge had the first token; the primary had it; the hedge
# failed on its own; the request ended before either had one.
WON, LOST, FAILED, ABANDONED = "won", "lost", "failed", "abandoned"
# slogate_hedges_skipped_total{reason}
SKIP_BUDGET, SKIP_SATURATED, SKIP_NO_REPLICA = "budget", "saturated", "no_replica"
AUTO_WINDOW = 256  # recent first tokens per class for "auto"
AUTO_MIN_SAMPLES = 20  # before that, "auto" does not race
AUTO_MEDIAN_FACTOR = 2.0  # "auto" races no earlier than twice the median first token
BUDGET_BANK = 3.0  # hedges a tenant may bank (a burst of slow first tokens)


@dataclass(slots=True)
class Handover:
    """A hedge that won: what the request's relay needs to go on with its answer."""
    fork: Exchange
    attempt: Attempt
    up: UpstreamResponse
    replay: Replay


class Race:
    """One request's race between its primary attempt and one hedge. The first to claim wins;
    the claim cancels the other."""

    __slots__ = ("watchdog", "winner", "timer", "task", "primary_running", "cls")

    def __init__(self, watchdog: Watchdog, cls: str) -> None:
        self.watchdog = watchdog  # the request's: it ends a primary that lost
        self.cls = cls
        self.winner: str | None = None
        self.timer: asyncio.TimerHandle | None = None  # until the hedge starts
        self.task: asyncio.Task[Handover | None] | None = None  # the hedge
        self.primary_running = True

    def primary_claims(self) -> bool:
        return self._claim(PRIMARY)

    def hedge_claims(self) -> bool:
        return self._claim(HEDGE)

    def _claim(self, who: str) -> bool:
        if self.winner is None:
            self.winner = who
            if who == HEDGE:
                if self.primary_running:
                    self.watchdog.fire(ATTEMPT_HEDGE_LOST)
            else:
                self.close()
        return self.winner == who

    async def hedge_after_primary(self) -> Handover | None:
        """The primary failed before commit: the hedge's answer, if one runs and it has (or
        gets) a first token; None otherwise (the proxy fails over as usual)."""
        self.primary_running = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        task = self.task
        if task is None:
            return None
        return await task  # cancelled with the request (its client left, a deadline)

    def close(self) -> None:
        """The race is over (or the request is): a hedge not started never starts, one running
        is cancelled (its connection closed at once)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None and not self.task.done():
            self.task.cancel()


class FirstTokenProbe:
    """A hedge's upstream body until its first token (or a complete answer), observed on its
    fork's Splicer and recorded with arrival times; nothing reaches the client. Claims the race
    when it has one: then reading pauses until the request's relay takes the body over."""

    def __init__(self, fork: Exchange, up: UpstreamResponse, api: Api, race: Race,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.fork = fork
        self.race = race
        self.splicer = Splicer(fork, api, None, max_event_bytes)
        self.replay = Replay(UpstreamBody(up))
        self.body = self.replay.body
        self.recorded = self.replay.reads
        self.size = 0
        self.max_bytes = max_event_bytes
        self.choices = api.choices(fork.parsed)
        self.result: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def run(self) -> bool:
        """True: this hedge won (its body paused and still hooked here: `replay` has what it
        read, and goes on to the request's relay); False: the primary had its token first.
        AttemptFailed when the hedge failed."""
        self.body.hook(self)
        won = False
        try:
            won = await self.result
            return won
        finally:
            if not won:
                self.body.unhook()

    def body_data(self, chunk: bytes) -> None:
        t = now_ns()
        self.recorded.append((chunk, t))
        if self.result.done():  # won: the relay replays it (anything else: closed at once)
            return
        self.size += len(chunk)
        fork = self.fork
        try:
            self.splicer.feed(chunk, t)
        except EventTooLarge as e:
            self._fail(AttemptFailed(EVENT_TOO_LARGE, 502, str(e), EVENT_TOO_LARGE))
            return
        if fork.error_type and not fork.t_first_token:
            said = b"".join(c for c, _ in self.recorded)
            self._fail(AttemptFailed(ATTEMPT_IN_BAND_ERROR, 502, "The hedge answered with an "
                                     "error before its first token.", fork.error_type,
                                     judges_backend=failures.in_band_error(said)
                                     == failures.BACKEND_ERROR))
        elif fork.t_first_token or fork.done:
            self._claim()
        elif self.size > self.max_bytes:
            self._fail(AttemptFailed(EVENT_TOO_LARGE, 502, "The hedge sent more than "
                                     f"{self.max_bytes} bytes without a first token.",
                                     EVENT_TOO_LARGE))

    def body_eof(self) -> None:
        if self.result.done():  # its end, after it won: for the relay
            self.replay.ended = True
            return
        if complete_at_eof(self.fork, self.choices) and self.fork.events:
            self._claim()
        else:
            self._fail(AttemptFailed(CLOSED_BEFORE_FIRST_TOKEN, 502, "The hedge closed its "
                                     "stream before the first token.",
                                     "upstream_stream_truncated"))

    def body_error(self, exc: BaseException) -> None:
        if self.result.done():  # after it won: for the relay
            self.replay.ended = exc
        else:
            self._fail(AttemptFailed(ATTEMPT_CUT, 502, f"The hedge's stream was lost: {exc}",
                                     "upstream_connection_lost"))

    def _claim(self) -> None:
        won = self.race.hedge_claims()
        if won:
            self.body.pause()  # the relay resumes it once it has replayed what came
        self.result.set_result(won)

    def _fail(self, e: AttemptFailed) -> None:
        self.result.set_exception(e)


class Hedging:
    """Which requests race, when, and within what budget; the race's counters."""

    def __init__(self, cfg: Config, metrics: Metrics) -> None:
        self.classes = {name: c for name, c in cfg.slo.classes.items()
                        if c.hedge_after_ms is not None}
        self.budget = cfg.retry.hedge_budget
        self.metrics = metrics
        self.credit: dict[str, float] = {}  # per tenant label (bounded): hedges it may start
        self.ttfts: dict[str, deque[float]] = {}  # per class, seconds, for "auto"
        self.p95: dict[str, float] = {}
        self.seen: dict[str, int] = {}

    def delay_s(self, ex: Exchange) -> float | None:
        """How long after its send this request's first token may take before a hedge starts
        (None: no race). Each request that may race earns its tenant a share of a hedge."""
        cls = self.classes.get(ex.target.name)
        if cls is None or not ex.stream:
            return None
        tenant = ex.tenant_label
        self.credit[tenant] = min(BUDGET_BANK, self.credit.get(tenant, 0.0) + self.budget)
        return self._after_s(cls)

    def _after_s(self, cls: SLOClass) -> float | None:
        if cls.hedge_after_ms == "auto":
            return self.p95.get(cls.name)
        assert cls.hedge_after_ms is not None
        return cls.hedge_after_ms / 1e3

    def spend(self, ex: Exchange) -> bool:
        """May this request's tenant start a hedge now? Takes one from its budget if so."""
        tenant = ex.tenant_label
        if self.credit.get(tenant, 0.0) < 1.0:
            self.skipped(ex, SKIP_BUDGET)
            return False
        self.credit[tenant] -= 1.0
        return True

    def skipped(self, ex: Exchange, reason: str) -> None:
        self.metrics.child(self.metrics.hedges_skipped, (ex.target.name, reason)).inc()

    def ended(self, cls: str, result: str, loser_tokens: int) -> None:
        """A hedge's race is decided: `loser_tokens` are the tokens the cancelled attempt had
        produced (its prompt's are counted at the request's end, once they are known)."""
        self.metrics.child(self.metrics.hedges, (cls, result)).inc()
        if loser_tokens:
            self.metrics.child(self.metrics.hedge_tokens, (cls, "completion")).inc(loser_tokens)

    def finished(self, ex: Exchange) -> None:
        """The request's end: a race's loser was sent the same prompt (counted now that the
        usage says how long it was); a clean first token feeds the class's live P95."""
        if ex.hedge in (WON, LOST) and ex.prompt_tokens:
            self.metrics.child(self.metrics.hedge_tokens,
                               (ex.target.name, "prompt")).inc(ex.prompt_tokens)
        if ex.outcome != OK or not ex.t_first_token or not ex.t_dispatched or ex.slo is None:
            return
        name = ex.slo.name
        if name not in self.classes or self.classes[name].hedge_after_ms != "auto":
            return
        window = self.ttfts.get(name)
        if window is None:
            window = self.ttfts[name] = deque(maxlen=AUTO_WINDOW)
        # from the request's first send: a race's answer counts with the wait before its hedge
        window.append((ex.t_first_token - ex.t_dispatched) / 1e9)
        seen = self.seen[name] = self.seen.get(name, 0) + 1
        if len(window) >= AUTO_MIN_SAMPLES and seen % 8 == 0:  # sorted every 8th, not each
            ordered = sorted(window)
            p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
            # Where first tokens are tightly spread, their P95 is barely above the median: a
            # race there is mostly lost, and spends the budget a real stall would need.
            self.p95[name] = max(p95, AUTO_MEDIAN_FACTOR * ordered[len(ordered) // 2])
