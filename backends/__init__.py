"""Backend families.

Registries, so the gateway core knows nothing provider-specific:
- client APIs by route: the module that knows a route's wire format (what a token is, where
  usage and errors are, how to write an error in that format);
- backend types: how to reach a provider (auth headers, which API family it speaks);
- local routes: requests the gateway answers itself, never sent upstream.

Adding a provider is adding a module here and registering it below.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from backends import anthropic, cerebras, groq, openai, openai_responses

# route -> client API module (the module's ROUTES maps each route to its upstream path suffix)
APIS: dict[str, ModuleType] = {}
for _api in (openai, openai_responses, anthropic):
    APIS.update(dict.fromkeys(_api.ROUTES, _api))


def _mirror(routes: dict[str, str]) -> None:
    """Serve each alias exactly like the route it mirrors: same API module, upstream path and
    operation (e.g. Groq's /openai/v1/chat/completions is /v1/chat/completions)."""
    for alias, route in routes.items():
        api = APIS[route]
        api.ROUTES[alias] = api.ROUTES[route]
        api.OPERATIONS[alias] = api.OPERATIONS[route]
        APIS[alias] = api


_mirror(groq.CLIENT_ROUTES)

# backend type -> module with `auth_headers(key)` and `FAMILY` (the API family it speaks);
# optional: DEFAULT_HEADERS (sent upstream unless the client sent them),
# USAGE_IN_EVERY_STREAM (streams carry usage unasked).
BACKEND_TYPES: dict[str, ModuleType] = {
    "openai": openai,
    "anthropic": anthropic,
    "groq": groq,
    "cerebras": cerebras,
}

Handler = Callable[[Any], Awaitable[Any]]
# path -> (HTTP method, aiohttp handler)
LOCAL_ROUTES: dict[str, tuple[str, Handler]] = {**cerebras.LOCAL_ROUTES}


def api_for(route: str) -> ModuleType:
    return APIS[route]


def backend_type(name: str) -> ModuleType:
    return BACKEND_TYPES[name]
