"""Marks, for the whole suite: a test that starts a server or needs the SmolLM2 model file is
`slow` by what it uses, so `pytest -m "not slow"` is the fast inner loop without anyone having
to remember the mark. Tests that are slow for other reasons carry `@pytest.mark.slow` themselves.
"""

from __future__ import annotations

import pytest

# Fixtures that start a server process or load the SmolLM2 model (fetched once, then cached).
SLOW_FIXTURES = frozenset({"mock_server", "smollm2_path", "smollm2_tokenizer", "smollm2_model"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
