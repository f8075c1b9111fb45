"""Models: each served model's prompt counter and limits, and the worst-case bound.

`bound_worst_case` is pure: given the parsed request, its counted prompt and the limits in
force, it returns the max_tokens the request runs with (the client's, or vLLM's own default,
or an operator's cap, the only one kvgate forwards) and the worst case in tokens, or raises
the 400 the client deserves. A `Catalog` belongs to one config (it lives in that config's
`Runtime`); tokenizers are loaded once per distinct configuration and kept across reloads; a
tokenizer that cannot be loaded fails the start (or the reload).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from kvgate.config import PRIORITY_CLASSES, Config, ModelConfig, TenantConfig, TokenizerConfig
from kvgate.errors import BadRequest, ContextLengthExceeded, NoReplica
from kvgate.request.calibration import Terms
from kvgate.request.chat_template import ChatTemplate, find_template, load_template
from kvgate.request.parsed import Endpoint, ParsedRequest
from kvgate.request.rules import CLIENT_PRIORITY_SPAN
from kvgate.request.tokenizers import Tokenizer, load_tokenizer
from kvgate.request.tokens import PromptCount, PromptCounter


@dataclass(frozen=True, slots=True)
class Bound:
    prompt_tokens: int  # every prompt of the request, as vLLM will count them
    max_tokens: int
    worst_tokens: int
    # kvgate forwards max_tokens: the client sent none and an operator's cap lowered what vLLM
    # would allow by itself (never set otherwise: a gateway does not change the answer)
    set_max_tokens: bool
    prompts: int = 1  # prompts in the request (a completions call may batch several)


@dataclass(frozen=True, slots=True)
class Prompts:
    """A request's prompts as vLLM will count them: all together, the longest (vLLM checks
    the context per prompt), and how many (a completions call may batch several)."""

    tokens: int
    longest: int
    count: int = 1


def prompts_of(count: PromptCount, terms: Terms) -> Prompts:
    """The tokens vLLM is expected to count, from what kvgate counted and the calibration."""
    media = count.media_tokens
    return Prompts(
        terms.estimate(count.features) + media,
        terms.estimate(count.longest or count.features) + media,
        count.features.prompts,
    )


# vLLM's max_tokens for a /v1/completions request that sends none (OpenAI's default too). A
# chat that sends none may run to the end of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def context_limit(configured: int | None, reported: int | None) -> int | None:
    """The context a request is bounded by: what the pool's replicas report, or the model's
    configured max_model_len where they report nothing. A configured value may lower theirs,
    never raise it: a request beyond what any replica serves is the client's 400, not a 503
    no_replica that clients retry."""
    if configured is None or reported is None:
        return configured or reported
    return min(configured, reported)


def omitted_cap(model: ModelConfig, tenant: TenantConfig) -> int | None:
    """How far the operator caps the answer of a request that sends no max_tokens: the model's
    `default_max_tokens` and the tenant's `max_tokens_cap`, the smaller; None: not at all."""
    caps = [c for c in (model.default_max_tokens, tenant.max_tokens_cap) if c is not None]
    return min(caps) if caps else None


def pool_tokens(
    parsed: ParsedRequest, prompts: Prompts, model: ModelConfig, tenant: TenantConfig
) -> int:
    """The tokens that choose a request's pool, before its pool's context is known: its worst
    case where that does not depend on the context; for a chat that leaves its length to the
    replica (no max_tokens, no cap) its prompt alone, so it goes where its prompt belongs and
    may run to the end of that pool's context, as it would on a bare replica there."""
    open_ended = parsed.max_tokens is None and parsed.endpoint is Endpoint.CHAT
    if open_ended and omitted_cap(model, tenant) is None:
        return prompts.tokens * parsed.sequences
    return bound_worst_case(parsed, prompts, model, tenant, None).worst_tokens


def bound_worst_case(
    parsed: ParsedRequest,
    prompts: Prompts,
    model: ModelConfig,
    tenant: TenantConfig,
    served_len: int | None,
) -> Bound:
    """The worst case of a request of k prompts, each generating `parsed.sequences` sequences
    of up to max_tokens: (Σ prompts + k × max_tokens) × sequences. `served_len`: the
    max_model_len the pool's replicas report (None: not known yet)."""
    prompt_tokens, longest = prompts.tokens, prompts.longest
    max_model_len = context_limit(model.max_model_len, served_len)
    if parsed.max_tokens is not None:
        cap = tenant.max_tokens_cap
        if cap is not None and parsed.max_tokens > cap:
            field = max_tokens_field(parsed)
            raise BadRequest(
                f"{field} {parsed.max_tokens} is above tenant {tenant.name!r}'s cap of {cap}",
                param=field, code="max_tokens_above_cap",
            )
        max_tokens, forward = parsed.max_tokens, False
    else:
        max_tokens, forward = _omitted_max_tokens(
            parsed, prompts, model, tenant, max_model_len, served_len
        )
    sequence = longest + max_tokens
    # n > 1: every sequence may grow to max_tokens (and, without prefix caching, holds its
    # own copy of the prompt): reserve for all of them.
    worst = (prompt_tokens + prompts.count * max_tokens) * parsed.sequences
    if max_model_len is not None and sequence > max_model_len:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {max_model_len} tokens; this request "
            f"may use {sequence} ({longest} in the prompt, {max_tokens} in the completion); "
            "reduce the prompt or max_tokens",
            param=max_tokens_field(parsed),
        )
    limit = tenant.max_context_tokens
    if limit is not None and worst > limit:
        raise ContextLengthExceeded(
            f"tenant {tenant.name!r} may use at most {limit} tokens per request; this request "
            f"may use {worst} ({prompt_tokens} in the prompt, {max_tokens} in the completion)",
            param="max_tokens",
        )
    return Bound(prompt_tokens, max_tokens, worst, forward, prompts.count)


def _omitted_max_tokens(
    parsed: ParsedRequest,
    prompts: Prompts,
    model: ModelConfig,
    tenant: TenantConfig,
    max_model_len: int | None,
    served_len: int | None,
) -> tuple[int, bool]:
    """For a request that sends no max_tokens: the max_tokens it runs with, and whether kvgate
    must forward it. vLLM's own — the rest of the context for a chat (per prompt), 16 for
    /v1/completions — unless the operator caps it lower (`omitted_cap`, or the room the
    tenant's `max_context_tokens` leaves): then that cap, forwarded so the bound holds."""
    longest = prompts.longest
    if parsed.endpoint is Endpoint.COMPLETIONS:
        natural: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
        vllm_own: int | None = natural
    elif max_model_len is None:
        natural = vllm_own = None
    else:
        natural = max_model_len - longest
        if natural < 1:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {max_model_len} tokens, and the "
                f"prompt alone is about {longest} tokens",
                param="messages",
            )
        # vLLM bounds by its own context; kvgate's may be lower (a configured max_model_len)
        vllm_own = natural if served_len is None else served_len - longest
    caps = [c for c in (natural, omitted_cap(model, tenant)) if c is not None]
    if tenant.max_context_tokens is not None:  # the room the tenant's limit leaves
        room = (tenant.max_context_tokens // parsed.sequences - prompts.tokens) // prompts.count
        caps.append(max(1, room))  # none: the limit's own 400 below says why
    if not caps:
        raise NoReplica(
            f"the context length of model {parsed.model!r} is not known yet (no replica has "
            "reported its max_model_len, and models[].max_model_len is not set), so the "
            "worst case of a request without max_tokens is unknown; retry shortly"
        )
    max_tokens = min(caps)
    return max_tokens, vllm_own is None or max_tokens < vllm_own


def max_tokens_field(parsed: ParsedRequest) -> str:
    """The name the client gave its completion limit (vLLM reads either)."""
    return "max_tokens" if parsed.body.get("max_completion_tokens") is None else "max_completion_tokens"


def vllm_priority(priority_class: str, client: int | None) -> int:
    """The `priority` vLLM's priority scheduling gets for a request of `priority_class` (lower
    runs first): the critical class below 0, standard from 0, sheddable above, each class
    CLIENT_PRIORITY_SPAN wide, the client's own value ordering its requests within theirs."""
    rank = PRIORITY_CLASSES.index(priority_class)
    return (rank - 1) * CLIENT_PRIORITY_SPAN + (client or 0)


def pool_priority(config: Config, pool: str, tenant: TenantConfig, own: int | None) -> int | None:
    """vLLM's `priority` for a request where its pool schedules by priority: its tenant's
    class first, its own value (`own`) within it (None: the client's own is forwarded). A pool
    that runs fcfs would refuse a non-zero one: refused here instead (400)."""
    policy = config.pools[pool].scheduling_policy
    if policy == "priority":
        return vllm_priority(tenant.priority, own)
    if policy == "fcfs" and own:
        raise BadRequest(
            f"'priority' is not accepted by pool {pool!r}: its replicas schedule first "
            "come, first served (scheduling_policy: fcfs)",
            param="priority",
        )
    return None


def upstream_body(
    parsed: ParsedRequest, bound: Bound, *, ask_usage: bool = True, priority: int | None = None
) -> dict[str, object]:
    """The body to forward: the client's, plus an operator's cap on an omitted max_tokens
    (`Bound.set_max_tokens`), plus a request for usage on streams (stripped again from the
    client's stream if unasked; not where kvgate does not read the answer, `ask_usage`), with
    vLLM's `priority` set where kvgate decides it (`vllm_priority`; None: the client's own)."""
    body = dict(parsed.body)
    if bound.set_max_tokens:
        body["max_tokens"] = bound.max_tokens
    if priority is not None:
        body["priority"] = priority
    if parsed.stream and ask_usage:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body


def upstream_payload(
    parsed: ParsedRequest, bound: Bound, raw: bytes | None, *, ask_usage: bool = True,
    priority: int | None = None,
) -> bytes:
    """`upstream_body` as bytes: the client's own bytes `raw` when kvgate leaves them
    unchanged (no cap to forward, no priority to set, and for a stream include_usage asked
    already or not to be asked; None: the body was edited before, by normalization) rather
    than serialized again."""
    asks = ask_usage and parsed.stream and not parsed.client_wants_usage
    if raw is not None and not bound.set_max_tokens and not asks and priority is None:
        return raw
    return orjson.dumps(upstream_body(parsed, bound, ask_usage=ask_usage, priority=priority))


class Catalog:
    """One config's models: a prompt counter per model, built on first use, over the
    tokenizers and chat templates that config names. They load when the catalog is made, so a
    tokenizer that cannot be loaded refuses the config (TokenizerError); tokenizers already
    loaded for the `previous` catalog are shared, not loaded again."""

    def __init__(self, config: Config, previous: Catalog | None = None) -> None:
        loaded = previous._tokenizers if previous is not None else {}
        tokenizers: dict[TokenizerConfig, Tokenizer] = {}
        templates: dict[TokenizerConfig, ChatTemplate | None] = {}  # found here, not per request
        # a template with the tokenizer whose special tokens it takes
        by_path: dict[tuple[Path, Path | None], ChatTemplate | None] = {}
        for model in [*config.models, config.default_model]:
            t = model.tokenizer
            if t not in tokenizers:
                tokenizer = loaded.get(t)
                if tokenizer is None:
                    tokenizer = load_tokenizer(t.kind, t.encoding, t.file, t.special_tokens)
                tokenizers[t] = tokenizer
            if t not in templates:
                path = template_path(t)
                templates[t] = None if path is None else (
                    by_path.get((path, t.file)) or load_template(path, t.file))
                if path is not None:
                    by_path[(path, t.file)] = templates[t]
        self.config = config
        self._tokenizers: dict[TokenizerConfig, Tokenizer] = tokenizers
        self._templates = templates
        self._counters: dict[str, PromptCounter] = {}

    def counter(self, model: str) -> PromptCounter:
        counter = self._counters.get(model)
        if counter is None:
            settings = self.config.model(model)
            counter = PromptCounter(
                self._tokenizers[settings.tokenizer],
                template=self._templates.get(settings.tokenizer),
                name_tokens=settings.chat_template.tokens_per_name,
                media_part_tokens=settings.media_part_tokens,
                # the ids are for precise prefix routing: kept only where KV events are read
                token_ids=any(pool.kv_events is not None for pool in self.config.pools.values()),
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
