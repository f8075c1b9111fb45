"""Prompt tokenization (ChatML-like template over tiktoken) and the filler output."""

from __future__ import annotations

import pytest

from kvgate.sim.text import FILLER, PromptEncoder, PromptError, filler_text
from kvgate.tokens import TiktokenTokenizer


@pytest.fixture
def encoder(sim_tokenizer: TiktokenTokenizer) -> PromptEncoder:
    return PromptEncoder(sim_tokenizer)


def test_chat_prompt_is_the_template_rendered_and_encoded(
    encoder: PromptEncoder, sim_tokenizer: TiktokenTokenizer
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = (
        sim_tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n")
        + sim_tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n")
        + sim_tokenizer.encode("<|im_start|>assistant\n")
    )
    assert encoder.encode_chat(messages) == expected
    assert encoder.decode(expected).endswith("<|im_start|>assistant\n")


def test_a_trailing_space_changes_the_token_ids(encoder: PromptEncoder) -> None:
    plain = encoder.encode_chat([{"role": "system", "content": "You are helpful."}])
    spaced = encoder.encode_chat([{"role": "system", "content": "You are helpful. "}])
    assert plain != spaced


def test_content_parts_are_joined_as_text(encoder: PromptEncoder) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert encoder.encode_chat([{"role": "user", "content": parts}]) == encoder.encode_chat(
        [{"role": "user", "content": "a\nb"}]
    )


def test_completion_prompts_accept_text_or_token_ids(encoder: PromptEncoder) -> None:
    assert encoder.encode_prompt("hello") == encoder.encode_text("hello")
    assert encoder.encode_prompt([1, 2, 3]) == [1, 2, 3]
    assert encoder.encode_prompt(["hello"]) == encoder.encode_text("hello")
    for bad in ("", [], ["a", "b"], None, [1, "x"]):
        with pytest.raises(PromptError):
            encoder.encode_prompt(bad)


def test_malformed_messages_are_prompt_errors(encoder: PromptEncoder) -> None:
    for bad in (None, [], "hi", [{"content": "no role"}], ["text"]):
        with pytest.raises(PromptError):
            encoder.encode_chat(bad)


def test_filler_words_are_one_token_each(sim_tokenizer: TiktokenTokenizer) -> None:
    for word, token_id in FILLER:
        assert sim_tokenizer.encode(word) == [token_id]
    assert filler_text(0, 3) == " the model served"
    assert filler_text(len(FILLER), 1) == " the"
