"""Fixtures of the router tests: the real Dynamo indexer, started per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.routers import DynamoIndexer

from tests.support.kv_events import BLOCK


@pytest.fixture
def indexer_factory(tmp_path: Path) -> Iterator[Callable[..., DynamoIndexer]]:
    """Start Dynamo indexers (block size BLOCK) on workers' event endpoints."""
    started: list[DynamoIndexer] = []

    def start(workers: dict[int, list[str]] | None = None) -> DynamoIndexer:
        ix = DynamoIndexer(tmp_path / f"indexer-{len(started)}.log", BLOCK, workers)
        started.append(ix)
        return ix.start()

    yield start
    for ix in started:
        ix.close()
