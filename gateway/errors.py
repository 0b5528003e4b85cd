"""Errors the gateway itself answers (not passed through from upstream)."""
from __future__ import annotations


class GatewayError(Exception):
    """Answered to the client as an HTTP error in the client's API format."""

    def __init__(self, status: int, message: str, code: str, *, param: str | None = None,
                 outcome: str = "rejected", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.outcome = outcome
        self.headers = headers or {}
