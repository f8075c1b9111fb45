"""vLLM's own admission limits: `--max-num-queued-reqs` and `--max-num-queued-tokens`.

vLLM (0.33, `AsyncLLM.check_admission` in `vllm/v1/engine/async_llm.py`) refuses a request
in its API server, before the engine sees it:

- `max_num_queued_reqs`: when the unfinished requests (waiting or running) plus the new
  request's sequences would exceed the limit; a request of `n` sequences counts `n`.
- `max_num_queued_tokens`: when the prompt tokens of the requests still in prefill (no output
  token yet, whatever chunked prefill or the prefix cache has done) already reach the limit;
  the new request's own prompt is not counted. Each sequence of an `n > 1` request is a request
  of its own there, so its prompt counts `n` times.

It checks once before rendering the prompt (so a full queue answers 503 even to a prompt that
is too long) and again as each prompt of the request is added. Both answer 503 with
`{"error": {"message": ..., "type": "Service Unavailable", "param": null, "code": 503}}`
(`GracefulHTTPError`, mapped in `entrypoints/serve/exception_handling/error_response.py`) and
no `Retry-After`, and count `vllm:admission_rejections{model_name, reason}`. Pure: values in,
a reason out.
"""

from __future__ import annotations

# vLLM's `ADMISSION_REASONS` (vllm/v1/metrics/loggers.py), the counter's `reason` label.
MAX_NUM_QUEUED_REQS = "max_num_queued_reqs"
MAX_NUM_QUEUED_TOKENS = "max_num_queued_tokens"
REASONS = (MAX_NUM_QUEUED_REQS, MAX_NUM_QUEUED_TOKENS)

# vLLM's messages (QueueOverflowError, MaxQueuedTokensError in vllm/exceptions.py).
MESSAGES = {
    MAX_NUM_QUEUED_REQS: "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    MAX_NUM_QUEUED_TOKENS: "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}
ERROR_TYPE = "Service Unavailable"  # HTTPStatus(503).phrase, as vLLM names the type


class AdmissionRejected(Exception):
    """vLLM's queue limits refuse the request; the server answers 503."""

    def __init__(self, reason: str) -> None:
        super().__init__(MESSAGES[reason])
        self.reason = reason
        self.message = MESSAGES[reason]


def rejection(
    *,
    max_num_queued_reqs: int | None,
    max_num_queued_tokens: int | None,
    unfinished: int,
    queued_tokens: int,
    sequences: int,
) -> str | None:
    """The reason vLLM refuses a request of `sequences` engine requests now, or None.

    `unfinished`: engine requests not finished; `queued_tokens`: the prompt tokens of those
    that have not produced a token yet. The request limit is checked first, as vLLM does."""
    if max_num_queued_reqs is not None and unfinished + sequences > max_num_queued_reqs:
        return MAX_NUM_QUEUED_REQS
    if max_num_queued_tokens is not None and queued_tokens >= max_num_queued_tokens:
        return MAX_NUM_QUEUED_TOKENS
    return None
