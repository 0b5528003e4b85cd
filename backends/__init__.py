"""Backend families.

Two registries, so the gateway core knows nothing provider-specific:
- client APIs by route: the module that knows a route's wire format (what a token is, where
  usage and errors are, how to write an error in that format);
- backend types: how to reach a provider (auth headers, which API families it speaks).

Adding a provider is adding a module here and registering it below.
"""
from __future__ import annotations

from types import ModuleType

from backends import openai

# route -> client API module (the module's ROUTES maps each route to its upstream path suffix)
APIS: dict[str, ModuleType] = {route: openai for route in openai.ROUTES}

# backend type -> module with `auth_headers(key)` and `FAMILY` (the API family it speaks)
BACKEND_TYPES: dict[str, ModuleType] = {"openai": openai}


def api_for(route: str) -> ModuleType:
    return APIS[route]


def backend_type(name: str) -> ModuleType:
    return BACKEND_TYPES[name]
