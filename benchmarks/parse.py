"""Per-event CPU of the relay's tap (SSE parser + stream observer), no sockets.

    python -m benchmarks.parse

Times one vLLM-style content chunk per read, the common case, and reports µs per event
(median of 7 runs)."""
from __future__ import annotations

import statistics
import time

from gateway.apis import chat
from gateway.apis.sse import SSEParser
from gateway.exchange import Exchange

TOKEN = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
         b'"model":"sim-llama-8b","choices":[{"index":0,"delta":{"content":" token"},'
         b'"logprobs":null,"finish_reason":null}]}\n\n')


def run(n: int = 100_000) -> dict[str, float]:
    def parse_only() -> float:
        p = SSEParser()
        t = time.perf_counter()
        for _ in range(n):
            p.feed(TOKEN)
        return (time.perf_counter() - t) / n * 1e6

    def parse_and_observe() -> float:
        ex = Exchange(chat.CHAT)
        observe, stamp = chat.API.observe, ex.event_seen
        p = SSEParser()
        t = time.perf_counter()
        for i in range(n):
            for ev in p.feed(TOKEN):
                stamp(observe(ev, chat.CHAT), i)
        return (time.perf_counter() - t) / n * 1e6

    return {name: statistics.median(fn() for _ in range(7))
            for name, fn in (("parse", parse_only), ("parse+observe", parse_and_observe))}


if __name__ == "__main__":
    for name, us in run().items():
        print(f"{name:15s} {us:6.2f} µs/event")
