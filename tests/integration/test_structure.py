"""Structure v2: the import graph has the shape the design says, and the bugs found while
reshaping the proxy stay fixed (each test here failed on the main before it)."""
from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from backends.sim import SimConfig, build_app as build_sim
from gateway import config
from gateway.edge.auth import hash_key
from gateway.ops.server import FINISHER_KEY, build_app
from tests.support.otlp_receiver import RECEIVER, receiver_app
from tests.support.prometheus_server import free_port
from tests.support.servers import serve_app
from tests.support.upstreams import REQUESTS, scripted_app

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(decode_base_ms=2, decode_per_seq_ms=0, prefill_tokens_per_s=1e6)
MSG = [{"role": "user", "content": "hello"}]


# -- the import graph ----------------------------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, package: str, modules: set[str], typing: bool = False) -> set[str]:
    """Modules of our own that `path` imports: when it runs, or with `typing`, also those the
    type checker reads (imports under `if TYPE_CHECKING:`). `from pkg import submodule` depends
    on the submodule only; `import pkg` or `from pkg import name` on pkg's __init__ too."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not typing and isinstance(child, ast.If) \
                    and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    base = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    name = f"{base}.{child.module}" if child.module else base
                else:
                    name = child.module or ""
                subs = {f"{name}.{a.name}" for a in child.names}
                out.update(subs & modules)
                if subs - modules:
                    out.add(name)
            visit(child)

    visit(tree)
    return {m for m in out if m.split(".")[0] in ("gateway", "backends")}


def _graph(typing: bool = False) -> dict[str, set[str]]:
    files = [p for d in ("gateway", "backends") for p in (ROOT / d).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in _imports(path, package, set(modules), typing)
                       if m in modules and m != name}
    return graph


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)


def test_import_graph_has_no_cycle() -> None:
    _assert_acyclic(_graph())


def test_no_cycle_even_through_type_checking_imports() -> None:
    _assert_acyclic(_graph(typing=True))


# The layers of gateway/, bottom up: a module imports (TYPE_CHECKING included) only from its own
# layer or below. docs/architecture.md says what each is for.
LAYERS = (
    ("gateway", "gateway.errors", "gateway.timeline"),
    ("gateway.config",),
    ("gateway.apis",),
    ("gateway.transport",),
    ("gateway.edge",),
    ("gateway.upstream",),
    ("gateway.exchange",),
    ("gateway.telemetry",),
    ("gateway.admission",),
    ("gateway.request",),
    ("gateway.console",),
    ("gateway.ops", "gateway.__main__"),
)


def _layer(module: str) -> int:
    best = (-1, -1)  # (length of the longest matching prefix, its layer)
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), level)
    assert best[1] >= 0, f"{module} is in no layer"
    return best[1]


def test_no_import_runs_up_a_layer() -> None:
    graph = _graph(typing=True)
    up = sorted(f"{m} -> {i}" for m, imports in graph.items() if m.startswith("gateway")
                for i in imports if _layer(i) > _layer(m))
    assert not up, "imports that run up a layer:\n" + "\n".join(up)


# What may touch aiohttp's insides outside gateway/transport/: nothing. Its public modules only,
# no subclass of its classes, no private attribute of anything but the object itself.
PUBLIC_AIOHTTP = {"aiohttp", "aiohttp.web"}
STDLIB_PRIVATE = {"_replace", "_asdict", "_fields", "_exit"}  # namedtuple's API, os._exit


def test_aiohttp_internals_only_in_the_transport() -> None:
    found: list[str] = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where.startswith("gateway/transport/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiohttp") \
                    and node.module not in PUBLIC_AIOHTTP:
                found.append(f"{where}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("aiohttp") and a.name not in PUBLIC_AIOHTTP]
            elif isinstance(node, ast.ClassDef):
                found += [f"{where}:{node.lineno} subclasses {ast.unparse(b)}" for b in node.bases
                          if ast.unparse(b).split(".")[0] in ("aiohttp", "web")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and node.attr not in STDLIB_PRIVATE \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_every_exception_class_is_in_errors() -> None:
    found = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "gateway":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).endswith(("Exception", "Error")) for b in node.bases):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not found, "exception classes outside gateway/errors.py:\n" + "\n".join(found)


def test_backends_import_nothing_from_the_gateway_and_the_gateway_not_the_simulator() -> None:
    graph = _graph()
    for module, imports in graph.items():
        if module.startswith("backends"):
            assert not {m for m in imports if m.startswith("gateway")}, module
        if module.startswith("gateway"):
            assert not {m for m in imports if m.startswith("backends")}, module


# -- a half-open breaker lets exactly one probe through, admission on or off --------------------

def slow_failing_upstream(delay_s: float) -> tuple[web.Application, list[float]]:
    """A replica that answers 503 after `delay_s`: long enough for a burst to pile onto it."""
    seen: list[float] = []
    app = web.Application()

    async def handler(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        await asyncio.sleep(delay_s)
        return web.Response(status=503)

    app.router.add_post("/{tail:.*}", handler)
    return app, seen


@pytest.mark.parametrize("admission", [False, True])
async def test_half_open_breaker_admits_one_probe_in_a_burst(admission: bool) -> None:
    sick, seen = slow_failing_upstream(0.3)
    async with serve_app(sick) as sick_url, \
            serve_app(build_sim(SimConfig(**FAST, max_batch=64))) as good:
        cfg = config.parse({
            "auth": {"mode": "open"}, "server": {"access_log": False},
            "admission": {"enabled": admission},
            "breaker": {"failures": 1, "cooldown_s": 0.3},
            "retry": {"backoff_base_s": 0.0},
            "backends": [{"name": "sick", "base_url": sick_url + "/v1", "models": ["m"]},
                         {"name": "good", "base_url": good + "/v1", "models": ["m"]}]}, env={})
        async with serve_app(build_app(cfg)) as base:
            client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)

            async def one() -> str:
                r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=2)
                return r.choices[0].message.content or ""

            while not seen:  # until a request has met the sick replica: its breaker opens
                assert await one()
            opened_at = time.monotonic()
            await asyncio.sleep(0.35)  # the cooldown passes: the next request is the probe
            results = await asyncio.gather(*(one() for _ in range(20)))
            await client.close()
    assert all(results)  # the probe failed over; everyone else went to the good replica
    assert len([t for t in seen if t > opened_at]) == 1


# -- allow-lists hold for the model each attempt sends, fallbacks included ----------------------

async def test_fallback_is_not_served_to_a_key_that_may_not_use_it() -> None:
    dead = free_port()
    fallback = scripted_app([b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n',
                             b"data: [DONE]\n\n"])
    async with serve_app(fallback) as fb_url:
        cfg = config.parse({
            "auth": {"mode": "keys", "keys": [
                {"tenant": "small", "sha256": hash_key("k-small"), "models": ["a"]},
                {"tenant": "both", "sha256": hash_key("k-both"), "models": ["a", "b"]}]},
            "server": {"access_log": False}, "fallbacks": {"a": ["b"]},
            "backends": [{"name": "a", "base_url": f"http://127.0.0.1:{dead}/v1",
                          "models": ["a"]},
                         {"name": "b", "base_url": fb_url + "/v1", "models": ["b"]}]}, env={})
        async with serve_app(build_app(cfg)) as base:
            for key, served in (("k-small", False), ("k-both", True)):
                client = AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
                try:
                    if served:
                        stream = await client.chat.completions.create(
                            model="a", messages=MSG, stream=True)
                        assert "".join([c.choices[0].delta.content or "" async for c in stream])
                    else:
                        with pytest.raises(openai.APIStatusError) as e:
                            await client.chat.completions.create(model="a", messages=MSG)
                        assert e.value.status_code == 502
                finally:
                    await client.close()
                assert len(fallback[REQUESTS]) == (1 if served else 0)


# -- content capture is opt-in, bounded, and off by default --------------------------------------

@pytest.mark.parametrize("capture", [False, True])
async def test_content_capture_only_when_the_operator_opts_in(capture: bool) -> None:
    prompt = "a prompt that must not leak " + "x" * 40_000
    otlp = receiver_app()
    async with serve_app(otlp) as otlp_url, serve_app(build_sim(SimConfig(**FAST))) as sim:
        cfg = config.parse({
            "auth": {"mode": "open"}, "server": {"access_log": False},
            "telemetry": {"otlp_endpoint": otlp_url, "capture_content": capture,
                          "otlp_metrics": False},
            "backends": [{"name": "s", "base_url": sim + "/v1", "models": ["m"]}]}, env={})
        app = build_app(cfg)
        async with serve_app(app) as base:
            client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            stream = await client.chat.completions.create(
                model="m", stream=True, max_tokens=6,
                messages=[{"role": "user", "content": prompt}])
            text = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
            await client.close()
            await asyncio.to_thread(app[FINISHER_KEY].tracing.provider.force_flush)
    (server,) = otlp[RECEIVER].by_name("chat m")
    if not capture:
        assert "gen_ai.input.messages" not in server.attrs
        assert "gen_ai.output.messages" not in server.attrs
        assert "must not leak" not in repr([s.attrs for s in otlp[RECEIVER].spans])
        return
    captured_in = server.attrs["gen_ai.input.messages"]
    assert "a prompt that must not leak" in captured_in and len(captured_in) == 16 * 1024
    assert server.attrs["gen_ai.output.messages"] == text


# -- a probe whose client leaves does not leave the breaker half-open for ever ------------------

async def test_probe_abandoned_by_its_client_lets_the_next_request_probe() -> None:
    calls: list[int] = []
    app = web.Application()

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        if len(calls) == 1:
            return web.Response(status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(50):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i)
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app.router.add_post("/{tail:.*}", handler)
    async with serve_app(app) as up:
        cfg = config.parse({
            "auth": {"mode": "open"}, "server": {"access_log": False},
            "breaker": {"failures": 1, "cooldown_s": 0.2}, "retry": {"max_attempts": 1},
            "backends": [{"name": "only", "base_url": up + "/v1", "models": ["m"]}]}, env={})
        async with serve_app(build_app(cfg)) as base:
            client = AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            with pytest.raises(openai.APIStatusError):  # the 503 opens the breaker
                await client.chat.completions.create(model="m", messages=MSG)
            await asyncio.sleep(0.25)  # the cooldown passes
            stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
            async for _ in stream:
                break  # the probe's client leaves after its first chunk
            await stream.close()
            stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            await client.close()
    assert len(calls) == 3 and text.startswith("t0t1")
