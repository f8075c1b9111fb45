"""Models: each served model's prompt counter and limits, and the worst-case bound.

`bound_worst_case` is pure: given the parsed request, its counted prompt and the limits in
force, it returns the max_tokens kvgate will forward and the worst case in tokens, or raises
the 400 the client deserves. A `Catalog` belongs to one config (it lives in that config's
`Runtime`); tokenizers are loaded once per distinct configuration and kept across reloads; a
tokenizer that cannot be loaded fails the start (or the reload).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from kvgate.calibration import Terms
from kvgate.chat_template import ChatTemplate, find_template, load_template
from kvgate.config import Config, ModelConfig, TenantConfig, TokenizerConfig
from kvgate.errors import BadRequest, ContextLengthExceeded
from kvgate.requests import Endpoint, ParsedRequest
from kvgate.tokens import PromptCount, PromptCounter, Tokenizer, load_tokenizer


@dataclass(frozen=True, slots=True)
class Bound:
    prompt_tokens: int  # every prompt of the request, as vLLM will count them
    max_tokens: int
    worst_tokens: int
    set_max_tokens: bool  # kvgate chose max_tokens (the client sent none): forward it
    prompts: int = 1  # prompts in the request (a completions call may batch several)


def context_limit(configured: int | None, reported: int | None) -> int | None:
    """The context a request is bounded by: what the pool's replicas report, or the model's
    configured max_model_len where they report nothing. A configured value may lower theirs,
    never raise it: a request beyond what any replica serves is the client's 400, not a 503
    no_replica that clients retry."""
    if configured is None or reported is None:
        return configured or reported
    return min(configured, reported)


def bound_worst_case(
    parsed: ParsedRequest,
    prompt_tokens: int,
    model: ModelConfig,
    tenant: TenantConfig,
    max_model_len: int | None,
    *,
    prompts: int = 1,
    longest_prompt: int | None = None,
) -> Bound:
    """The worst case of a request of `prompts` prompts (a completions call may batch several;
    `longest_prompt` is the longest one's tokens), each generating `parsed.sequences`
    sequences of up to max_tokens: (Σ prompts + prompts × max_tokens) × sequences."""
    longest = prompt_tokens if longest_prompt is None else longest_prompt
    cap = tenant.max_tokens_cap
    if parsed.max_tokens is not None:
        if cap is not None and parsed.max_tokens > cap:
            raise BadRequest(
                f"max_tokens {parsed.max_tokens} is above tenant {tenant.name!r}'s cap of {cap}",
                param="max_tokens", code="max_tokens_above_cap",
            )
        max_tokens = parsed.max_tokens
    else:
        max_tokens = model.default_max_tokens
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        if max_model_len is not None:
            max_tokens = min(max_tokens, max_model_len - longest)
        if max_tokens < 1:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens, and the "
                f"prompt alone is about {longest} tokens",
                param="messages" if parsed.endpoint is Endpoint.CHAT else "prompt",
            )
    sequence = longest + max_tokens
    # n > 1: every sequence may grow to max_tokens (and, without prefix caching, holds its
    # own copy of the prompt): reserve for all of them.
    worst = (prompt_tokens + prompts * max_tokens) * parsed.sequences
    if max_model_len is not None and sequence > max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens; this request "
            f"may use {sequence} ({longest} in the prompt, {max_tokens} in the completion); "
            "reduce the prompt or max_tokens",
            param="max_tokens",
        )
    limit = tenant.max_context_tokens
    if limit is not None and worst > limit:
        raise ContextLengthExceeded(
            f"tenant {tenant.name!r} may use at most {limit} tokens per request; this request "
            f"may use {worst} ({prompt_tokens} in the prompt, {max_tokens} in the completion)",
            param="max_tokens",
        )
    return Bound(prompt_tokens, max_tokens, worst, parsed.max_tokens is None, prompts)


def upstream_body(parsed: ParsedRequest, bound: Bound) -> dict[str, object]:
    """The body to forward: the client's, plus the max_tokens kvgate bounded it by, plus a
    request for usage on streams (stripped again from the client's stream if unasked)."""
    body = dict(parsed.body)
    if bound.set_max_tokens:
        body["max_tokens"] = bound.max_tokens
    if parsed.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body


def upstream_payload(parsed: ParsedRequest, bound: Bound, raw: bytes | None) -> bytes:
    """`upstream_body` as bytes: the client's own bytes `raw` when kvgate leaves them
    unchanged (a max_tokens given, and for a stream include_usage asked already; None: the
    body was edited before, by normalization) rather than serialized again (issue 14)."""
    unchanged = not bound.set_max_tokens and not (parsed.stream and not parsed.client_wants_usage)
    if raw is not None and unchanged:
        return raw
    return orjson.dumps(upstream_body(parsed, bound))


class Catalog:
    """One config's models: a prompt counter per model, built on first use, over the
    tokenizers and chat templates that config names. They load when the catalog is made, so a
    tokenizer that cannot be loaded refuses the config (TokenizerError); tokenizers already
    loaded for the `previous` catalog are shared, not loaded again."""

    def __init__(self, config: Config, previous: Catalog | None = None) -> None:
        loaded = previous._tokenizers if previous is not None else {}
        tokenizers: dict[TokenizerConfig, Tokenizer] = {}
        templates: dict[Path, ChatTemplate] = {}
        for model in [*config.models, config.default_model]:
            t = model.tokenizer
            if t not in tokenizers:
                tokenizer = loaded.get(t)
                if tokenizer is None:
                    tokenizer = load_tokenizer(t.kind, t.encoding, t.file)
                tokenizers[t] = tokenizer
            path = template_path(t)
            if path is not None and path not in templates:
                templates[path] = load_template(path)
        self.config = config
        self._tokenizers: dict[TokenizerConfig, Tokenizer] = tokenizers
        self._templates: dict[Path, ChatTemplate] = templates
        self._counters: dict[str, PromptCounter] = {}

    def counter(self, model: str) -> PromptCounter:
        counter = self._counters.get(model)
        if counter is None:
            settings = self.config.model(model)
            path = template_path(settings.tokenizer)
            counter = PromptCounter(
                self._tokenizers[settings.tokenizer],
                template=self._templates[path] if path is not None else None,
                name_tokens=settings.chat_template.tokens_per_name,
                media_part_tokens=settings.media_part_tokens,
            )
            self._counters[model] = counter
        return counter

    def prior(self, model: str, endpoint: Endpoint, count: PromptCount) -> Terms:
        """Where the calibrated estimate starts: the configured template overhead for chats
        counted without the model's template, nothing added otherwise."""
        if endpoint is not Endpoint.CHAT or count.templated:
            return Terms()
        template = self.config.model(model).chat_template
        return Terms(1.0, template.tokens_per_message, template.reply_primer_tokens)

    async def count(self, parsed: ParsedRequest) -> PromptCount:
        counter = self.counter(parsed.model)
        if parsed.endpoint is Endpoint.CHAT:
            body = parsed.body
            kwargs = body.get("chat_template_kwargs")
            return await counter.count_chat(
                parsed.messages, body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt") is not False,
                template_kwargs=kwargs if isinstance(kwargs, dict) else None,
            )
        return await counter.count_prompt(parsed.body["prompt"])


def template_path(tokenizer: TokenizerConfig) -> Path | None:
    if tokenizer.template_file is not None:
        return tokenizer.template_file
    if tokenizer.kind == "huggingface":
        return find_template(tokenizer.file)
    return None
