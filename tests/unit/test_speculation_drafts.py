"""Where drafts come from and how many are verified: prompt lookup, predictions, the
acceptance statistics and the choice of draft lengths (pure: no model)."""

from __future__ import annotations

import pytest

from model_runtime.drafts import MODEL, NGRAM, PREDICTION, Draft, Lookup, NgramTable
from model_runtime.speculation import (
    AcceptanceTable,
    Speculation,
    StepCost,
    draft_lengths,
    measure_step_cost,
)
from model_runtime.speculator import Candidate, Speculator

CODE = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def test_prompt_lookup_drafts_what_followed_the_history_end_before() -> None:
    lookup = Lookup.of_prompt([1, 2, *CODE, 3, 4])
    lookup.extend([10, 11, 12])  # the output starts copying CODE
    draft = lookup.draft(4)
    assert draft == Draft((13, 14, 15, 16), 3, NGRAM)


def test_a_lookup_never_finds_the_history_end_itself() -> None:
    lookup = Lookup.of_prompt([5, 6, 7])
    lookup.extend([5, 6])
    # (5, 6) ends the history; its earlier place is the prompt's start: 7 followed it.
    assert lookup.draft(3).tokens == (7, 5, 6)
    fresh = Lookup.of_prompt([8, 9])
    fresh.extend([1, 2])
    assert fresh.draft(3).tokens == ()


def test_the_place_agreeing_longest_with_the_history_wins() -> None:
    # (2, 3) occurs twice: after 1 (then 4) and after 9 (then 5). The history ends 9, 2, 3.
    lookup = Lookup.of_prompt([1, 2, 3, 4, 0, 9, 2, 3, 5, 0, 1, 2, 3, 4])
    lookup.extend([7, 9, 2, 3])
    assert lookup.draft(1) == Draft((5,), 3, NGRAM)


def test_the_output_is_indexed_as_it_grows_and_drafts_never_run_past_its_end() -> None:
    lookup = Lookup.of_prompt([100])
    lookup.extend([1, 2, 3, 4, 1, 2])
    assert lookup.draft(10).tokens == (3, 4, 1, 2)  # (up to the history's end)


def test_a_prediction_is_drafted_while_the_output_follows_it_then_rejoined() -> None:
    prediction = [20, 21, 22, 23, 24, 25, 26, 27]
    lookup = Lookup.of_prompt([1, 2, 3], prediction=prediction)
    lookup.extend([20])
    assert lookup.draft(3) == Draft((21, 22, 23), 1, PREDICTION)
    lookup.extend([21, 99, 98])  # an edit: the output leaves the prediction
    assert lookup.draft(3).tokens == ()
    lookup.extend([24, 25])  # and rejoins it
    assert lookup.draft(3) == Draft((26, 27), 2, PREDICTION)


def test_without_ngrams_only_the_prediction_drafts() -> None:
    lookup = Lookup.of_prompt([*CODE], prediction=[50, 51], ngrams=False)
    lookup.extend([10, 11, 12])
    assert lookup.draft(4).tokens == ()


def test_the_choices_of_a_request_share_the_prompt_table_not_their_outputs() -> None:
    first = Lookup.of_prompt([*CODE])
    second = first.fork()
    assert second.prompt_table is first.prompt_table
    first.extend([40, 41, 42, 40, 41])
    second.extend([40, 41])
    assert first.draft(2).tokens == (42, 40)
    assert second.draft(2).tokens == ()


def test_an_ngram_table_keeps_the_latest_places_of_a_common_ngram() -> None:
    table = NgramTable([1, 2] * 20)
    assert len(table.places[(1, 2)]) == 4 and table.places[(1, 2)][-1] == 38


def test_acceptance_is_learned_by_source_and_support() -> None:
    table = AcceptanceTable()
    before = table.chance(NGRAM, 2)
    for _ in range(50):
        table.record(Draft((1, 2, 3), 2, NGRAM), 3, 0)
    assert table.chance(NGRAM, 2) < before / 4
    assert table.chance(NGRAM, 3) == AcceptanceTable().chance(NGRAM, 3)  # never reached
    assert table.chance(PREDICTION, 2) == AcceptanceTable().chance(PREDICTION, 2)
    chances = table.chances(Draft((1, 2, 3), 40, MODEL))
    assert chances == sorted(chances, reverse=True)


def test_one_request_drafts_while_a_token_beats_the_tokens_per_ms_planned() -> None:
    cost = StepCost(fixed_ms=7.0, per_token_ms=3.0)  # a token adds 3 ms to a 10 ms step
    # 1 token in 10 ms; with the first draft 1.9 in 13; the second (0.6 in 3 ms) beats
    # that rate, the third (0.35 in 3 ms against 2.5 in 16) does not.
    assert draft_lengths([[0.9, 0.6, 0.35, 0.25]], 1, cost) == [2]
    assert draft_lengths([[0.29]], 1, cost) == [0]  # below 3 / 10
    # Its drafts cost a draft model's step too: fewer pay.
    assert draft_lengths([[0.9, 0.6, 0.35]], 1, cost, [3.0]) == [1]


def test_with_many_requests_decoding_only_surer_drafts_pay() -> None:
    cost = StepCost(fixed_ms=7.0, per_token_ms=3.0)
    chances = [[0.95, 0.9, 0.85, 0.5], [0.6, 0.3], [], [0.2]]
    assert draft_lengths(chances, 1, cost) == [3, 1, 0, 0]
    assert draft_lengths(chances, 4, cost) == [3, 0, 0, 0]


def test_a_step_cost_is_measured_from_the_fastest_decodes() -> None:
    calls: list[tuple[str, int]] = []
    now = [0.0]
    slow = iter([0.05, 0.0, 0.0, 0.0, 0.0])  # the machine was busy at the first decode

    def decode(n: int, at: int) -> None:
        calls.append(("decode", n))
        if at:  # a measured decode: 10 ms for one token, 26 ms for nine
            now[0] += {1: 0.010, 9: 0.026}[n] + (next(slow) if n == 1 else 0.0)

    cost = measure_step_cost(decode, lambda keep: calls.append(("truncate", keep)),
                             rounds=5, width=9, prefix=32, clock=lambda: now[0])
    assert calls[0] == ("decode", 32) and calls[-1] == ("truncate", 0)
    assert cost.per_token_ms == pytest.approx(2.0) and cost.fixed_ms == pytest.approx(8.0)


def test_a_request_speculates_as_asked_and_the_runtime_allows() -> None:
    cost = StepCost(7.0, 3.0)
    off, ngram = Speculator("off", 16, cost), Speculator("ngram", 16, cost)
    assert off.for_request([1, 2], None) is None
    assert off.for_request([1, 2], True) is not None  # asked for: prompt lookup
    on_off = off.for_request([1, 2], None, prediction=[3])
    assert on_off is not None and on_off.lookup is not None and not on_off.lookup.ngrams
    assert ngram.for_request([1, 2], False, prediction=[3]) is None
    recurrent = Speculator("ngram", 16, cost, possible=False)
    assert recurrent.for_request([1, 2], True, prediction=[3]) is None


def test_a_speculator_drafts_within_each_requests_limit_and_records_what_was_taken() -> None:
    counted: dict[str, int] = {}
    spec = Speculator("ngram", 16, StepCost(7.0, 0.5),
                      count=lambda name, n: counted.__setitem__(name, counted.get(name, 0) + n))
    mine = spec.for_request([*CODE, *CODE[:5]], None)
    assert isinstance(mine, Speculation)
    mine.emitted(CODE[5])
    [draft] = spec.drafts([Candidate(mine, 0, "", list, limit=3)], n_rows=1)
    assert draft.tokens == tuple(CODE[6:9])
    spec.verifying(mine, draft)
    mine.took(draft)
    mine.took(draft)
    spec.learn(draft, 2)
    assert (mine.drafted, mine.accepted) == (3, 2)
    assert counted == {"draft_tokens": 3, "draft_tokens_accepted": 2}
    [none] = spec.drafts([Candidate(mine, 0, "", list, limit=0)], n_rows=1)
    assert none.tokens == ()
