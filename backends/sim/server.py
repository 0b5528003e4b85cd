"""HTTP surface of the simulator: OpenAI-compatible routes, metrics, introspection, faults.

Streaming responses are written straight to the transport with precomputed chunked-encoding
frames from the engine's step callback: no coroutine switch, no JSON encoding, one write per
token per stream.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import formats
from .config import HANG_MODES, SimConfig, updated
from .engine import CANCELLED, CUT, ERROR, FINISHED, LENGTH, STOP, Engine, QueueFull, Seq
from .metrics import SimMetrics

JSON = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


class SimState:
    """Everything one simulator app owns: engine, metrics registry, request log, counters."""

    def __init__(self, cfg: SimConfig) -> None:
        cfg.validate()
        self.engine = Engine(cfg)
        self.requests_total = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.request_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=cfg.request_log_size)
        self.rng = random.Random(cfg.seed)
        self.active: set[asyncio.Task[Any]] = set()
        self.created = int(time.time())
        self.hanging = 0
        self.metrics = SimMetrics(self)

    @property
    def cfg(self) -> SimConfig:
        return self.engine.cfg

    def set_config(self, cfg: SimConfig) -> None:
        if cfg.request_log_size != self.request_log.maxlen:
            self.request_log = collections.deque(self.request_log, maxlen=cfg.request_log_size)
        self.engine.cfg = cfg

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        s["requests"] = self.requests_total
        s["hanging"] = self.hanging
        s["faults"] = dict(self.faults)
        return s


SIM = web.AppKey("sim", SimState)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, reason=_REASONS.get(status), headers=headers,
                        body=formats.error_body(message, status, param), content_type=JSON)


_REASONS = {529: "Site Overloaded"}  # statuses without a standard reason phrase


# --- per-request fault knobs --------------------------------------------------------------------

@dataclass(slots=True)
class Faults:
    stall_ms: float
    token_delay_ms: float
    cut_after: int
    error_after: int
    status: int
    retry_after: str | None
    hang: str
    ping_ms: float
    role_first: bool
    output_tokens: int


def _hnum(h: Any, name: str, default: float, conv: type, lo: float) -> Any:
    v = h.get(name)
    if v is None:
        return default
    try:
        x = conv(v.strip())
    except ValueError:
        raise BadRequest(f"header {name}: {v!r} is not a valid {conv.__name__}", name) from None
    if not (x >= lo) or (conv is float and math.isinf(x)):
        raise BadRequest(f"header {name}: {v!r} must be >= {lo}", name)
    return x


def parse_faults(h: Any, cfg: SimConfig, rng: random.Random) -> Faults:
    status = _hnum(h, "x-sim-status", 0, int, 0)
    if status and not 400 <= status <= 599:
        raise BadRequest(f"header x-sim-status: {status} is not an HTTP error status 400-599", "x-sim-status")
    if not status and cfg.fault_status and (cfg.fault_status_rate >= 1.0 or rng.random() < cfg.fault_status_rate):
        status = cfg.fault_status
    retry_after = h.get("x-sim-retry-after")
    if retry_after is None and cfg.retry_after_s >= 0:
        retry_after = f"{cfg.retry_after_s:g}"
    hang = h.get("x-sim-hang", cfg.hang).strip().lower()
    if hang not in HANG_MODES:
        raise BadRequest(f"header x-sim-hang: {hang!r} is not one of 'headers', 'first_token'", "x-sim-hang")
    rf = h.get("x-sim-role-first")
    role_first = cfg.role_first if rf is None else rf.strip().lower() in ("1", "true", "yes", "on")
    return Faults(
        stall_ms=_hnum(h, "x-sim-stall-ms", cfg.stall_ms, float, 0),
        token_delay_ms=_hnum(h, "x-sim-token-delay-ms", cfg.token_delay_ms, float, 0),
        cut_after=_hnum(h, "x-sim-cut-after", cfg.cut_after, int, -1),
        error_after=_hnum(h, "x-sim-error-after", cfg.error_after, int, -1),
        status=status,
        retry_after=retry_after,
        hang=hang,
        ping_ms=_hnum(h, "x-sim-ping-ms", cfg.ping_ms, float, 0),
        role_first=role_first,
        output_tokens=_hnum(h, "x-sim-output-tokens", cfg.output_tokens, int, 0),
    )


# --- request body -------------------------------------------------------------------------------

@dataclass(slots=True)
class Parsed:
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    seed: int | None
    prompt: bytes
    prompt_tokens: int


def _opt_int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if v < lo:
        raise BadRequest(f"'{key}' must be at least {lo}, got {v}", key)
    return v


def _chat_prompt(body: dict[str, Any]) -> tuple[bytes, int]:
    """The messages' text joined (for hashing and the prefix cache) and its content byte count."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    parts: list[bytes] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        c = m.get("content")
        if isinstance(c, str):
            parts.append(c.encode())
        elif isinstance(c, list):
            for p in c:
                if isinstance(p, dict) and isinstance(p.get("text"), str):
                    parts.append(p["text"].encode())
                elif not isinstance(p, dict):
                    raise BadRequest(f"messages[{i}].content parts must be objects", "messages")
        elif c is not None:
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null", "messages")
    return b"\n".join(parts), sum(map(len, parts))


def _completion_prompt(body: dict[str, Any]) -> tuple[bytes, int | None]:
    """Prompt bytes, and the token count when the prompt is given as token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p.encode(), None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return orjson.dumps(p), len(p)
    if isinstance(p, list) and len(p) > 1:
        raise BadRequest("the simulator serves one prompt per request", "prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


def parse_body(body: Any, chat: bool, cfg: SimConfig) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = cfg.served_model_names[0]
    elif not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    elif not cfg.accept_any_model and model not in cfg.served_model_names:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options")
        if not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise BadRequest("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = bool(iu)
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest("the simulator supports only n=1", "n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", "seed")
    mt = _opt_int(body, "max_tokens", 1)
    if chat:
        mct = _opt_int(body, "max_completion_tokens", 1)
        if mct is not None:
            mt = mct
        prompt, nbytes = _chat_prompt(body)
        ptoks = max(1, -(-nbytes // cfg.bytes_per_token))
    else:
        prompt, ptoks = _completion_prompt(body)
        if ptoks is None:
            ptoks = max(1, -(-len(prompt) // cfg.bytes_per_token))
    if ptoks >= cfg.max_model_len or (mt is not None and ptoks + mt > cfg.max_model_len):
        raise BadRequest(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{ptoks + (mt or 0)} tokens ({ptoks} in the messages, {mt or 0} in the completion). "
            "Please reduce the length of the messages or completion.", "messages" if chat else "prompt")
    return Parsed(model, stream, include_usage, mt, seed, prompt, ptoks)


def make_seq(p: Parsed, f: Faults, cfg: SimConfig, engine: Engine) -> Seq:
    if p.seed is not None:
        rng = random.Random(f"{cfg.seed}:{p.seed}")
    else:
        rng = random.Random(hashlib.blake2b(p.prompt, digest_size=16, person=b"%d" % cfg.seed).digest())
    sigma = cfg.output_tokens_sigma
    drawn = max(1, round(rng.lognormvariate(math.log(cfg.mean_output_tokens) - sigma * sigma / 2, sigma)))
    limit = p.max_tokens
    if f.output_tokens:
        target, reason = f.output_tokens, STOP
        if limit is not None and limit < target:
            target, reason = limit, LENGTH
    elif limit is not None:
        target, reason = limit, LENGTH
    else:
        target, reason = drawn, STOP
    room = min(cfg.max_output_tokens, cfg.max_model_len - p.prompt_tokens)
    if target > room:
        target, reason = room, LENGTH
    cached = 0
    key = None
    if cfg.prefix_cache_bytes:
        head = p.prompt[: cfg.prefix_cache_bytes]
        key = (len(head), hash(head))
        cached = engine.lookup_prefix(key, min(len(head) // cfg.bytes_per_token, p.prompt_tokens - 1))
    return Seq(
        p.prompt_tokens, target, reason, rng.randbytes(target),
        cached_tokens=cached,
        report_cached=bool(cfg.prefix_cache_bytes),
        prefix_key=key,
        stall_s=math.inf if f.hang == "first_token" else f.stall_ms / 1000.0,
        token_delay_s=f.token_delay_ms / 1000.0,
        cut_after=f.cut_after,
        error_after=f.error_after,
    )


# --- streaming sink -----------------------------------------------------------------------------

class StreamSink:
    """Receives engine callbacks for one streaming request and writes SSE bytes to the socket."""

    __slots__ = ("engine", "seq", "fmt", "include_usage", "role_sent", "transport", "framed",
                 "buf", "loop", "ping_s", "ping_h", "t_quiet")

    def __init__(self, engine: Engine, seq: Seq, fmt: Any, include_usage: bool) -> None:
        self.engine = engine
        self.seq = seq
        self.fmt = fmt
        self.include_usage = include_usage
        self.role_sent = False
        self.transport: Any = None
        self.framed = True
        self.buf: list[bytes] | None = []  # holds writes until the headers are out
        self.loop = engine.loop
        self.ping_s = 0.0
        self.ping_h: asyncio.TimerHandle | None = None
        self.t_quiet = 0.0
        seq.on_token = self.first
        seq.on_end = self.end

    def attach(self, transport: Any, framed: bool) -> None:
        self.transport = transport
        self.framed = framed
        buf, self.buf = self.buf, None
        if buf:
            self.write(b"".join(buf))

    def write(self, data: bytes) -> None:
        if self.buf is not None:
            self.buf.append(data)
            return
        tr = self.transport
        if tr is None or tr.is_closing():
            self.engine.cancel(self.seq)  # client gone: no-op if already finished
            return
        if self.framed:
            tr.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            tr.write(data)

    def first(self, tid: int) -> None:
        self.seq.on_token = self.token
        self.write(self.fmt.first(tid, self.role_sent))

    def token(self, tid: int) -> None:
        self.write(self.fmt.token(tid))

    def opening(self, role_first: bool) -> None:
        data = self.fmt.opening(role_first)
        if data:
            self.role_sent = role_first
            self.write(data)

    def end(self, seq: Seq) -> None:
        self.stop_ping()
        o = seq.outcome
        if o == STOP or o == LENGTH:
            self.write(self.fmt.finish(seq, self.include_usage))
        elif o == ERROR:
            self.write(self.fmt.error(seq.error_message, 500))
        elif o == CUT:
            if self.buf is None and self.transport is not None:
                self.transport.close()  # flushes what was written, then FIN: no terminator

    # keep-alive comments while no token flows
    def start_ping(self, interval_s: float) -> None:
        self.ping_s = interval_s
        self.t_quiet = self.loop.time()
        self.ping_h = self.loop.call_later(interval_s, self._ping)

    def _ping(self) -> None:
        seq = self.seq
        if seq.state == FINISHED:
            return
        now = self.loop.time()
        last = max(seq.t_last, self.t_quiet)
        if now - last >= self.ping_s * 0.999:
            self.write(self.fmt.ping)
            self.t_quiet = now
            nxt = now + self.ping_s
        else:
            nxt = last + self.ping_s
        self.ping_h = self.loop.call_at(nxt, self._ping)

    def stop_ping(self) -> None:
        if self.ping_h is not None:
            self.ping_h.cancel()
            self.ping_h = None


# --- handlers -----------------------------------------------------------------------------------

def _log_request(sim: SimState, request: web.Request, body: Any) -> None:
    if sim.request_log.maxlen:
        sim.request_log.append({
            "method": request.method,
            "path": request.path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": body,
            "time": time.time(),
        })


def _check_auth(cfg: SimConfig, request: web.Request) -> web.Response | None:
    if cfg.api_key and request.headers.get("Authorization", "") != f"Bearer {cfg.api_key}":
        return error_response(401, "Unauthorized: missing or wrong API key")
    return None


async def _wait_forever() -> None:
    await asyncio.get_running_loop().create_future()


async def _handle(request: web.Request, chat: bool) -> web.StreamResponse:
    sim = request.app[SIM]
    engine = sim.engine
    cfg = engine.cfg
    raw = await request.read()
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    _log_request(sim, request, body if body is not None else raw.decode("utf-8", "replace"))
    sim.requests_total += 1
    if (denied := _check_auth(cfg, request)) is not None:
        return denied
    try:
        f = parse_faults(request.headers, cfg, sim.rng)
        if f.status:
            sim.faults[f"status_{f.status}"] += 1
            hdrs = {"Retry-After": f.retry_after} if f.retry_after else None
            return error_response(f.status, f"Simulated error: HTTP {f.status}", headers=hdrs)
        if body is None:
            raise BadRequest("request body is not valid JSON")
        p = parse_body(body, chat, cfg)
    except BadRequest as e:
        return error_response(e.status, e.message, e.param)

    task = asyncio.current_task()
    assert task is not None
    sim.active.add(task)
    try:
        if f.hang == "headers":
            sim.faults["hang_headers"] += 1
            sim.hanging += 1
            try:
                await _wait_forever()
            except asyncio.CancelledError:
                engine.note_cancellation("queued")
                raise
            finally:
                sim.hanging -= 1
        if f.hang == "first_token":
            sim.faults["hang_first_token"] += 1
        if f.cut_after >= 0:
            sim.faults["cut"] += 1
        if f.error_after >= 0:
            sim.faults["error"] += 1
        if f.stall_ms:
            sim.faults["stall"] += 1
        if f.token_delay_ms:
            sim.faults["slow_tokens"] += 1
        seq = make_seq(p, f, cfg, engine)
        xrid = request.headers.get("X-Request-Id")
        base = xrid or uuid.uuid4().hex
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        created = int(time.time())
        if p.stream:
            return await _stream(request, sim, seq, p, f, rid, created, base, chat)
        return await _unary(request, sim, seq, p, rid, created, base, chat)
    finally:
        sim.active.discard(task)


async def _stream(request: web.Request, sim: SimState, seq: Seq, p: Parsed, f: Faults,
                  rid: str, created: int, base: str, chat: bool) -> web.StreamResponse:
    engine = sim.engine
    fmt = (formats.OpenAIChatStream if chat else formats.OpenAICompletionStream)(rid, created, p.model)
    sink = StreamSink(engine, seq, fmt, p.include_usage or engine.cfg.force_include_usage)
    try:
        done = engine.submit(seq)
    except QueueFull:
        return error_response(503, "The server is overloaded: waiting queue is full.")
    resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE, "X-Request-Id": base})
    try:
        writer = await resp.prepare(request)
        sink.attach(request.transport, bool(getattr(writer, "chunked", False)))
        sink.opening(f.role_first)
        if f.ping_ms:
            sink.start_ping(f.ping_ms / 1000.0)
        outcome = await done
        if outcome == CUT or outcome == CANCELLED:
            # connection closed (by us, or the client is gone): aiohttp cancels us shortly
            if request.transport is not None:
                request.transport.close()
            await asyncio.sleep(10)
            return resp
        await resp.write_eof()
        return resp
    except asyncio.CancelledError:
        engine.cancel(seq)
        raise
    except ConnectionError:
        engine.cancel(seq)
        return resp
    finally:
        sink.stop_ping()


async def _unary(request: web.Request, sim: SimState, seq: Seq, p: Parsed,
                 rid: str, created: int, base: str, chat: bool) -> web.StreamResponse:
    engine = sim.engine
    try:
        done = engine.submit(seq)
    except QueueFull:
        return error_response(503, "The server is overloaded: waiting queue is full.")
    try:
        outcome = await done
    except asyncio.CancelledError:
        engine.cancel(seq)
        raise
    if outcome == CUT:
        if request.transport is not None:
            request.transport.close()
        await asyncio.sleep(10)
    if outcome == ERROR:
        return error_response(500, seq.error_message)
    render = formats.chat_body if chat else formats.completion_body
    return web.Response(body=render(rid, created, p.model, seq), content_type=JSON,
                        headers={"X-Request-Id": base})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, False)


async def models(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    if (denied := _check_auth(sim.cfg, request)) is not None:
        return denied
    return web.Response(body=formats.models_body(sim.cfg.served_model_names, sim.created), content_type=JSON)


async def health(request: web.Request) -> web.Response:
    return web.Response()


async def metrics(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    return web.Response(body=generate_latest(sim.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def sim_stats(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[SIM].stats()), content_type=JSON)


async def sim_requests(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(list(request.app[SIM].request_log)), content_type=JSON)


async def sim_requests_clear(request: web.Request) -> web.Response:
    request.app[SIM].request_log.clear()
    return web.Response(body=b"[]", content_type=JSON)


async def sim_config_get(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[SIM].cfg.to_dict()), content_type=JSON)


async def sim_config_post(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    try:
        changes = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return error_response(400, "body must be a JSON object of knob names to values")
    if not isinstance(changes, dict):
        return error_response(400, "body must be a JSON object of knob names to values")
    try:
        new = updated(sim.cfg, changes)
    except ValueError as e:
        return error_response(400, str(e))
    sim.set_config(new)
    return web.Response(body=orjson.dumps(new.to_dict()), content_type=JSON)


async def _on_startup(app: web.Application) -> None:
    app[SIM].engine.start()


async def _on_shutdown(app: web.Application) -> None:
    # Abort in-flight and hanging requests so graceful shutdown does not wait for them.
    for t in list(app[SIM].active):
        t.cancel()


async def _on_cleanup(app: web.Application) -> None:
    await app[SIM].engine.stop()


def build_app(cfg: SimConfig | None = None) -> web.Application:
    """A fresh simulator app with its own engine, metrics registry and request log."""
    sim = SimState(cfg if cfg is not None else SimConfig())
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM] = sim
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_get("/sim/requests", sim_requests)
    app.router.add_delete("/sim/requests", sim_requests_clear)
    app.router.add_get("/sim/config", sim_config_get)
    app.router.add_post("/sim/config", sim_config_post)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app
