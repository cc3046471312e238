"""The gateway's account of a streamed token's way (pure parts)."""

from __future__ import annotations

from model_runtime.gateway.pipeline.timeline import TokenPath


def test_a_token_path_counts_stamped_tokens_and_ignores_foreign_clocks() -> None:
    path = TokenPath()
    assert path.summary() is None
    path.passed(1_000_000, 1_500_000)
    path.passed(2_000_000, 4_000_000)
    assert path.ms == [0.5, 2.0]  # ms
    path.passed(0, 5_000_000)  # no stamp (an older runtime)
    path.passed(9_000_000, 8_000_000)  # after its write: another clock
    path.passed(1, 120 * 10**9)  # minutes back: another host's clock
    assert path.ms == [0.5, 2.0]
    assert path.summary() == {"p50": 1.25, "p99": 2.0, "max": 2.0, "messages": 2}
