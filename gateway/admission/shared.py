"""Admission state shared by several gateway processes through Redis.

Per backend replica one hash, `slogate:inflight:<backend>`: field = gateway id, value = that
gateway's requests in flight there. A request is admitted to a replica only if one atomic Lua
script finds the sum of the live fields below the replica's cap, and then increments this
gateway's field, so the cap holds exactly across gateways. Each gateway keeps a lease,
`slogate:lease:<gateway id>`, refreshed every lease_s/3 with a TTL of lease_s; the script ignores
and deletes the fields of gateways whose lease is gone, so a gateway that died (SIGKILL, host
lost) frees its slots after at most lease_s.

Each gateway also publishes what it has queued and in prefill per replica (`slogate:work`, one
field per gateway, refreshed with the lease) so the others can see it in /admin/admission and,
if the controller wants, count it as work ahead (`remote_prefill_tokens`).

One acquirer per replica: callers that want a slot while a script for that replica is on its
way wait for the next one, which takes as many slots as they want (up to the cap) in one round
trip and hands them out in arrival order; releases are batched the same way. So a slow Redis
adds a round trip to a decision but does not cap decisions at one per round trip, and a burst
of waiters woken at once costs one call, not one each.

Redis slow (round trips, a moving average, above `redis_slow_ms` for `redis_slow_for_s`) is
treated as Redis unreachable: a gateway admitting at Redis's pace would throttle every request
it serves. It comes back when the background pings are fast again (below 0.8 x the bound).

Redis unreachable (at start, or any call failing or taking longer than `redis_timeout_s`, its
wait for one of the `redis_pool_size` connections included): the gateway falls back to local
accounting, admitting up to floor(cap * redis_share) (at least 1) per
replica on its own, says so in the log (once per transition) and in the gauge
`slogate_admission_shared_state{state="redis"|"local"}`, and keeps trying to reconnect in the
background. When Redis is back, this gateway's fields are reset to its current local counts
(resync) and shared accounting resumes. A call never blocks admission for more than about
2 x redis_timeout_s, and only the calls that meet the outage pay that: once local, admission
makes no Redis calls at all.
"""
from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import AdmissionConfig
from gateway.errors import StaleState

if TYPE_CHECKING:
    from gateway.admission.controller import AdmissionController
    from gateway.telemetry.prometheus import Metrics

# No CLIENT SETINFO on connect (redis-py >= 7 takes driver_info=None; older, lib_name=None).
NO_SETINFO: dict[str, Any] = (
    {"driver_info": None} if importlib.util.find_spec("redis.driver_info")
    else {"lib_name": None, "lib_version": None})

log = logging.getLogger("slogate.admission")

PREFIX = "slogate:"
LEASE_PREFIX = PREFIX + "lease:"
INFLIGHT_PREFIX = PREFIX + "inflight:"
WORK_KEY = PREFIX + "work"
REDIS, LOCAL = "redis", "local"
HOST_PREFIX = "redis-fallback:"  # keys of the host's SlotTable (serve --workers N)

# KEYS[1] the replica's in-flight hash. ARGV: gateway id, cap, lease key prefix, slots wanted.
# Returns {slots taken (at most those wanted), live in-flight total after the call}.
ACQUIRE_LUA = """
local fields = redis.call('HGETALL', KEYS[1])
local total = 0
for i = 1, #fields, 2 do
  local gid = fields[i]
  local n = tonumber(fields[i + 1]) or 0
  if gid == ARGV[1] or redis.call('EXISTS', ARGV[3] .. gid) == 1 then
    if n > 0 then total = total + n end
  else
    redis.call('HDEL', KEYS[1], gid)
  end
end
local got = math.max(0, math.min(tonumber(ARGV[4]) or 1, tonumber(ARGV[2]) - total))
if got > 0 then redis.call('HINCRBY', KEYS[1], ARGV[1], got) end
return {got, total + got}
"""

# KEYS[1] the replica's in-flight hash. ARGV: gateway id, slots given back. Never goes below
# zero.
RELEASE_LUA = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -(tonumber(ARGV[2]) or 1))
if n <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return n
"""

# KEYS[1] this gateway's lease, KEYS[2..] in-flight hashes. ARGV: gateway id, lease ms, then
# this gateway's count for each hash. Sets the lease and overwrites this gateway's fields.
RESYNC_LUA = """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
for i = 2, #KEYS do
  local n = tonumber(ARGV[i + 1])
  if n > 0 then redis.call('HSET', KEYS[i], ARGV[1], n)
  else redis.call('HDEL', KEYS[i], ARGV[1]) end
end
return 1
"""

# KEYS[1] the work hash. ARGV: gateway id, this gateway's work (JSON), lease key prefix.
# Publishes ours, drops dead gateways' entries, returns the others' {id, json, ...}.
WORK_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local fields = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #fields, 2 do
  local gid = fields[i]
  if gid ~= ARGV[1] then
    if redis.call('EXISTS', ARGV[3] .. gid) == 1 then
      out[#out + 1] = gid
      out[#out + 1] = fields[i + 1]
    else
      redis.call('HDEL', KEYS[1], gid)
    end
  end
end
return out
"""

# KEYS[1] this gateway's lease, KEYS[2] the work hash, KEYS[3..] in-flight hashes.
# ARGV[1] gateway id. A clean shutdown: give everything back now rather than after the lease.
LEAVE_LUA = """
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do redis.call('HDEL', KEYS[i], ARGV[1]) end
return 1
"""

# KEYS[1] a tenant quota's bucket. ARGV: capacity, cost, force (1: apply even if short: a
# settlement or a refund). Refilled at capacity per minute from Redis's own clock, so every
# gateway sees the same bucket. Returns {1 if taken else 0, what is left (as a string)}.
BUCKET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'v', 't')
local v = tonumber(b[1]) or cap
local last = tonumber(b[2]) or now
v = math.min(cap, v + (now - last) * cap / 60000)
local ok = 1
if ARGV[3] ~= '1' and cost > 0 and v < cost then ok = 0 else v = math.min(cap, v - cost) end
redis.call('HSET', KEYS[1], 'v', tostring(v), 't', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
return {ok, tostring(v)}
"""
QUOTA_PREFIX = PREFIX + "quota:"

_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
RTT_WEIGHT = 0.2  # of each round trip in the moving average
BACK_BELOW = 0.8  # x redis_slow_ms: fast enough again to leave the slow fallback
UNREACHABLE, SLOW = "unreachable", "slow"  # why admission is local


def gateway_id() -> str:
    """Unique per process: hostname, pid and a random part (pids repeat across containers)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urlunsplit(parts._replace(netloc=user + netloc))
    return url


class SharedState:
    """Global per-replica concurrency caps and shared work, with a local fallback."""

    def __init__(self, cfg: AdmissionConfig, metrics: Metrics | None = None, *,
                 gid: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.timeout_s = cfg.redis_timeout_s
        self.slow_s = cfg.redis_slow_ms / 1e3
        self.rtt_s: float | None = None  # moving average of round trips
        self._slow_since: float | None = None
        self.local_reason = UNREACHABLE
        self.calls = 0  # Redis calls made (acquire, release, refresh, ...)
        self.gid = gid or gateway_id()
        self.url = redact(cfg.redis_url)
        self.lease_ms = max(1, int(cfg.lease_s * 1000))
        self.refresh_s = cfg.lease_s / 3
        self.retry_s = min(1.0, self.refresh_s)
        self.state = LOCAL
        self.local: dict[str, int] = {}  # this gateway's in-flight per replica (authoritative)
        self.limits: dict[str, int] = {}  # last cap seen per replica
        self.remote_work: dict[str, dict[str, Any]] = {}  # other gateways' published work
        self.global_in_flight: dict[str, dict[str, int]] = {}  # last read of the hashes
        self.transitions = 0
        self.last_error = ""
        self.acquires = 0
        self.local_acquires = 0
        self.rejects = 0
        # serve --workers N: the host's workers share one local share while Redis is
        # unreachable (admission/hostlocal.py), so the fallback is never N x floor(cap*share)
        self.host: Any = None  # hostlocal.SlotTable
        self.host_held: dict[str, int] = {}  # slots of that table this worker holds
        self._epoch = itertools.count()
        self.epoch = next(self._epoch)
        self._ctrl: AdmissionController | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._sem = asyncio.Semaphore(cfg.redis_pool_size)
        # the one acquirer and the one releaser per replica: who waits for the next call
        self._acquiring: dict[str, list[asyncio.Future[bool | None]]] = {}
        self._releasing: dict[str, int] = {}
        self.r = aioredis.from_url(
            cfg.redis_url, socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
            health_check_interval=0, max_connections=cfg.redis_pool_size,
            # A new connection is one TCP connect, no handshake round trips (which a burst of
            # new connections would pay within the connect timeout).
            **NO_SETINFO)
        self._acquire = self.r.register_script(ACQUIRE_LUA)
        self._release = self.r.register_script(RELEASE_LUA)
        self._resync = self.r.register_script(RESYNC_LUA)
        self._work = self.r.register_script(WORK_LUA)
        self._leave = self.r.register_script(LEAVE_LUA)
        self._bucket = self.r.register_script(BUCKET_LUA)
        self._set_gauge()

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self, controller: AdmissionController) -> None:
        """Publish this controller's queued and prefill work with each lease refresh."""
        self._ctrl = controller

    async def start(self) -> None:
        """Connect once (briefly); on failure start local and keep retrying in the background.
        Never raises for an unreachable Redis: the gateway must start without it."""
        try:
            await self._connect()
        except _FAILURES as e:
            self.last_error = _describe(e)
            log.warning("admission: Redis at %s unreachable (%s); using local accounting "
                        "(%.0f%% of each replica's cap) and retrying in the background",
                        self.url, self.last_error, 100 * self.cfg.redis_share)
        else:
            self._to(REDIS, quiet=True)
            log.info("admission: shared state in Redis at %s (gateway %s, lease %.1f s)",
                     self.url, self.gid, self.cfg.lease_s)
        self._task = asyncio.create_task(self._loop(), name="slogate-shared-state")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        if self.state == REDIS:
            keys = [LEASE_PREFIX + self.gid, WORK_KEY] + [INFLIGHT_PREFIX + b for b in self.local]
            try:
                await self._call(self._leave, keys=keys, args=[self.gid])
            except _FAILURES:
                pass
        try:
            await self.r.aclose()
        except _FAILURES:
            pass

    # -- the controller's interface ----------------------------------------------------------

    def local_cap(self, limit: int) -> int:
        return max(1, math.floor(limit * self.cfg.redis_share))

    async def try_acquire(self, backend: str, limit: int) -> bool:
        """Claim one of `limit` slots on `backend`, across all gateways (with Redis) or out of
        this gateway's share (without)."""
        self.limits[backend] = limit
        if self.state == REDIS:
            got: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
            waiting = self._acquiring.get(backend)
            if waiting is None:  # no acquirer for this replica: become it
                waiting = self._acquiring[backend] = []
                self._spawn(self._acquirer(backend))
            waiting.append(got)
            # A caller cancelled here (the client left) is skipped when slots are handed out;
            # a slot the script took for it anyway is given back.
            answer = await got
            if answer is not None:
                return answer
            # None: went local meanwhile (or Redis failed): decide locally
        n = self.local.get(backend, 0)
        if self.host is not None:
            ok = self.host.try_acquire(HOST_PREFIX + backend, self.local_cap(limit))
            if ok:
                self.host_held[backend] = self.host_held.get(backend, 0) + 1
        else:
            ok = n < self.local_cap(limit)
        if ok:
            self.local[backend] = n + 1
            self.local_acquires += 1
            return True
        self.rejects += 1
        return False

    async def _acquirer(self, backend: str) -> None:
        """The one acquirer of `backend`: while callers wait, one script takes the slots they
        want (up to the cap) and they are handed out in arrival order; those who came during
        the round trip wait for the next one."""
        waiting = self._acquiring[backend]
        try:
            while waiting:
                batch = [f for f in waiting if not f.done()]
                waiting.clear()
                if not batch:
                    break
                epoch = self.epoch
                got: int | None = None
                if self.state == REDIS:
                    try:
                        got, _total = await self._call(
                            self._acquire, keys=[INFLIGHT_PREFIX + backend],
                            args=[self.gid, self.limits[backend], LEASE_PREFIX, len(batch)],
                            epoch=epoch)
                    except StaleState:
                        pass  # went local while waiting: they decide locally
                    except _FAILURES as e:
                        self._lost(e, epoch)
                self._hand_out(backend, batch, got, epoch)
        finally:
            del self._acquiring[backend]
            for f in waiting:  # closing, or the task was cancelled: decide locally
                if not f.done():
                    f.set_result(None)

    def _hand_out(self, backend: str, batch: list[asyncio.Future[bool | None]],
                  got: int | None, epoch: int) -> None:
        left = int(got) if got is not None else 0
        for f in batch:
            if f.done():  # its caller left during the round trip
                continue
            if got is None:
                f.set_result(None)
            elif left > 0:
                left -= 1
                self.local[backend] = self.local.get(backend, 0) + 1
                self.acquires += 1
                f.set_result(True)
            else:
                self.rejects += 1
                f.set_result(False)
        if left > 0 and not self._closing:  # taken for callers who left: give them back
            self._release_later(backend, left, epoch)

    def release(self, backend: str) -> None:
        """Give a slot back; never blocks (the Redis update runs in a task)."""
        n = self.local.get(backend, 0)
        if n <= 0:
            return  # not ours (a mismatched release must not free another gateway's slot)
        self.local[backend] = n - 1
        if self.host_held.get(backend, 0) > 0:
            self.host_held[backend] -= 1
            self.host.release(HOST_PREFIX + backend)
        if self.state == REDIS and not self._closing:
            self._release_later(backend, 1, self.epoch)

    def _release_later(self, backend: str, n: int, epoch: int) -> None:
        """Releases of one replica are batched: one call in flight, the next gives back all
        that came meanwhile."""
        pending = self._releasing.get(backend)
        self._releasing[backend] = (pending or 0) + n
        if pending is None:
            self._spawn(self._releaser(backend, epoch))

    async def _releaser(self, backend: str, epoch: int) -> None:
        try:
            while (n := self._releasing.get(backend, 0)) > 0:
                self._releasing[backend] = 0
                # A resync since then already wrote the count without these (StaleState).
                await self._call(self._release, keys=[INFLIGHT_PREFIX + backend],
                                 args=[self.gid, n], epoch=epoch)
        except StaleState:
            pass
        except _FAILURES as e:
            self._lost(e, epoch)
        finally:
            self._releasing.pop(backend, None)

    def move(self, src: str, dst: str) -> None:
        """A request already admitted to `src` is being retried on `dst`: its slot moves with
        it (unconditionally: the retry is under way). Never blocks."""
        if src == dst or self.local.get(src, 0) <= 0:
            return
        held = self.host_held.get(src, 0) > 0
        self.release(src)
        self.local[dst] = self.local.get(dst, 0) + 1
        if held:
            self.host_held[dst] = self.host_held.get(dst, 0) + 1
            self.host.force_acquire(HOST_PREFIX + dst)
        if self.state == REDIS and not self._closing:
            self._spawn(self._force_acquire(dst, self.epoch))

    def shared_now(self) -> bool:
        return self.state == REDIS and not self._closing

    def spawn(self, coro: Any) -> None:
        """Run a Redis update in the background (kept until done, awaited on close)."""
        self._spawn(coro)

    async def bucket(self, name: str, capacity: int, cost: float,
                     force: bool) -> tuple[bool, float] | None:
        """Take `cost` from the global quota bucket `name` (a tenant's requests or tokens per
        minute); None when Redis is not in use (the caller falls back to its local share)."""
        if self.state != REDIS:
            return None
        epoch = self.epoch
        try:
            ok, left = await self._call(self._bucket, keys=[QUOTA_PREFIX + name],
                                        args=[capacity, cost, 1 if force else 0], epoch=epoch)
        except StaleState:
            return None
        except _FAILURES as e:
            self._lost(e, epoch)
            return None
        return bool(int(ok)), float(_s(left))

    def remote_prefill_tokens(self, backend: str) -> float:
        """Prompt tokens other gateways have admitted to `backend` and not yet seen a first
        token for (as of their last publish, at most lease_s/3 old)."""
        if self.state != REDIS:
            return 0.0
        return float(sum(w.get("replicas", {}).get(backend, {}).get("prefill_tokens", 0.0)
                         for w in self.remote_work.values()))

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state, "redis_url": self.url, "gateway_id": self.gid,
            "lease_s": self.cfg.lease_s, "redis_share": self.cfg.redis_share,
            "local_caps": {b: self.local_cap(c) for b, c in self.limits.items()},
            "in_flight_here": dict(self.local),
            "in_flight_global": {b: {"total": sum(v.values()), "by_gateway": v}
                                 for b, v in self.global_in_flight.items()},
            "other_gateways": self.remote_work,
            "local_reason": self.local_reason if self.state == LOCAL else None,
            "redis_rtt_ms": round(1e3 * self.rtt_s, 2) if self.rtt_s is not None else None,
            "redis_calls": self.calls,
            "transitions": self.transitions, "last_error": self.last_error,
            "acquired_shared": self.acquires, "acquired_local": self.local_acquires,
            "refused": self.rejects,
        }

    # -- internals ---------------------------------------------------------------------------

    async def _call(self, fn: Any, *args: Any, epoch: int | None = None, **kw: Any) -> Any:
        """fn(*args, **kw) against Redis: at most redis_pool_size at once, bounded as a whole
        (the wait for a turn included: calls piling up is Redis too slow for this load) by
        2 x redis_timeout_s. Its round trip feeds the slow-Redis fallback."""
        async with asyncio.timeout(2 * self.timeout_s):
            async with self._sem:
                if epoch is not None and epoch != self.epoch:
                    raise StaleState
                self.calls += 1
                t0 = self.clock()
                out = await fn(*args, **kw)
                self._round_trip(self.clock() - t0)
                return out

    def _round_trip(self, rtt_s: float) -> None:
        """Go local when the moving average has stayed above redis_slow_ms for
        redis_slow_for_s (one log line); the background loop brings it back."""
        avg = self.rtt_s = rtt_s if self.rtt_s is None else \
            self.rtt_s + RTT_WEIGHT * (rtt_s - self.rtt_s)
        if avg <= self.slow_s:
            self._slow_since = None
            return
        now = self.clock()
        if self._slow_since is None:
            self._slow_since = now
        if self.state == REDIS and now - self._slow_since >= self.cfg.redis_slow_for_s:
            self._to(LOCAL)
            self.local_reason = SLOW
            log.warning("admission: Redis at %s is slow (round trips %.0f ms on average, "
                        "above %.0f ms for %g s); using local accounting (%.0f%% of each "
                        "replica's cap) until it is fast again", self.url, 1e3 * avg,
                        1e3 * self.slow_s, self.cfg.redis_slow_for_s,
                        100 * self.cfg.redis_share)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _force_acquire(self, backend: str, epoch: int) -> None:
        try:
            await self._call(self.r.hincrby, INFLIGHT_PREFIX + backend, self.gid, 1, epoch=epoch)
        except StaleState:
            pass
        except _FAILURES as e:
            self._lost(e, epoch)

    async def _connect(self) -> None:
        await self._call(self.r.ping)
        await self._resync_now()

    async def _resync_now(self) -> None:
        """This gateway's fields := its local counts, and a fresh lease. Local admissions and
        releases go on during the round trip: repeat until the counts written are current."""
        for _ in range(5):
            counts = dict(self.local)
            keys = [LEASE_PREFIX + self.gid] + [INFLIGHT_PREFIX + b for b in counts]
            args = [self.gid, self.lease_ms, *counts.values()]
            await self._call(self._resync, keys=keys, args=args)
            if counts == self.local:
                return

    def _lost(self, e: BaseException, epoch: int | None = None) -> None:
        self.last_error = _describe(e)
        if self.state == REDIS and (epoch is None or epoch == self.epoch):
            self._to(LOCAL)
            self.local_reason = UNREACHABLE
            log.warning("admission: Redis at %s lost (%s); falling back to local accounting "
                        "(%.0f%% of each replica's cap) until it is back", self.url,
                        self.last_error, 100 * self.cfg.redis_share)

    def _to(self, state: str, quiet: bool = False) -> None:
        self.state = state
        self.epoch = next(self._epoch)
        if not quiet:
            self.transitions += 1
        self._set_gauge()

    def _set_gauge(self) -> None:
        if self.metrics is not None:
            gauge = self.metrics.shared_state
            gauge.labels(REDIS).set(1 if self.state == REDIS else 0)
            gauge.labels(LOCAL).set(1 if self.state == LOCAL else 0)

    async def _loop(self) -> None:
        while True:
            if self.state == REDIS:
                await asyncio.sleep(self.refresh_s)
                if self.state != REDIS:
                    continue
                epoch = self.epoch
                try:
                    await self._refresh(epoch)
                except StaleState:
                    pass
                except _FAILURES as e:
                    self._lost(e, epoch)
            else:
                await asyncio.sleep(self.retry_s)
                try:
                    if self.local_reason == SLOW:
                        await self._call(self.r.ping)
                        if self.rtt_s is not None and self.rtt_s > BACK_BELOW * self.slow_s:
                            continue  # still slow
                    await self._connect()
                except _FAILURES as e:
                    self.last_error = _describe(e)
                    continue
                if self.state == LOCAL:
                    was = self.local_reason
                    self._to(REDIS)
                    log.warning("admission: Redis at %s is %s again; shared accounting resumed "
                                "(this gateway's counts resynced: %s)", self.url,
                                "fast" if was == SLOW else "reachable",
                                dict(self.local) or "none in flight")

    async def _refresh(self, epoch: int) -> None:
        """Renew the lease; if it had expired (we were cut off or paused for longer than
        lease_s, so others may have dropped our fields), resync. Then publish our work and read
        the others'."""
        had = await self._call(self.r.set, LEASE_PREFIX + self.gid, "1", px=self.lease_ms,
                               get=True, epoch=epoch)
        if had is None:
            await self._resync_now()
            log.info("admission: lease of gateway %s had expired; counts resynced", self.gid)
        others = await self._call(self._work, keys=[WORK_KEY],
                                  args=[self.gid, orjson.dumps(self._my_work()), LEASE_PREFIX],
                                  epoch=epoch)
        work: dict[str, dict[str, Any]] = {}
        for i in range(0, len(others) - 1, 2):
            try:
                work[_s(others[i])] = orjson.loads(others[i + 1])
            except orjson.JSONDecodeError:
                continue
        self.remote_work = work
        backends = list(self.limits)
        if backends:
            async with self.r.pipeline(transaction=False) as p:
                for b in backends:
                    p.hgetall(INFLIGHT_PREFIX + b)
                views = await self._call(p.execute, epoch=epoch)
            self.global_in_flight = {b: {_s(k): int(v) for k, v in view.items()}
                                     for b, view in zip(backends, views, strict=True)}

    def _my_work(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": time.time(), "in_flight": dict(self.local)}
        ctrl = self._ctrl
        if ctrl is None:
            return out
        out["queue"] = {"requests": len(ctrl.queue),
                        "estimated_tokens": round(ctrl.queued_tokens)}
        out["replicas"] = {
            name: {"prefill_tokens": round(load.prefill_tokens), "prefilling": load.prefilling,
                   "decoding": load.decoding}
            for name, load in ctrl.loads.items()}
        return out


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}"[:200]
