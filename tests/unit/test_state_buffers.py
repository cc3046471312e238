"""The buffers saves copy states into: reused, smallest fit first, kept up to a budget,
and a spare made ahead where none would be left."""

from __future__ import annotations

import threading
import time

from model_runtime.state.buffers import StateBuffers


def test_a_given_back_buffer_is_taken_again_for_a_state_that_fits() -> None:
    pool = StateBuffers(max_kept_bytes=1 << 20, spares=False)
    first = pool.take(1000)
    assert len(first) >= 1000
    pool.give_back(first)
    again = pool.take(900)
    assert again is first
    assert pool.kept_bytes() == 0


def test_a_state_larger_than_every_kept_buffer_gets_a_new_one_with_room_to_grow() -> None:
    pool = StateBuffers(max_kept_bytes=1 << 20, spares=False)
    small = pool.take(100)
    pool.give_back(small)
    big = pool.take(8000)
    assert big is not small and len(big) >= 8000 + 8000 // 8
    assert pool.kept_bytes() == len(small)  # the small one is still there for later


def test_the_smallest_buffer_that_fits_is_taken() -> None:
    pool = StateBuffers(max_kept_bytes=1 << 20, spares=False)
    buffers = [pool.take(n) for n in (4000, 1000, 2000)]
    for b in buffers:
        pool.give_back(b)
    assert pool.take(1500) is buffers[2]


def test_buffers_beyond_the_budget_are_freed_the_largest_kept() -> None:
    pool = StateBuffers(max_kept_bytes=10_000, spares=False)
    big, small = pool.take(7000), pool.take(3000)
    pool.give_back(small)
    pool.give_back(big)
    assert pool.kept_bytes() == len(big)  # 7,875 + 3,375 > 10,000: the small one goes
    assert pool.take(3000) is big


def test_take_and_give_back_from_two_threads_lose_nothing() -> None:
    pool = StateBuffers(max_kept_bytes=1 << 30, spares=False)

    def churn() -> None:
        for _ in range(500):
            pool.give_back(pool.take(64))

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= len(pool._free) <= 2


def test_a_take_that_leaves_no_buffer_of_its_size_has_a_spare_made_ahead() -> None:
    """Made on the pool's own thread, its pages touched there: the next save of that size
    (a second request ending before the first one's save is sent) copies into it rather
    than into fresh memory on the model thread."""
    pool = StateBuffers(max_kept_bytes=1 << 30)

    def spare_made(least: int) -> None:
        deadline = time.monotonic() + 10
        while pool.kept_bytes() < least:
            assert time.monotonic() < deadline, "no spare made"
            time.sleep(0.01)

    try:
        first = pool.take(1 << 20)
        spare_made(1 << 20)
        spare = pool.take(1 << 20)
        assert spare is not first and len(spare) >= 1 << 20 and not spare.any()
        spare_made(1 << 20)  # none was left again: another
        pool.give_back(first)
        pool.give_back(spare)
        kept = pool.kept_bytes()
        taken = pool.take(1000)  # two are left that fit: none wanted
        time.sleep(0.1)
        assert pool.kept_bytes() == kept - len(taken)
    finally:
        pool.close()
    assert pool._spares is not None and not pool._spares.is_alive()
