"""A tiny Llama-shaped model directory, made offline and deterministically, for a real vLLM.

vLLM's CPU build serves it with `--load-format dummy` (random weights, nothing downloaded):
  config.json            2 layers, hidden size 256, 4 heads (2 KV heads), the tokenizer's vocabulary
  tokenizer.json         a byte-level BPE trained here with `tokenizers` on a seeded corpus
  tokenizer_config.json  its special tokens and a ChatML chat template that renders tools
  generation_config.json BOS and EOS, so vLLM stops on EOS as it would for a real model
  chat_template_string.jinja  the same turns as a "string" template (`--chat-template`)
  chat_template_string.jinja  the same turns as a "string" template (`--chat-template`)

With random weights the next token is close to uniform over the vocabulary, so an answer ends
on EOS after about `VOCAB_SIZE` tokens on average (a geometric length, unknown in advance, as
real answers are to a gateway). The same call makes the same bytes: `make_model` is what the
real-engine tests, `kvgate demo --vllm` and the fleet benchmark all serve.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny-llama"
VOCAB_SIZE = 384
SEED = 20261207
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_POSITION_EMBEDDINGS = 32768

# ChatML, as Qwen-style templates write it: the tools in a system block, tool calls as JSON
# inside <tool_call>, content given as a string or as typed parts. Newlines are written as
# '\n' expressions so that trim_blocks (which vLLM's renderer sets) cannot eat them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system{{ '\\n' }}# Tools{{ '\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}<|im_end|>{{ '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- if message.get('tool_calls') %}{%- for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}"
    "</tool_call>{%- endfor %}{%- endif %}<|im_end|>{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
)

# The same turns as a "string" template (vLLM hands it each message's text parts joined by
# newlines, where the ChatML one above loops over typed parts): what most models' templates
# are. Served with `--chat-template` by the engine that checks kvgate's count against it.
STRING_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}[{{ message['role'] | upper }}]"
    "{%- if message['content'] is string %} {{ message['content'] | trim }}{%- endif %}"
    "{%- if message.get('tool_calls') %}{%- for call in message['tool_calls'] %}"
    " CALL {{ call['function']['name'] }}({{ call['function']['arguments'] | tojson }})"
    "{%- endfor %}{%- endif %}{{ eos_token }}{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}[ASSISTANT]{%- endif %}"
)
STRING_TEMPLATE_FILE = "chat_template_string.jinja"

_WORD_TEXT = (
    "the of and to in is that for it as with was on be by at this are from or an have not "
    "they which one you were all we her she there would their will when who him been has more "
    "if no out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three cache "
    "block token prompt request replica gateway queue tenant model answer document summary "
    "chat stream budget admission prefix memory decode prefill schedule"
)
_WORDS = _WORD_TEXT.split()
_EXTRA = ["42", "2026-12-07", "3.14", "{", "}", "[", "]", "\":", "\",", "def", "return",
          "café", "naïve", "日本語", "Ünïcödé", "ü", "é", "—", "😀", "\n\n", "    "]


def corpus(seed: int = SEED, sentences: int = 4000) -> list[str]:
    """The seeded text the BPE is trained on: words, numbers, code-ish and non-ASCII pieces."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_EXTRA))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def tokenizer_json(vocab_size: int = VOCAB_SIZE, seed: int = SEED) -> str:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) with `vocab_size` entries, the
    special tokens first; it adds BOS to a prompt, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE has {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    for token, expected in zip(SPECIALS, range(len(SPECIALS)), strict=True):
        if tokenizer.token_to_id(token) != expected:
            raise RuntimeError(f"{token} is not id {expected}")
    return tokenizer.to_str(pretty=True)


def files(vocab_size: int = VOCAB_SIZE, seed: int = SEED) -> dict[str, str]:
    """Every file of the model directory, by name, as text."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}

    def dump(value: Any) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n"

    return {
        "config.json": dump(config),
        "tokenizer.json": tokenizer_json(vocab_size, seed),
        "tokenizer_config.json": dump(tokenizer_config),
        "generation_config.json": dump(generation),
        STRING_TEMPLATE_FILE: STRING_TEMPLATE,
    }


def make_model(directory: Path, vocab_size: int = VOCAB_SIZE, seed: int = SEED) -> Path:
    """Write the model directory (again only if its files differ) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files(vocab_size, seed).items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    return directory


def fingerprint(directory: Path) -> str:
    """SHA-256 over the directory's files, in name order: equal directories, equal prints."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
