"""Weighted fair ordering of the admission queue (start-time fair queueing, with earliest
deadline first inside a flow, strict priority bands and a per-class minimum share).

A *flow* is one (tenant, SLO class). Its weight is the tenant's weight times the class's
weight. Every flow carries a virtual start tag; the queue's virtual time V is the tag of the
request dispatched last. When a flow becomes backlogged its tag is max(its tag, V); each
dispatch from it advances its tag by 1 / weight. The next request to dispatch is the head of
the backlogged flow with the highest priority band and, within the band, the smallest tag;
inside a flow the head is the request with the earliest TTFT deadline. So a flow with weight 2
dispatches twice for every dispatch of a flow with weight 1 while both wait, an idle flow
banks no credit (its tag is pulled up to V), and no flow with demand starves inside its band.

Across bands priority is strict, except that a class whose share of the last `window`
dispatches fell below its `min_share` while it had requests waiting goes first: strict
priority then still leaves every class at least its minimum share.

When the queue is full, the request shed is the newest of the flow furthest over its share
(the most requests waiting per unit of weight), which is the arriving request's own flow when
that is the one over its share.

Pure: no I/O, no clock (the controller owns the waiters and their futures).
"""
from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any, Protocol

WINDOW = 100  # dispatches over which a class's share is measured
MIN_HISTORY = 10  # below this many dispatches no class is "starved" yet


class Queued(Protocol):
    """What the fair queue needs of a waiter."""
    flow: tuple[str, str]
    deadline: int
    seq: int
    priority: int


class Flow:
    __slots__ = ("key", "weight", "min_share", "priority", "tag", "waiting")

    def __init__(self, key: tuple[str, str], weight: float, min_share: float,
                 priority: int) -> None:
        self.key = key
        self.weight = weight
        self.min_share = min_share
        self.priority = priority
        self.tag = 0.0
        self.waiting: list[tuple[int, int, Any]] = []  # (deadline, seq, waiter), a heap


class FairQueue:
    """Flows of waiters in fair order. The number of flows is bounded by the configured
    tenants (+ `other`) times the classes."""

    def __init__(self, window: int = WINDOW) -> None:
        self.flows: dict[tuple[str, str], Flow] = {}
        self.vtime = 0.0
        self.recent: deque[str] = deque(maxlen=window)  # class of each recent dispatch
        self.counts: Counter[str] = Counter()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, waiter: Queued, weight: float, min_share: float) -> None:
        flow = self.flows.get(waiter.flow)
        if flow is None:
            flow = self.flows[waiter.flow] = Flow(waiter.flow, weight, min_share,
                                                  waiter.priority)
        if not flow.waiting:
            flow.tag = max(flow.tag, self.vtime)  # an idle flow banks no credit
        heapq.heappush(flow.waiting, (waiter.deadline, waiter.seq, waiter))
        self.size += 1

    def remove(self, waiter: Queued) -> bool:
        """Take a waiter out without dispatching it (cancelled, rejected, shed)."""
        flow = self.flows.get(waiter.flow)
        if flow is None:
            return False
        for i, item in enumerate(flow.waiting):
            if item[2] is waiter:
                flow.waiting[i] = flow.waiting[-1]
                flow.waiting.pop()
                heapq.heapify(flow.waiting)
                self.size -= 1
                return True
        return False

    def dispatched(self, waiter: Queued) -> None:
        """`waiter` leaves the queue admitted: its flow's tag and the virtual time move on,
        and its class's share is counted."""
        if not self.remove(waiter):
            return
        flow = self.flows[waiter.flow]
        self.vtime = max(self.vtime, flow.tag)
        flow.tag += 1.0 / flow.weight
        self._count(waiter.flow[1])

    def admitted_directly(self, cls: str) -> None:
        """A request admitted without waiting still counts towards its class's share."""
        self._count(cls)

    def _count(self, cls: str) -> None:
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0]
            self.counts[old] -= 1
        self.recent.append(cls)
        self.counts[cls] += 1

    def waiting_above(self, priority: int) -> bool:
        """Does a flow of a higher priority band have requests waiting?"""
        return any(f.waiting and f.priority > priority for f in self.flows.values())

    def share(self, cls: str) -> float:
        return self.counts[cls] / len(self.recent) if self.recent else 0.0

    def _starved(self, flow: Flow) -> bool:
        return (len(self.recent) >= MIN_HISTORY and flow.min_share > 0
                and self.share(flow.key[1]) < flow.min_share)

    def order(self, extra: Queued | None = None, weight: float = 1.0,
              min_share: float = 0.0) -> Iterator[Any]:
        """Every waiter, in the order they would be dispatched if each were admitted in turn
        (the queue is not changed). A starved class's head goes first. With `extra` (an
        arrival, of that weight and min_share): the order as it would be were it pushed."""
        cursors: list[tuple[tuple[int, int, float, int, int], int, Flow, list[Any]]] = []
        flows = list(self.flows.values())
        if extra is not None and extra.flow not in self.flows:
            flows.append(Flow(extra.flow, weight, min_share, extra.priority))
        for flow in flows:
            items = list(flow.waiting)
            tag = flow.tag
            if extra is not None and flow.key == extra.flow:
                if not items:
                    tag = max(tag, self.vtime)  # as push() would
                items.append((extra.deadline, extra.seq, extra))
            if not items:
                continue
            items.sort(key=lambda item: item[:2])
            first = items[0]
            bump = 0 if self._starved(flow) else 1
            cursors.append(((bump, -flow.priority, tag, first[0], first[1]), 0, flow, items))
        heapq.heapify(cursors)
        while cursors:
            (_, prio, tag, _, _), i, flow, items = heapq.heappop(cursors)
            yield items[i][2]
            i += 1
            if i < len(items):
                nxt = items[i]
                heapq.heappush(cursors, ((1, prio, tag + 1.0 / flow.weight, nxt[0], nxt[1]),
                                         i, flow, items))

    def victim(self, arriving: tuple[str, str], arriving_weight: float) -> Any | None:
        """The queue is full: the newest waiter of the flow furthest over its share, or None
        when that is the arriving request's own flow (then the arrival is the one shed)."""
        worst: Flow | None = None
        worst_load = (len(self.flows[arriving].waiting) + 1 if arriving in self.flows
                      else 1) / arriving_weight
        for flow in self.flows.values():
            if flow.key == arriving or not flow.waiting:
                continue
            load = len(flow.waiting) / flow.weight
            if load > worst_load:
                worst, worst_load = flow, load
        if worst is None:
            return None
        return max(worst.waiting, key=lambda item: item[1])[2]

    def snapshot(self) -> dict[str, Any]:
        return {"virtual_time": round(self.vtime, 3),
                "flows": {f"{t}/{c}": {"waiting": len(f.waiting), "weight": f.weight,
                                       "tag": round(f.tag, 3),
                                       "class_share": round(self.share(c), 3)}
                          for (t, c), f in self.flows.items() if f.waiting or f.tag}}
