from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcache.store import Store
from tests.support.stores import store_factory


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """``make_store(**StoreConfig overrides)``: see tests/support/stores.py."""
    yield from store_factory(tmp_path)
