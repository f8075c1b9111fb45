"""Models: each served model's prompt counter and limits, and the worst-case bound.

`bound_worst_case` is pure: given the parsed request, its counted prompt and the limits in
force, it returns the max_tokens kvgate will forward and the worst case in tokens, or raises
the 400 the client deserves. Tokenizers are loaded once per distinct configuration and kept
across reloads; a tokenizer that cannot be loaded fails the start (or the reload).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.config import Config, ModelConfig, TenantConfig, TokenizerConfig
from kvgate.errors import BadRequest, ContextLengthExceeded
from kvgate.requests import Endpoint, ParsedRequest
from kvgate.tokens import ChatOverhead, PromptCount, PromptCounter, Tokenizer, load_tokenizer


@dataclass(frozen=True, slots=True)
class Bound:
    prompt_tokens: int
    max_tokens: int
    worst_tokens: int
    set_max_tokens: bool  # kvgate chose max_tokens (the client sent none): forward it


def bound_worst_case(
    parsed: ParsedRequest,
    prompt_tokens: int,
    model: ModelConfig,
    tenant: TenantConfig,
    max_model_len: int | None,
) -> Bound:
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
            max_tokens = min(max_tokens, max_model_len - prompt_tokens)
        if max_tokens < 1:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens, and the "
                f"prompt alone is about {prompt_tokens} tokens",
                param="messages" if parsed.endpoint is Endpoint.CHAT else "prompt",
            )
    sequence = prompt_tokens + max_tokens
    # n > 1: every sequence may grow to max_tokens (and, without prefix caching, holds its
    # own copy of the prompt): reserve for all of them.
    worst = sequence * parsed.sequences
    if max_model_len is not None and sequence > max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens; this request "
            f"may use {sequence} ({prompt_tokens} in the prompt, {max_tokens} in the completion); "
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
    return Bound(prompt_tokens, max_tokens, worst, parsed.max_tokens is None)


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


class Catalog:
    """Prompt counters per model, sharing tokenizers between models with the same one."""

    def __init__(self) -> None:
        self._tokenizers: dict[TokenizerConfig, Tokenizer] = {}
        self._counters: dict[str, PromptCounter] = {}
        self.config: Config | None = None

    def configure(self, config: Config) -> None:
        """Load every configured tokenizer now (raises TokenizerError), then switch."""
        tokenizers = dict(self._tokenizers)
        for model in [*config.models, config.default_model]:
            if model.tokenizer not in tokenizers:
                t = model.tokenizer
                tokenizers[t] = load_tokenizer(t.kind, t.encoding, t.file)
        self._tokenizers = tokenizers
        self._counters = {}
        self.config = config

    def counter(self, model: str) -> PromptCounter:
        counter = self._counters.get(model)
        if counter is None:
            assert self.config is not None
            settings = self.config.model(model)
            template = settings.chat_template
            counter = PromptCounter(
                self._tokenizers[settings.tokenizer],
                ChatOverhead(
                    template.tokens_per_message, template.tokens_per_name,
                    template.reply_primer_tokens,
                ),
            )
            self._counters[model] = counter
        return counter

    async def count(self, parsed: ParsedRequest) -> PromptCount:
        counter = self.counter(parsed.model)
        if parsed.endpoint is Endpoint.CHAT:
            return await counter.count_chat(parsed.messages, parsed.body.get("tools"))
        return PromptCount(await counter.count_prompt(parsed.body["prompt"]))
