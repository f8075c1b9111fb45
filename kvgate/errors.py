"""One error hierarchy, mapped to an HTTP status and OpenAI's error body in one place.

    KvgateError                       (status, type, code, param, message, headers)
     ├── ClientError                  4xx: never forwarded upstream
     │    ├── BadRequest              400 invalid_request_error
     │    │    ├── ContextLengthExceeded   code=context_length_exceeded
     │    │    └── NeverFits               code=never_fits
     │    ├── Unauthorized            401 code=invalid_api_key
     │    ├── Forbidden               403 code=model_not_allowed / pool_not_allowed
     │    ├── NotFound                404 code=model_not_found / unknown_url
     │    ├── MethodNotAllowed        405
     │    ├── RequestTimeout          408 the body did not arrive within server.client_timeout_s
     │    ├── PayloadTooLarge         413
     │    └── RateLimited             429 code=queue_full / queue_timeout: no KV capacity in time
     │         └── OverBudget         429 code=rate_limit_exceeded, type=requests / tokens /
     │                                    concurrency: a tenant's limit, as OpenAI answers it
     └── ServerError                  5xx: kvgate or a replica could not serve
          ├── UpstreamError           502 the replica failed or answered 5xx
          ├── ReplicaBusy             503 vLLM's queue limits refused it: the gateway sends the
          │                               request elsewhere or queues it, never to the client
          ├── NoReplica               503 no healthy replica can take the request
          ├── StateStoreUnavailable   503 Redis is down and failure_mode is fail_closed
          └── UpstreamTimeout         504

`refusal_reason` is the label used in `kvgate_refusals_total`; it is the same word as the
OpenAI `code` where one exists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class KvgateError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    refusal_reason = "internal"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ClientError(KvgateError):
    status = 400
    type = "invalid_request_error"
    refusal_reason = "bad_request"


class BadRequest(ClientError):
    pass


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"
    refusal_reason = "context_length_exceeded"


class NeverFits(BadRequest):
    code = "never_fits"
    refusal_reason = "never_fits"


class Unauthorized(ClientError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    refusal_reason = "unauthorized"


class Forbidden(ClientError):
    status = 403
    type = "permission_error"
    code = "forbidden"
    refusal_reason = "forbidden"


class NotFound(ClientError):
    status = 404
    code = "not_found"
    refusal_reason = "not_found"


class MethodNotAllowed(ClientError):
    status = 405
    code = "method_not_allowed"


class RequestTimeout(ClientError):
    status = 408
    code = "request_timeout"
    refusal_reason = "request_timeout"


class PayloadTooLarge(ClientError):
    status = 413
    code = "request_too_large"


class RateLimited(ClientError):
    """429. `code` tells why: queue_full or queue_timeout (kvgate's own capacity).

    `Retry-After` is whole seconds (at least 1, as HTTP has it); `retry-after-ms` carries the
    computed figure, which OpenAI's clients read first."""

    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limited"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        merged = dict(headers or {})
        merged["Retry-After"] = str(max(1, math.ceil(retry_after_s - 1e-3)))
        merged["retry-after-ms"] = str(max(1, math.ceil(retry_after_s * 1000)))
        super().__init__(message, code=code, headers=merged)
        self.retry_after_s = retry_after_s
        self.refusal_reason = self.code or "rate_limited"


class OverBudget(RateLimited):
    """429 for a tenant's own limit, in OpenAI's shape: code rate_limit_exceeded, and `type`
    naming the limit (requests, tokens, concurrency)."""

    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        retry_after_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s, headers=headers)
        self.type = limit
        self.refusal_reason = "concurrency_limit" if limit == "concurrency" else "rate_limited"


class ServerError(KvgateError):
    status = 500
    type = "server_error"
    code = "internal_error"


class UpstreamError(ServerError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"
    refusal_reason = "upstream_error"


class ReplicaBusy(ServerError):
    """The replica answered vLLM's overload 503 (`kvgate.admission.backpressure`): backpressure from a
    healthy replica, not a failure. The attempts stage (`kvgate.transport.attempts`) places
    the request again; a client only ever sees kvgate's own 429 when no replica takes it
    within its wait budget."""

    status = 503
    type = "service_unavailable"
    code = "replica_busy"
    refusal_reason = "replica_busy"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # vLLM's: max_num_queued_reqs, max_num_queued_tokens


class NoReplica(ServerError):
    status = 503
    type = "service_unavailable"
    code = "no_replica"
    refusal_reason = "no_replica"


class StateStoreUnavailable(ServerError):
    status = 503
    type = "service_unavailable"
    code = "state_store_unavailable"
    refusal_reason = "state_store_unavailable"


class UpstreamTimeout(ServerError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"
    refusal_reason = "upstream_timeout"


# How an attempt at a replica failed, one type each (the client sees their parent's status and
# code). The transport raises them, or records them on the attempt where the answer was
# already under way (`kvgate.transport.base.Outcome.fail`); the breaker and failover dispatch
# on the type (`kvgate.transport.failover`).


class Unreachable(UpstreamError):
    """The request never reached the replica: the connection could not be made."""


class StreamBroke(UpstreamError):
    """The connection to the replica, or Envoy's stream, ended before the answer did."""


class BadAnswer(UpstreamError):
    """The replica answered with a failure (a 5xx other than vLLM's busy one) or with what
    kvgate cannot use (a success that is not JSON; behind Envoy, from another address)."""


class NoHeadersInTime(UpstreamTimeout):
    """No response headers within first_byte_s (or, behind Envoy, within its timeout)."""


class LateAnswer(UpstreamTimeout):
    """The answer began, then outlived its total deadline or went idle past idle_s."""
