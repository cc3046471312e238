"""Fixtures the runtime tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from model_runtime.runtime import Runtime
from tests.support.warm_cold import CONFIG


@pytest.fixture
def runtimes(request: pytest.FixtureRequest) -> Iterator[Callable[..., Runtime]]:
    """Make runtimes of the warm-equals-cold tests' CONFIG (``overrides`` replace its
    fields; the tenant is the test's name unless given), all closed after the test."""
    made: list[Runtime] = []

    def make(model: Path, address: str | None, **overrides: object) -> Runtime:
        overrides.setdefault("tenant", request.node.name)
        rt = Runtime(model, cache_address=address,
                     config=replace(CONFIG, **overrides))  # type: ignore[arg-type]
        made.append(rt)
        return rt

    yield make
    for rt in reversed(made):
        rt.close()
