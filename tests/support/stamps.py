"""An Exchange that also keeps the stamp of every token event, for tests that check which reads
were token events (the gateway's own keeps only its gaps' bucket counts: telemetry/gaps.py)."""
from __future__ import annotations

from gateway.apis.base import EventInfo
from gateway.exchange import Exchange


class StampedExchange(Exchange):
    def __init__(self, route: str, gap_bounds_ns: tuple[int, ...] = ()) -> None:
        super().__init__(route, gap_bounds_ns)
        self.token_stamps: list[int] = []

    def event_seen(self, info: EventInfo, t: int) -> None:
        if info.token:
            self.token_stamps.append(t)
        super().event_seen(info, t)
