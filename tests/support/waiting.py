"""Waiting for a condition instead of sleeping and hoping it holds."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(predicate: Callable[[], T | Awaitable[T]], timeout: float = 5.0,
                     interval: float = 0.005, what: str | Callable[[], str] = "condition") -> T:
    """Poll `predicate` (a function or a coroutine function) every `interval` seconds until it
    returns something true, and return that; fail the test with AssertionError if it has not
    within `timeout` seconds. The predicate is always tried at least once, and once more at the
    deadline, so a slow machine fails only on a real timeout. `what` names the condition in the
    failure message (a function is called then, to show the state at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            name = what() if callable(what) else what
            raise AssertionError(f"{name} not reached within {timeout} s (last value: {value!r})")
        await asyncio.sleep(interval)
