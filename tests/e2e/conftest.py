"""Every test in this folder loads the real SmolLM2 model: all are ``slow``, so that
``pytest -m "not slow"`` leaves them out whatever their own marks say."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session's items, not only this folder's.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
