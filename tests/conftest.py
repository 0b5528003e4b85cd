import logging
import random

import pytest

pytest_plugins: list[str] = []
logging.getLogger("slogate.access").setLevel(logging.INFO)


@pytest.fixture(autouse=True)
def _seeded_random() -> None:
    """Every test starts from the same state of the `random` module, so the draws made in this
    process (admission's tie-breaks, retry backoff jitter, a test's own choices) repeat from run
    to run. Tests that need their own stream use random.Random(seed)."""
    random.seed(1234)
