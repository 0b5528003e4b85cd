"""slogate: a streaming gateway for LLM inference."""
from __future__ import annotations


def version() -> str:
    """The installed package's version (the source tree's pyproject when not installed)."""
    from importlib.metadata import PackageNotFoundError, version as _version

    try:
        return _version("slogate")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"
