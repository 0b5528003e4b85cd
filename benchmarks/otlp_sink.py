"""A minimal OTLP/HTTP receiver that accepts and drops everything: the far end of the
gateway's exporters when the overhead benchmark runs with telemetry on.

    python -m benchmarks.otlp_sink --port 4318
"""
from __future__ import annotations

import argparse

from aiohttp import web


def app() -> web.Application:
    counts = {"traces": 0, "metrics": 0}

    async def accept(request: web.Request) -> web.Response:
        await request.read()
        counts[request.match_info["signal"]] += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counts)

    a = web.Application(client_max_size=64 * 1024 * 1024)
    a.router.add_post("/v1/{signal:traces|metrics}", accept)
    a.router.add_get("/stats", stats)
    return a


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4318)
    args = ap.parse_args()
    web.run_app(app(), host=args.host, port=args.port, access_log=None, print=None)
