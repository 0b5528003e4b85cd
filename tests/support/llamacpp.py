"""llama.cpp's server (backends/engines/llamacpp.py) as a pytest fixture. Tests fail, never
skip, when the engine is missing: `make test` installs it (scripts/install-llamacpp.sh)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest

from backends.engines.llamacpp import (  # noqa: F401 (re-exported)
    LlamaCppServer,
    llamacpp_server,
    llamacpp_server_sync,
    missing_reason,
)


def require_llamacpp() -> None:
    """Fail with the install hint if the engine is missing (a test that skips proves nothing)."""
    reason = missing_reason()
    if reason is not None:
        pytest.fail(reason, pytrace=False)


Scope = Literal["session", "package", "module", "class", "function"]


def llamacpp_fixture(scope: Scope = "module", name: str = "llamacpp", **kwargs: Any) -> Any:
    """A sync fixture yielding a running LlamaCppServer (any scope works with function-scoped
    event loops): ``llamacpp = llamacpp_fixture()`` at module level."""

    @pytest.fixture(scope=scope, name=name)
    def _fixture() -> Iterator[LlamaCppServer]:
        require_llamacpp()
        with llamacpp_server_sync(**kwargs) as srv:
            yield srv

    return _fixture
