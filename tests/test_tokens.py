"""Token counting: offline tokenizers, the chat overhead, the per-message cache, calibration."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from kvgate.tokens import (
    OFF_LOOP_CHARS,
    Calibration,
    ChatOverhead,
    PromptCounter,
    TokenizerError,
    load_tiktoken,
    load_tokenizer,
)


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


async def test_chat_count_adds_the_template_overhead_per_message(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer, ChatOverhead(per_message=4, per_name=1, reply_primer=3))
    messages = [{"role": "system", "content": "hello world"},
                {"role": "user", "content": "hello world", "name": "bob"}]
    count = await counter.count_chat(messages)
    # 2 tokens per content, 4 per message, 1 + len("bob") for the name, 3 for the reply primer
    assert count.tokens == 2 + 2 + 4 * 2 + 1 + 1 + 3
    assert count.prefix_tokens == 2 + 4 and count.prefix_key is not None


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

    counter = PromptCounter(Recording())
    await counter.count_prompt("x" * 100)
    await counter.count_prompt("x" * (OFF_LOOP_CHARS + 1))
    assert seen == [True, False]


async def test_completions_prompts_of_token_ids_are_counted_exactly(tiktoken_tokenizer):
    counter = PromptCounter(tiktoken_tokenizer)
    assert await counter.count_prompt([1, 2, 3, 4]) == 4
    assert await counter.count_prompt(["hello world", "hello"]) == 3


def test_calibration_moves_towards_observed_ratios_within_bounds():
    calibration = Calibration(low=0.8, high=1.5, weight=0.5)
    assert calibration.apply("m", 100) == 100
    calibration.observe("m", 100, 120)
    assert calibration.ratio("m") == pytest.approx(1.2)
    calibration.observe("m", 100, 1000)  # one odd response cannot run away
    assert calibration.ratio("m") == 1.5
    assert calibration.apply("m", 100) == 150
    for _ in range(50):
        calibration.observe("m", 100, 10)
    assert calibration.ratio("m") == 0.8


def test_the_bundled_file_is_the_published_cl100k_base():
    from kvgate.tokens import KNOWN_TIKTOKEN_HASHES, _bundled_bpe_file

    path = _bundled_bpe_file("cl100k_base")
    assert path is not None
    assert hashlib.sha256(path.read_bytes()).hexdigest() == KNOWN_TIKTOKEN_HASHES["cl100k_base"]
