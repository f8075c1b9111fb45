"""Token counting: offline tokenizers, what the counter reports, the per-message cache."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from kvgate.request.calibration import Features
from kvgate.request.tokenizers import TokenizerError, load_tiktoken, load_tokenizer
from kvgate.request.tokens import OFF_LOOP_CHARS, PromptCounter


@pytest.fixture(scope="module")
def tiktoken_tokenizer():
    return load_tiktoken()


def test_cl100k_loads_offline_from_the_bundled_file_and_matches_known_ids(tiktoken_tokenizer):
    assert tiktoken_tokenizer.encode("hello world") == [15339, 1917]


def test_a_configured_bpe_file_with_the_wrong_hash_is_refused(tmp_path: Path):
    bad = tmp_path / "cl100k_base.tiktoken"
    bad.write_text("aGVsbG8= 0\n")
    with pytest.raises(TokenizerError, match="sha256"):
        load_tiktoken("cl100k_base", bad)


def test_an_encoding_without_an_offline_file_fails_clearly():
    with pytest.raises(TokenizerError, match="no bundled offline file"):
        load_tiktoken("o200k_base")


def test_a_huggingface_tokenizer_json_is_loaded_from_a_file(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tokenizer = load_tokenizer("huggingface", file=path)
    assert tokenizer.encode("hello world hello") == [1, 2, 1]
    with pytest.raises(TokenizerError):
        load_tokenizer("huggingface", file=tmp_path / "missing.json")


async def test_a_chat_is_counted_as_text_tokens_messages_and_one_request(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer, name_tokens=1)
    messages = [{"role": "system", "content": "hello world"},
                {"role": "user", "content": "hello world", "name": "bob"}]
    count = await counter.count_chat(messages)
    # 2 tokens per content, and 1 + len("bob") for the name
    assert count.features == Features(2 + 2 + 1 + 1, messages=2, prompts=1)
    assert count.prefix_text_tokens == 2 and count.prefix_key is not None
    assert not count.templated


async def test_tools_count_as_one_more_message_of_their_json(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    plain = await counter.count_chat([{"role": "user", "content": "hi"}])
    with_tools = await counter.count_chat([{"role": "user", "content": "hi"}], tools)
    assert with_tools.features.messages == plain.features.messages + 1
    assert with_tools.features.text_tokens > plain.features.text_tokens + 10


async def test_each_image_part_costs_the_configured_tokens(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer, media_part_tokens=500)
    content = [{"type": "text", "text": "hello world"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
               {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    count = await counter.count_chat([{"role": "user", "content": content}])
    assert count.features.text_tokens == 2 and count.media_tokens == 2 * 500


async def test_repeated_messages_are_counted_once(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer)
    system = {"role": "system", "content": "You are helpful. " * 50}
    await counter.count_chat([system, {"role": "user", "content": "a"}])
    await counter.count_chat([system, {"role": "user", "content": "b"}])
    assert counter.cache_hits == 1 and counter.cache_misses == 3


async def test_a_trailing_space_changes_the_shared_prefix_key(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer)
    a = await counter.count_chat([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "hi"}])
    b = await counter.count_chat([{"role": "system", "content": "Be brief. "},
                                  {"role": "user", "content": "hi"}])
    c = await counter.count_chat([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "other"}])
    assert a.prefix_key != b.prefix_key and a.prefix_key == c.prefix_key


async def test_large_prompts_are_counted_off_the_event_loop():
    seen: list[bool] = []

    class Recording:
        name = "recording"

        def encode(self, text: str) -> list[int]:
            seen.append(threading.current_thread() is threading.main_thread())
            return [0] * (len(text) // 4)

        encode_prompt = encode

    counter = PromptCounter(Recording())
    await counter.count_prompt("x" * 100)
    await counter.count_prompt("x" * (OFF_LOOP_CHARS + 1))
    assert seen == [True, True, False, False]  # its count and its token ids


async def test_completions_prompts_are_counted_per_prompt(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer)
    ids = await counter.count_prompt([1, 2, 3, 4])
    assert ids.features == Features(4, 0, 1) and ids.token_ids == (1, 2, 3, 4)
    several = await counter.count_prompt(["hello world", "hello"])
    assert several.features == Features(3, 0, 2) and several.longest == Features(2, 0, 1)
    assert several.token_ids is None  # several sequences: no one prompt to route by
    text = await counter.count_prompt("hello world")
    assert text.token_ids == tuple(tiktoken_tokenizer.encode("hello world"))
    batch = await counter.count_prompt([[1, 2, 3], [4], "hello world"])
    assert batch.features == Features(6, 0, 3) and batch.longest == Features(3, 0, 1)


def test_the_bundled_file_is_the_published_cl100k_base():
    from kvgate.request.tokenizers import KNOWN_TIKTOKEN_HASHES, _bundled_bpe_file

    path = _bundled_bpe_file("cl100k_base")
    assert path is not None
    assert hashlib.sha256(path.read_bytes()).hexdigest() == KNOWN_TIKTOKEN_HASHES["cl100k_base"]


async def test_without_kv_events_no_prompt_keeps_its_token_ids(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer, token_ids=False)
    assert (await counter.count_prompt("hello world")).token_ids is None
    assert (await counter.count_prompt([1, 2, 3])).token_ids is None
