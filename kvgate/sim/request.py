"""A request inside the simulated engine, and how long its output will be."""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence

from kvgate.sim.blocks import Block, block_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class ContextLengthError(ValueError):
    """The prompt, or prompt + max_tokens, does not fit in max_model_len (vLLM answers 400)."""


def check_context_length(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, source: str = "messages"
) -> int:
    """Return the effective max_tokens, or raise with vLLM's wording.

    `max_tokens=None` means "whatever room is left" (vLLM's chat default).
    """
    if max_tokens is None and prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens} tokens in the {source}, Please reduce the length of "
            f"the {source}."
        )
    if max_tokens is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {source}, "
            f"{max_tokens} in the completion). Please reduce the length of the {source} or "
            "completion."
        )
    return max_tokens


def draw_output_len(
    rng: random.Random,
    max_tokens: int,
    dist: str,
    *,
    min_fraction: float = 0.1,
    median_fraction: float = 0.3,
    sigma: float = 0.8,
) -> int:
    """How many tokens the "model" generates before its end-of-sequence, capped by max_tokens.

    `max`: always max_tokens. `uniform`: a fraction of max_tokens drawn from U(min_fraction, 1).
    `lognormal`: a fraction with the given median and sigma (clipped to 1).
    """
    if dist == "max":
        return max_tokens
    if dist == "uniform":
        fraction = rng.uniform(min_fraction, 1.0)
    elif dist == "lognormal":
        fraction = rng.lognormvariate(math.log(median_fraction), sigma)
    else:
        raise ValueError(f"unknown output length distribution {dist!r}")
    return max(1, min(max_tokens, round(fraction * max_tokens)))


class SimRequest:
    """One request's tokens, blocks and timestamps (simulated seconds)."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "blocks",
        "finish_reason",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_len",
        "priority",
        "request_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        output_len: int,
        arrival_time: float,
        block_size: int,
        priority: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.output_len = min(output_len, max_tokens)
        self.arrival_time = arrival_time
        self.priority = priority  # lower runs first, under the priority policy
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first scheduling (-1: not yet scheduled).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.blocks: list[Block] = []
        # How many of `blocks` already carry their hash in the pool.
        self.num_cached_blocks = 0
        self.block_hashes = block_hashes(self.token_ids, block_size)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_output(self, token_id: int, block_size: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % block_size == 0:
            self.block_hashes = block_hashes(self.token_ids, block_size, self.block_hashes)

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}"
            f", out={self.num_output_tokens}, computed={self.num_computed_tokens}"
            f", blocks={len(self.blocks)})"
        )
