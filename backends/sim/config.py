"""The simulator's knobs: one dataclass, shared by the CLI and `POST /sim/config`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Values accepted for the `hang` knob / `x-sim-hang` header.
HANG_MODES = ("", "headers", "first_token")
# Provider flavours of OpenAI-format answers (`provider` knob / `x-sim-provider` header).
PROVIDERS = ("vllm", "groq", "cerebras")
# Anthropic error types an in-band engine error can have (`error_type` / `x-sim-error-type`).
ERROR_KINDS = ("api_error", "overloaded_error")


def _k(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class SimConfig:
    """Every knob of the simulated engine. Defaults model a mid-size model on one GPU."""

    # --- model / API surface -------------------------------------------------------------
    served_model_names: list[str] = _k(["sim"], "model names listed by /v1/models",
                                       cli="--served-model-name")
    accept_any_model: bool = _k(True, "accept any model name in requests (else 404 for unknown "
                                "names)")
    api_key: str = _k("", "if set, require 'Authorization: Bearer <key>' on /v1/* (like vllm "
                      "--api-key)")
    force_include_usage: bool = _k(False, "always send the usage chunk on streams (vllm "
                                   "--enable-force-include-usage)")
    request_log_size: int = _k(200, "how many received requests GET /sim/requests keeps")
    provider: str = _k("vllm", "flavour of OpenAI-format answers: vllm, groq (x_groq timings), "
                       "cerebras (time_info, system_fingerprint); /openai/v1/* answers as groq",
                       choices=PROVIDERS)
    per_request_metrics: bool = _k(False, "vLLM's per-request `metrics` object on the usage chunk "
                                   "and whole responses (vllm --enable-per-request-metrics)")
    prompt_tokens_details: bool = _k(False, "vLLM's usage.prompt_tokens_details.cached_tokens "
                                     "(vllm --enable-prompt-tokens-details); the groq and "
                                     "cerebras flavours, Responses and Messages always report "
                                     "their prompt cache")

    # --- engine physics ------------------------------------------------------------------
    max_batch: int = _k(256, "max running sequences (vllm max_num_seqs)")
    max_waiting: int = _k(0, "max queued requests before answering 503 (0 = unbounded)")
    prefill_tokens_per_s: float = _k(20000.0, "prefill speed (compute bound)")
    prefill_chunk_tokens: int = _k(2048, "max prompt tokens prefilled per engine step (chunked "
                                   "prefill)")
    decode_base_ms: float = _k(10.0, "fixed cost of one engine step")
    decode_per_seq_ms: float = _k(0.15, "extra step cost per sequence in the batch (memory bound)")
    bytes_per_token: int = _k(4, "prompt bytes per prompt token")
    max_model_len: int = _k(32768, "context length: prompt + max_tokens above it is a 400")
    kv_cache_tokens: int = _k(262144, "KV cache capacity in tokens (only drives "
                              "vllm:kv_cache_usage_perc)")

    # --- output length and content -------------------------------------------------------
    mean_output_tokens: int = _k(128, "mean of the lognormal output length when the request sets "
                                 "no max_tokens")
    output_tokens_sigma: float = _k(0.6, "sigma of that lognormal (0 = always the mean)")
    max_output_tokens: int = _k(4096, "cap on any output length")
    seed: int = _k(0, "global seed mixed into every request's PRNG")

    # --- prefix cache --------------------------------------------------------------------
    prefix_cache_bytes: int = _k(0, "bytes of prompt prefix that can hit the prefix cache "
                                 "(0 = off)")
    prefix_cache_entries: int = _k(1024, "LRU size of the prefix cache")

    # --- fault defaults (per-request x-sim-* headers override these) ---------------------
    stall_ms: float = _k(0.0, "delay the first token by this much after prefill")
    token_delay_ms: float = _k(0.0, "extra delay between tokens (slow tokens)")
    cut_after: int = _k(-1, "close the connection abruptly after this many tokens (-1 = off)")
    error_after: int = _k(-1, "send a mid-stream error event after this many tokens (-1 = off)")
    fault_status: int = _k(0, "answer every request with this HTTP status (0 = off), e.g. "
                           "429/503/529")
    fault_status_rate: float = _k(1.0, "fraction of requests that get fault_status (seeded)")
    retry_after_s: float = _k(-1.0, "Retry-After seconds sent with fault_status (-1 = no header)")
    hang: str = _k("", "'headers' = never send headers, 'first_token' = never send a token",
                   choices=HANG_MODES)
    ping_ms: float = _k(0.0, "send ': ping' SSE comments every N ms while no token flows (0 = off)")
    role_first: bool = _k(False, "send the role chunk right after the headers, not with the "
                          "first token")
    output_tokens: int = _k(0, "force every output to this many tokens (0 = off)")
    reasoning_tokens: int = _k(16, "reasoning tokens that open the answer when the request asks "
                               "for reasoning (chat reasoning_effort, Responses reasoning, "
                               "Anthropic thinking)")
    fault_status_count: int = _k(-1, "answer only the first N requests with fault_status, then "
                                 "serve normally (-1 = no limit)")
    stall_rate: float = _k(1.0, "fraction of requests that get the stall_ms stall (seeded)")
    error_type: str = _k("api_error", "what an error_after error is: api_error (500) or "
                         "overloaded_error (529, Anthropic's 'Overloaded')", choices=ERROR_KINDS)
    linger_ms: float = _k(0.0, "keep a stream's body open this long after its terminal event "
                          "(0 = end at once)")
    no_terminator: bool = _k(False, "end streams cleanly without their terminal event ([DONE], "
                             "message_stop, response.completed)")
    continuation: bool = _k(True, "continue a final assistant message (chat "
                            "continue_final_message, Messages prefill); off: such requests are "
                            "a 400, like an engine without support")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise ValueError naming the knob, the value and what was expected."""
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected {what}")

        need(self.max_batch >= 1, "max_batch", "an integer >= 1")
        need(self.max_waiting >= 0, "max_waiting", "an integer >= 0")
        need(self.prefill_tokens_per_s > 0, "prefill_tokens_per_s", "a number > 0")
        need(self.prefill_chunk_tokens >= 1, "prefill_chunk_tokens", "an integer >= 1")
        need(self.decode_base_ms >= 0, "decode_base_ms", "a number >= 0")
        need(self.decode_per_seq_ms >= 0, "decode_per_seq_ms", "a number >= 0")
        need(self.bytes_per_token >= 1, "bytes_per_token", "an integer >= 1")
        need(self.max_model_len >= 2, "max_model_len", "an integer >= 2")
        need(self.kv_cache_tokens >= 1, "kv_cache_tokens", "an integer >= 1")
        need(self.mean_output_tokens >= 1, "mean_output_tokens", "an integer >= 1")
        need(self.output_tokens_sigma >= 0, "output_tokens_sigma", "a number >= 0")
        need(self.max_output_tokens >= 1, "max_output_tokens", "an integer >= 1")
        need(self.prefix_cache_bytes >= 0, "prefix_cache_bytes", "an integer >= 0")
        need(self.prefix_cache_entries >= 1, "prefix_cache_entries", "an integer >= 1")
        need(self.stall_ms >= 0, "stall_ms", "a number >= 0")
        need(self.token_delay_ms >= 0, "token_delay_ms", "a number >= 0")
        need(self.cut_after >= -1, "cut_after", "-1 (off) or a token count >= 0")
        need(self.error_after >= -1, "error_after", "-1 (off) or a token count >= 0")
        need(self.fault_status == 0 or 400 <= self.fault_status <= 599, "fault_status",
             "0 or an HTTP status 400-599")
        need(0.0 <= self.fault_status_rate <= 1.0, "fault_status_rate", "a fraction 0..1")
        need(self.hang in HANG_MODES, "hang", f"one of {HANG_MODES}")
        need(self.ping_ms >= 0, "ping_ms", "a number >= 0")
        need(self.output_tokens >= 0, "output_tokens", "an integer >= 0")
        need(self.reasoning_tokens >= 0, "reasoning_tokens", "an integer >= 0")
        need(self.fault_status_count >= -1, "fault_status_count", "-1 (no limit) or a count >= 0")
        need(0.0 <= self.stall_rate <= 1.0, "stall_rate", "a fraction 0..1")
        need(self.error_type in ERROR_KINDS, "error_type", f"one of {ERROR_KINDS}")
        need(self.linger_ms >= 0, "linger_ms", "a number >= 0")
        need(self.provider in PROVIDERS, "provider", f"one of {PROVIDERS}")
        need(self.request_log_size >= 0, "request_log_size", "an integer >= 0")
        need(len(self.served_model_names) >= 1
             and all(isinstance(n, str) and n for n in self.served_model_names),
             "served_model_names", "a non-empty list of names")


KNOBS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(SimConfig)}


def coerce(name: str, value: Any) -> Any:
    """Convert a JSON/CLI value to the knob's type; raise ValueError with a clear message."""
    f = KNOBS.get(name)
    if f is None:
        raise ValueError(f"unknown knob {name!r}; known: {', '.join(sorted(KNOBS))}")
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if typ == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on",
                                                            "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if typ == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(value)
        if typ == "float":
            if isinstance(value, bool):
                raise ValueError
            v = float(value)
            if math.isnan(v):
                raise ValueError
            return v
        if typ == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
        if typ == "list[str]":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return list(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected {typ}") from None
    raise ValueError(f"{name}: unsupported knob type {typ}")  # pragma: no cover


def updated(cfg: SimConfig, changes: dict[str, Any]) -> SimConfig:
    """A new, validated config with `changes` applied (names are snake_case or kebab-case)."""
    vals = {}
    for k, v in changes.items():
        name = k.replace("-", "_")
        vals[name] = coerce(name, v)
    new = dataclasses.replace(cfg, **vals)
    new.validate()
    return new
