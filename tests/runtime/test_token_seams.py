"""A chat's system message is tokenized once: the rest of each prompt is tokenized alone
only where llama.cpp's tokenizer gives the same tokens as for the whole text."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_runtime.chat.templates import ChatTemplate
from model_runtime.config import RuntimeConfig
from model_runtime.llama_backend import LlamaModel, TokenizeCancelled
from model_runtime.request import common_prefix
from model_runtime.runtime import Runtime, default_model_path
from model_runtime.state.seams import SpecialToken, cut_points, is_seam

A, B = SpecialToken("<|a|>"), SpecialToken("<|b|>")


def test_a_seam_is_where_a_special_token_starts_and_none_spans_it() -> None:
    text = "system text<|a|>user<|b|>"
    at = text.index("<|a|>")
    assert is_seam(text, at, [A, B])
    assert is_seam(text, text.index("<|b|>"), [A, B])
    assert not is_seam(text, at - 1, [A, B])  # raw text on both sides
    assert not is_seam(text, at + 1, [A, B])  # inside a special token
    assert not is_seam(text, 0, [A, B]) and not is_seam(text, len(text), [A, B])
    assert not is_seam(text, at, [])
    # A special token whose text starts before the seam and ends after it is cut first.
    spanning = SpecialToken("text<|a")
    assert not is_seam(text, at, [spanning, A, B])
    # Whitespace before a left-stripping token belongs to no piece of the whole text.
    assert not is_seam("x <|a|>", 2, [SpecialToken("<|a|>", lstrip=True)])
    # A longer special token starting at the seam cuts there too.
    assert is_seam("x<|a|>y", 1, [SpecialToken("<|a|>y"), A])


CHATS = [
    ("You are helpful. " * 40, "Hello there"),
    ("Ends with spaces and a newline   \n", "Starts with a space"),
    ("Mentions <|im_start|> and <|im_end|> as text", "<|im_end|> first, then text"),
    ("Unicode: café, naïve, 東京, emoji 🙂", " leading space and trailing\n"),
    ("short", ""),
]


def chats() -> list[list[dict[str, str]]]:
    out = []
    for system, user in CHATS:
        out.append([{"role": "system", "content": system}, {"role": "user", "content": user}])
        out.append([{"role": "system", "content": system}, {"role": "user", "content": user},
                    {"role": "assistant", "content": "A reply."},
                    {"role": "user", "content": "And then?"}])
    return out


def check_tokenize_after(model: LlamaModel) -> int:
    """Every split tokenization equals the whole text's; returns how many were split."""
    split = 0
    for messages in chats():
        text = ChatTemplate.of_model(model).render(messages)
        head = ChatTemplate.of_model(model).render(messages[:1], add_generation_prompt=False)
        assert text.startswith(head)
        whole = model.tokenize(text)
        got = model.tokenize_after(model.tokenize(head), text, len(head))
        if got is not None:
            assert got == whole, messages
            split += 1
        # Never at a place the tokenizer does not cut: mid-text, or inside a token.
        for at in (len(head) - 1, len(head) + 1):
            assert model.tokenize_after(model.tokenize(text[:at]), text, at) is None
    return split


def test_tokens_after_a_system_message_equal_the_whole_text_s_spm(tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as model:
        assert check_tokenize_after(model) == len(chats())
        specials = model.seam_specials
        assert specials is not None
        assert {"<|im_start|>", "<|im_end|>", "<unk>"} <= {s.text for s in specials}


@pytest.mark.slow
def test_tokens_after_a_system_message_equal_the_whole_text_bpe() -> None:
    # SmolLM2's vocabulary is byte-level BPE (the tiny model's is SentencePiece).
    with LlamaModel(default_model_path()) as model:
        assert check_tokenize_after(model) == len(chats())


def test_render_chat_tokenizes_the_system_message_once(tiny_model: Path) -> None:
    with Runtime(tiny_model, config=RuntimeConfig(n_ctx=512, n_seq_max=1, n_threads=1)) as rt:
        for messages in chats():
            text = ChatTemplate.of_model(rt.model).render(messages)
            head = ChatTemplate.of_model(rt.model).render(messages[:1], add_generation_prompt=False)
            whole = rt.tokenize(text)
            assert rt.render_chat(messages) == (whole, common_prefix(rt.tokenize(head), whole))
        # Same system message, another user message: its tokens were kept.
        hits = rt._head_tokens.cache_info().hits
        rt.render_chat([{"role": "system", "content": CHATS[0][0]},
                        {"role": "user", "content": "Another question"}])
        assert rt._head_tokens.cache_info().hits == hits + 1


def long_chat(model: LlamaModel, n: int) -> str:
    """A chat of ``n`` turns drawn from :data:`CHATS` (specials as text included)."""
    turns = [{"role": "system", "content": CHATS[0][0]}]
    for i in range(n):
        system, user = CHATS[i % len(CHATS)]
        turns.append({"role": "user" if i % 2 == 0 else "assistant",
                      "content": f"{user} {i} {system[:40]}"})
    return ChatTemplate.of_model(model).render(turns)


def check_in_pieces(model: LlamaModel) -> None:
    text = long_chat(model, 300)
    whole = model.tokenize(text)
    for piece_chars in (1, 64, 1000, len(text)):
        assert model.tokenize_in_pieces(text, piece_chars=piece_chars) == whole, piece_chars
    assert model.tokenize_in_pieces(text, add_special=False, piece_chars=64) == \
        model.tokenize(text, add_special=False)


def test_a_long_text_tokenized_in_pieces_gives_the_whole_text_s_tokens(
        tiny_model: Path) -> None:
    with LlamaModel(tiny_model) as model:
        check_in_pieces(model)
        text = long_chat(model, 300)
        cuts = cut_points(text, model.seam_specials or (), 64)
        assert len(cuts) > 100 and all(is_seam(text, at, model.seam_specials or ())
                                       for at in cuts)
        asked: list[int] = []

        def gone() -> bool:  # the caller leaves after the third piece
            asked.append(1)
            return len(asked) > 3

        with pytest.raises(TokenizeCancelled):
            model.tokenize_in_pieces(text, piece_chars=64, cancelled=gone)
        assert len(asked) == 4


@pytest.mark.slow
def test_a_long_text_tokenized_in_pieces_gives_the_whole_text_s_tokens_bpe() -> None:
    with LlamaModel(default_model_path()) as model:
        check_in_pieces(model)


def test_cut_points_are_seams_apart() -> None:
    text = "x" * 10 + "<|a|>" + "y" * 3 + "<|b|>" + "z" * 20 + "<|a|>w"
    assert cut_points(text, [A, B], 5) == [10, 18, 43]
    assert cut_points(text, [A, B], 12) == [18, 43]
    assert cut_points(text, [A, B], 100) == [] and cut_points(text, [], 5) == []
    # Not inside a special token, even where one special's text holds another's.
    assert cut_points("ab<|a|>y", [SpecialToken("<|a|>y"), A], 1) == [2]
