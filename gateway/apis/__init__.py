"""The route table and the provider table: the only place that lists API adapters and
backend flavours (gateway/apis/base.py says what each must do).

Adding a provider: write its module (a `Provider`, with its timing reader if its streams report
timings) and add one line to PROVIDERS. Adding a client API: write its `Api` and add it to APIS.
"""
from __future__ import annotations

from collections.abc import Mapping

from gateway.apis import cerebras, chat, groq, messages, responses, vllm
from gateway.apis.base import Api, Handler, Provider

APIS: tuple[Api, ...] = (chat.API, responses.API, messages.API)

# backend `type` (or its `provider`, where that names a flavour) -> Provider
PROVIDERS: Mapping[str, Provider] = {
    "openai": chat.PROVIDER,
    "anthropic": messages.PROVIDER,
    "groq": groq.PROVIDER,
    "cerebras": cerebras.PROVIDER,
    "vllm": vllm.PROVIDER,
}


# The chat family's usage chunks carry whichever provider's timings (chat.TIMINGS).
chat.TIMINGS[:] = [p.timing for p in PROVIDERS.values() if p.timing is not None]
chat.TIMING_KEYS = frozenset(k for p in PROVIDERS.values() if p.timing is not None
                             for k in p.timing_keys)


def _routes() -> dict[str, tuple[Api, str, str]]:
    """client route -> (adapter, upstream path suffix, operation), mirrored routes included."""
    table = {route: (api, suffix, op) for api in APIS for route, (suffix, op) in api.routes.items()}
    for provider in PROVIDERS.values():
        for alias, route in provider.mirrored_routes.items():
            table[alias] = table[route]
    return table


ROUTES: Mapping[str, tuple[Api, str, str]] = _routes()

# path -> (method, handler): requests the gateway answers itself, never sent upstream
LOCAL_ROUTES: Mapping[str, tuple[str, Handler]] = {
    path: handler for p in PROVIDERS.values() for path, handler in p.local_routes.items()}


def provider_for(backend_type: str, provider: str = "") -> Provider:
    """The flavour of a backend: its `provider` when that names one (type "openai" with
    provider "vllm" is vLLM), else its `type`."""
    return PROVIDERS.get(provider) or PROVIDERS[backend_type]
