"""The built-in engine simulator: OpenAI (chat, completions, Responses; vLLM, Groq and Cerebras
flavours) and Anthropic Messages wire formats backed by one continuous-batching engine model
(queue, chunked prefill, batch-dependent decode, prefix cache, fault injection).

    from backends.sim import SimConfig, build_app
    app = build_app(SimConfig(decode_base_ms=2))
"""
from .config import SimConfig
from .server import build_app

__all__ = ["SimConfig", "build_app"]
