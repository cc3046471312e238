"""How long the model thread holds the next batch for a new request's cache answer."""

from __future__ import annotations

import pytest

from model_runtime.model_thread import HOLD_MAX_WAITS, answer_hold


def test_short_batches_hold_for_resolve_wait_ms() -> None:
    assert answer_hold(4, 0.0) == pytest.approx(0.004)
    assert answer_hold(4, 0.012) == pytest.approx(0.004)  # a quarter is less


def test_long_batches_hold_for_a_quarter_of_the_last_one_up_to_a_cap() -> None:
    assert answer_hold(4, 0.040) == pytest.approx(0.010)
    assert answer_hold(4, 0.800) == pytest.approx(HOLD_MAX_WAITS * 0.004)


def test_no_wait_holds_nothing_whatever_the_batch() -> None:
    assert answer_hold(0, 0.5) == 0.0
