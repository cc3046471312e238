"""The gateway tests' one fixture factory, ``gateways`` (:class:`Gateways` in
tests/support/gateway_proc.py): real ``model-runtime gateway`` processes (their workers
real ``model-runtime serve`` processes on the tiny generated models), each with its own
cache daemon unless told otherwise, in a folder of its own.

A module's gateways start when its tests first ask for them and are stopped after its last
test: with SIGTERM, and (``clean_stop``, the default) the gateway must exit 0 and leave no
worker behind; whatever happens, no process of theirs outlives the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gateway_proc import Gateways


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    """The module's gateway factory (:class:`Gateways`)."""
    factory = Gateways(tmp_path_factory)
    try:
        yield factory
    finally:
        factory.close()
