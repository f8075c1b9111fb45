"""A model's own chat template, rendered as transformers renders it, counts prompts exactly.

The tokenizer here is a real Hugging Face BPE tokenizer trained in the test, with ChatML's
markers as single special tokens; the template is a ChatML template with tools and a
`chat_template_kwargs` switch, in a tokenizer_config.json beside the tokenizer.json, as a
model repository ships them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.config import parse_config
from kvgate.request.calibration import Terms
from kvgate.request.catalog import Catalog
from kvgate.request.chat_template import find_template, load_template
from kvgate.request.parsed import Endpoint, parse_body
from kvgate.request.tokenizers import TokenizerError, load_tokenizer
from kvgate.request.tokens import PromptCounter

TEMPLATE = (
    "{%- if messages[0].role == 'assistant' -%}"
    "{{ raise_exception('a conversation cannot start with the assistant') }}"
    "{%- endif -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo du jour",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [
        "You are a helpful assistant. Answer briefly.",
        "What is the weather in Paris today? Météo du jour: 東京 は 晴れ 🌤️",
        "def add(a, b):\n    return a + b\n",
        "system user assistant tool # Tools type function name parameters object",
    ] * 20
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("model")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>",
        "bos_token": None, "pad_token": {"content": "<|endoftext|>", "special": True},
    }))
    return directory


def test_the_template_renders_chatml_with_tools_first(model_dir: Path):
    template = load_template(model_dir / "tokenizer_config.json")
    text = template.render([{"role": "user", "content": "hi"}], TOOLS)
    tool_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text == (
        f"<|im_start|>system\n# Tools\n{tool_json}\n<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


async def test_a_chat_is_counted_exactly_as_the_rendered_prompt_tokenizes(model_dir: Path):
    tokenizer = load_tokenizer("huggingface", file=model_dir / "tokenizer.json")
    counter = PromptCounter(tokenizer, template=load_template(model_dir / "tokenizer_config.json"))
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is the weather in Paris today? 東京 は 晴れ 🌤️"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    count = await counter.count_chat(messages, TOOLS)
    rendered = (
        "<|im_start|>system\n# Tools\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n<|im_end|>\n"
        + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        + "<|im_start|>assistant\n"
    )
    assert count.templated
    assert count.features.text_tokens == len(tokenizer.encode(rendered))
    # the markers are single special tokens, not text
    assert len(tokenizer.encode("<|im_start|><|im_end|>")) == 2


async def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(model_dir: Path):
    config = parse_config({
        "pools": {"p": {"replicas": [{"url": "http://r:8000"}]}},
        "models": [{"name": "m", "tokenizer": {"kind": "huggingface",
                                               "file": str(model_dir / "tokenizer.json")}}],
    })
    catalog = Catalog(config)  # finds tokenizer_config.json beside tokenizer.json
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def tokens(**extra: object) -> int:
        parsed = parse_body(json.dumps({**base, **extra}).encode(), Endpoint.CHAT)
        count = await catalog.count(parsed)
        assert count.templated and catalog.prior("m", Endpoint.CHAT, count) == Terms()
        return count.features.text_tokens

    plain = await tokens()
    assert await tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert await tokens(add_generation_prompt=False) < plain


async def test_messages_the_template_refuses_fall_back_to_the_calibrated_estimate(model_dir):
    tokenizer = load_tokenizer("huggingface", file=model_dir / "tokenizer.json")
    counter = PromptCounter(tokenizer, template=load_template(model_dir / "tokenizer_config.json"))
    count = await counter.count_chat([{"role": "assistant", "content": "hi"},
                                      {"role": "user", "content": "hello"}])
    assert not count.templated and count.features.messages == 2


def test_templates_are_found_beside_the_tokenizer_and_bad_ones_fail_at_start(tmp_path, model_dir):
    assert find_template(model_dir / "tokenizer.json") == model_dir / "tokenizer_config.json"
    assert find_template(tmp_path / "tokenizer.json") is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(TokenizerError, match="does not compile"):
        load_template(tmp_path / "tokenizer_config.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no chat_template"):
        load_template(tmp_path / "empty.json")


def test_tool_call_arguments_are_rendered_as_objects_as_vllm_renders_them():
    """vLLM parses an assistant's tool-call `arguments` from their JSON string before the
    template sees them (invalid, non-object or empty: {}), and drops an empty `tool_calls`;
    the request's own messages are left untouched."""
    from kvgate.request.chat_template import as_vllm_renders

    def call(arguments: object) -> dict[str, object]:
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}

    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            call('{"city": "Paris"}'), call("not json"), call("[1, 2]"), call(""),
            call({"already": "an object"})]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ]  # fmt: skip
    original = repr(messages)
    rendered = as_vllm_renders(messages)
    assert rendered[0] is messages[0]
    assert [c["function"]["arguments"] for c in rendered[1]["tool_calls"]] == [
        {"city": "Paris"}, {}, {}, {}, {"already": "an object"}]
    assert "tool_calls" not in rendered[2]
    assert repr(messages) == original


@pytest.mark.parametrize(("source", "expected"), [
    # loops over a message's content: vLLM hands it typed parts
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    # through variables set from messages and from the content
    ("{% set rest = messages[1:] %}{% for m in rest %}{% set c = m['content'] %}"
     "{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    # prints the content, tests it, trims it: a string
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] | trim }}{% endif %}"
     "{% endfor %}", "string"),
    # a loop over something else of the message is not a loop over its content
    ("{% for m in messages %}{% for c in m['tool_calls'] %}{{ c.id }}{% endfor %}"
     "{{ m['content'] }}{% endfor %}", "string"),
])  # fmt: skip
def test_the_content_format_is_read_from_the_template_as_vllm_reads_it(source, expected):
    from kvgate.request.chat_template import content_format

    assert content_format(source) == expected


def test_content_is_handed_to_each_template_in_its_format():
    """A "string" template gets text parts joined by newlines (other parts dropped); an
    "openai" one gets a string as one text part."""
    from kvgate.request.chat_template import as_vllm_renders

    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": ""}, {"type": "text", "text": "b"}]  # fmt: skip
    messages = [{"role": "user", "content": parts}, {"role": "user", "content": "c"}]
    as_string = as_vllm_renders(messages, "string")
    assert [m["content"] for m in as_string] == ["a\nb", "c"]  # empty parts skipped, as vLLM does
    assert as_string[1] is messages[1]
    as_parts = as_vllm_renders(messages, "openai")
    assert as_parts[0] is messages[0]
    assert as_parts[1]["content"] == [{"type": "text", "text": "c"}]
    assert messages[1]["content"] == "c"
    # no content at all (an assistant's tool call): no parts
    calling = [{"role": "assistant", "content": None, "tool_calls": []}]
    assert as_vllm_renders(calling, "string")[0]["content"] == ""
    assert as_vllm_renders(calling, "openai")[0]["content"] == []


def test_a_jinja_template_takes_its_special_tokens_from_the_tokenizer_beside_it(tmp_path):
    """As vLLM's --chat-template does: `{{ bos_token }}` is the model's BOS, not empty."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                        "{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    assert load_template(template, tmp_path / "tokenizer.json").render(messages) == "<s>hi</s>"
    assert load_template(template).render(messages) == "hi"
