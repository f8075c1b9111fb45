"""One API request fanned out into engine requests, as vLLM V1 fans out `n` and prompt lists.

Each (prompt, sequence) pair is its own engine request: a completions `prompt` list of k
prompts and `n` (or `best_of`) sequences make k × n of them. The sequences of a prompt share
its prefix-cache blocks as vLLM's child requests do: the first to be scheduled caches the
prompt's full blocks and the rest hit them. Engine ids follow vLLM: `{base}-{i}` for prompt i
of a list, `{j}_{id}` for sequence j when there are several.

Choice `prompt_index * n + j` is the j-th returned sequence of prompt `prompt_index`. With
`best_of > n` a prompt's sequences are ranked by cumulative logprob (as vLLM V0 ranked them)
and the n most likely returned; usage counts the returned choices' tokens only, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvgate.sim.extras import full_choice
from kvgate.sim.logprobs import LogprobTable
from kvgate.sim.options import OutputOptions
from kvgate.sim.request import FinishReason, check_context_length
from kvgate.sim.responses import Completion
from kvgate.sim.runtime import EngineRuntime, Generation


@dataclass(slots=True)
class Child:
    """One engine request of an API request."""

    prompt_index: int
    sequence: int  # j: which of the prompt's sequences (0 .. best_of-1)
    generation: Generation


class EngineAborted(RuntimeError):
    """The engine ended a child early (a restart or stop cut it); the server answers 500."""


def child_id(base: str, prompt_index: int, num_prompts: int, sequence: int, sequences: int) -> str:
    request_id = base if num_prompts == 1 else f"{base}-{prompt_index}"
    return request_id if sequences == 1 else f"{sequence}_{request_id}"


@contextmanager
def fan_out(
    runtime: EngineRuntime,
    base_id: str,
    prompts: Sequence[Sequence[int]],
    sequences: int,
    max_tokens: int | None,
    *,
    ignore_eos: bool = False,
    output_len: int | None = None,
    priority: int = 0,
) -> Iterator[list[Child]]:
    """Submit every child; on exit abort those unfinished, however the handler ends
    (disconnect, dropped connection, error), so no child keeps blocks in the engine.
    `output_len`: every child's answer length (None: each drawn by the engine).

    Every prompt's context length is checked first (raises ContextLengthError): one prompt
    too long submits nothing. Then vLLM's queue limits are checked again before each prompt's
    sequences are added, as vLLM adds each prompt of a list (raises AdmissionRejected, and the
    prompts already added are aborted).
    """
    for prompt in prompts:
        check_context_length(len(prompt), max_tokens, runtime.config.max_model_len)
    children: list[Child] = []
    try:
        for i, prompt in enumerate(prompts):
            runtime.check_admission(sequences)
            for j in range(sequences):
                engine_id = runtime.unique_id(child_id(base_id, i, len(prompts), j, sequences))
                generation = runtime.submit(
                    engine_id, prompt, max_tokens,
                    ignore_eos=ignore_eos, output_len=output_len, priority=priority,
                )  # fmt: skip
                children.append(Child(i, j, generation))
        yield children
    finally:
        for child in children:
            runtime.abort(child.generation)


async def wait_all(children: Sequence[Child]) -> None:
    """Wait until every child ended; raise EngineAborted if any was cut."""
    for child in children:
        await child.generation.wait_finished()
        if child.generation.finish_reason is FinishReason.ABORT:
            raise EngineAborted("The engine aborted the request.")


def returned(
    children: Sequence[Child], options: OutputOptions, table: LogprobTable
) -> list[tuple[int, Child]]:
    """The choices a response returns, as (choice index, child), in index order."""
    if options.best_of == options.n:
        return [(c.prompt_index * options.n + c.sequence, c) for c in children]
    by_prompt: dict[int, list[Child]] = {}
    for child in children:
        by_prompt.setdefault(child.prompt_index, []).append(child)
    choices: list[tuple[int, Child]] = []
    for prompt_index, candidates in sorted(by_prompt.items()):
        ranked = sorted(
            candidates,
            key=lambda c: (-table.cumulative(c.sequence, c.generation.num_ready), c.sequence),
        )
        choices.extend((prompt_index * options.n + j, c) for j, c in enumerate(ranked[: options.n]))
    return choices


def full_body(
    completion: Completion,
    options: OutputOptions,
    table: LogprobTable,
    children: Sequence[Child],
    prompt_tokens: int,
) -> dict[str, Any]:
    """The whole response once every child ended (after `wait_all`)."""
    choices = []
    completion_tokens = 0
    for index, child in returned(children, options, table):
        count, reason = child.generation.num_ready, child.generation.finish_reason
        assert reason is not None, "full_body before wait_all"
        completion_tokens += count
        choices.append(
            full_choice(completion, options, table, index, child.sequence, count, reason.value)
        )
    return completion.full(choices, prompt_tokens, completion_tokens)
