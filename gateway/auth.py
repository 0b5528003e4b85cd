"""Gateway keys: who may use the gateway. The client's key is compared by its sha256 with the
configured hashes (the config never holds a key), the matching tenant is recorded, and the key
itself goes nowhere: not upstream (unless a backend says forward_client_auth), not in logs,
spans, errors or metrics."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

from gateway.config import AuthConfig, GatewayKey
from gateway.errors import GatewayError

__all__ = ["AuthPolicy", "GatewayKey", "client_key", "hash_key"]


class AuthPolicy:
    """Who may use the gateway, built from [auth] at start-up."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.mode = cfg.mode
        self.keys = cfg.keys

    def authenticate(self, headers: Mapping[str, str]) -> GatewayKey | None:
        """The caller's key, or None in open mode; GatewayError 401 when missing or wrong."""
        if self.mode == "open":
            return None
        presented = client_key(headers)
        if not presented:
            raise GatewayError(401, "Missing gateway key: send 'Authorization: Bearer <key>' or "
                               "'x-api-key: <key>'.", "missing_api_key", outcome="rejected")
        if not valid_key_text(presented):
            # A key that is not printable ASCII cannot be one of ours (keys are generated as
            # ASCII tokens): 401, never a traceback that would print it.
            raise GatewayError(401, "Invalid gateway key.", "invalid_api_key", outcome="rejected")
        key = self.keys.get(hash_key(presented))
        if key is None:
            raise GatewayError(401, "Invalid gateway key.", "invalid_api_key", outcome="rejected")
        return key

    @staticmethod
    def allows(key: GatewayKey | None, model: str) -> bool:
        return key is None or "*" in key.models or model in key.models

    def authorize(self, key: GatewayKey | None, model: str) -> None:
        if not self.allows(key, model):
            raise GatewayError(403, f"This key may not use the model '{model}'.",
                               "model_not_allowed", param="model", outcome="rejected")


def valid_key_text(key: str) -> bool:
    """Printable ASCII only (aiohttp decodes header bytes >= 0x80 as surrogates/latin-1)."""
    return key.isascii() and key.isprintable() and len(key) <= 4096


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def client_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None
