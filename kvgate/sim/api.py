"""The HTTP surface of a simulated replica: vLLM's OpenAI-compatible API plus `/sim/*`.

A generation request is read top to bottom: parse the body and its options (`options.py`, which
also reads the benchmark-only `X-Sim-Output-Tokens` header: where the answer ends),
check vLLM's queue limits (`admission.py`: 503 when full), encode the prompts (`text.py`),
fan out one engine request per prompt and sequence (`choices.py`), then answer as a stream
(`streaming.py`) or whole.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
POST /tokenize, POST /detokenize, GET /metrics, and the control routes in `control.py`.
Middlewares, outermost first: error bodies in vLLM's shape, the optional API key (paths under
/v1 only), then the request faults (latency, hang, 500s) on /v1 paths.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.sim import control
from kvgate.sim.admission import ERROR_TYPE as BUSY_ERROR_TYPE
from kvgate.sim.admission import AdmissionRejected
from kvgate.sim.choices import Child, EngineAborted, fan_out, full_body, wait_all
from kvgate.sim.extras import RichChunks
from kvgate.sim.logprobs import LogprobTable
from kvgate.sim.options import (
    OptionError,
    OutputOptions,
    chat_options,
    completion_options,
    output_tokens,
)
from kvgate.sim.request import ContextLengthError
from kvgate.sim.responses import ChoiceChunks, ChunkWriter, Completion, error_body
from kvgate.sim.runtime import EngineRuntime
from kvgate.sim.streaming import ChoiceStream, drop, stream
from kvgate.sim.text import PromptError

if TYPE_CHECKING:
    from kvgate.sim.server import SimReplica

ERROR_TYPES = {
    400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
    503: BUSY_ERROR_TYPE,  # only vLLM's queue limits answer 503 on these routes
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> web.Response:
        error_type = ERROR_TYPES.get(self.status, "Error")
        body = error_body(self.message, error_type, self.status, self.param)
        return web.Response(status=self.status, body=body, content_type="application/json")


def build_app(replica: SimReplica, runtime: EngineRuntime) -> web.Application:
    api = OpenAIApi(replica, runtime)
    app = web.Application(
        middlewares=[_errors, _auth_middleware(replica), _fault_middleware(replica)],
        client_max_size=64 * 1024 * 1024,
    )
    app.add_routes(
        [
            web.post("/v1/chat/completions", api.chat_completions),
            web.post("/v1/completions", api.completions),
            web.get("/v1/models", api.models),
            web.get("/health", api.health),
            web.post("/tokenize", api.tokenize),
            web.post("/detokenize", api.detokenize),
            web.post("/reset_prefix_cache", api.reset_prefix_cache),
            web.get("/metrics", api.metrics),
            *control.routes(replica, runtime),
        ]
    )
    return app


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()


def _auth_middleware(replica: SimReplica) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = replica.config.api_key
        if (
            key
            and request.path.startswith("/v1")
            and request.headers.get("Authorization") != f"Bearer {key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return auth


def _fault_middleware(replica: SimReplica) -> Middleware:
    @web.middleware
    async def faults(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            replica.held_by_faults += 1
            try:
                if replica.faults.latency_s > 0:
                    await asyncio.sleep(replica.faults.latency_s)
                while replica.faults.hang:
                    await replica.faults_changed()
            finally:
                replica.held_by_faults -= 1
            if replica.faults.draw_error(replica.fault_rng):
                raise ApiError(500, "Simulated internal server error (fault injection).")
        return await handler(request)

    return faults


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _options(
    parse: Callable[[Mapping[str, Any]], OutputOptions], body: Mapping[str, Any]
) -> OutputOptions:
    try:
        return parse(body)
    except OptionError as exc:
        raise ApiError(400, str(exc), exc.param) from exc


async def _prepared_stream(request: web.Request, base_id: str) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": base_id,
        }
    )
    await response.prepare(request)
    return response


def _optional_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer, got {value!r}.", key)
    if value < minimum:
        raise ApiError(400, f"{key} must be at least {minimum}, got {value}.", key)
    return value


class OpenAIApi:
    def __init__(self, replica: SimReplica, runtime: EngineRuntime) -> None:
        self.replica = replica
        self.runtime = runtime
        self.model = replica.config.served_model_name
        self.created = int(time.time())
        self.logprobs = LogprobTable(replica.config.seed)

    # ------------------------------------------------------------------ generation

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        self._check_common(body)
        options = _options(chat_options, body)
        self._preflight(options)
        try:
            prompt_ids = self.replica.encoder.encode_chat(
                body.get("messages"),
                bool(body.get("add_generation_prompt", True)),
                body.get("tools"),
            )
        except PromptError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        max_tokens = _optional_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _optional_int(body, "max_tokens", 1)
        return await self._generate(request, body, [prompt_ids], max_tokens, options, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        self._check_common(body)
        options = _options(completion_options, body)
        self._preflight(options)
        try:
            prompts = self.replica.encoder.encode_prompts(body.get("prompt"))
        except PromptError as exc:
            raise ApiError(400, str(exc), "prompt") from exc
        max_tokens = _optional_int(body, "max_tokens", 1)
        return await self._generate(
            request, body, prompts, 16 if max_tokens is None else max_tokens, options, chat=False
        )

    def _check_common(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        priority = body.get("priority", 0)
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ApiError(400, "priority: must be an integer", "priority")
        if priority and self.runtime.config.scheduling_policy != "priority":
            raise ApiError(400, f"Got priority {priority} but Priority scheduling is not enabled.")

    def _preflight(self, options: OutputOptions) -> None:
        """vLLM's queue limits, checked before the prompt is rendered (as vLLM's serving
        layer does): a full queue answers 503, whatever the prompt."""
        try:
            self.runtime.check_admission(options.best_of)
        except AdmissionRejected as exc:
            raise ApiError(503, exc.message) from exc

    async def _generate(
        self,
        request: web.Request,
        body: Mapping[str, Any],
        prompts: list[list[int]],
        max_tokens: int | None,
        options: OutputOptions,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        """Fan the request out into engine requests, then answer as a stream or whole."""
        base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        completion = Completion(
            chat, f"{'chatcmpl' if chat else 'cmpl'}-{base_id}", int(time.time()), self.model
        )
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        drop_after = self.replica.faults.draw_drop(self.replica.fault_rng)
        ignore_eos = bool(body.get("ignore_eos", False))
        priority = body.get("priority") or 0  # checked by _check_common
        try:
            output_len = output_tokens(request.headers)  # the benchmark-only header
        except OptionError as exc:
            raise ApiError(400, str(exc), exc.param) from exc
        try:
            with fan_out(
                self.runtime, base_id, prompts, options.best_of, max_tokens,
                ignore_eos=ignore_eos, output_len=output_len, priority=priority,
            ) as children:
                if body.get("stream"):
                    stream_options = body.get("stream_options") or {}
                    include_usage = isinstance(stream_options, dict) and bool(
                        stream_options.get("include_usage")
                    )
                    response = await _prepared_stream(request, base_id)
                    return await stream(
                        request,
                        response,
                        completion,
                        [self._choice_stream(completion, options, c) for c in children],
                        prompt_tokens,
                        include_usage=include_usage,
                        drop_after=drop_after,
                    )
                await wait_all(children)
                if drop_after is not None:
                    raise drop(request)
                body = full_body(completion, options, self.logprobs, children, prompt_tokens)
                return web.Response(
                    body=orjson.dumps(body),
                    content_type="application/json",
                    headers={"X-Request-Id": base_id},
                )
        except ContextLengthError as exc:
            raise ApiError(400, str(exc)) from exc
        except AdmissionRejected as exc:  # a later prompt of a list found the queue full
            raise ApiError(503, exc.message) from exc
        except EngineAborted as exc:
            raise ApiError(500, str(exc)) from exc
        except ConnectionResetError:
            # The client left or the connection was dropped on purpose; nobody reads this.
            return web.Response(status=499)

    def _choice_stream(
        self, completion: Completion, options: OutputOptions, child: Child
    ) -> ChoiceStream:
        index = child.prompt_index * options.n + child.sequence
        chunks: ChoiceChunks = (
            ChunkWriter(completion, index)
            if options.plain
            else RichChunks(completion, options, self.logprobs, index, child.sequence)
        )
        return ChoiceStream(child.generation, chunks)

    # ------------------------------------------------------------------ the rest

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.replica.config
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.replica.faults.health_fail else 200)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        self._check_common(body)
        encoder = self.replica.encoder
        try:
            if "messages" in body:
                add_prompt = bool(body.get("add_generation_prompt", True))
                tokens = encoder.encode_chat(body["messages"], add_prompt, body.get("tools"))
            else:
                tokens = encoder.encode_prompt(body.get("prompt"))
        except PromptError as exc:
            raise ApiError(400, str(exc)) from exc
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.replica.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        self._check_common(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "'tokens' must be a list of token ids.", "tokens")
        try:
            text = self.replica.encoder.decode(tokens)
        except (KeyError, ValueError) as exc:
            raise ApiError(400, f"Invalid token ids: {exc}", "tokens") from exc
        return web.json_response({"prompt": text})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev endpoint: every cached prefix dropped (an AllBlocksCleared event), unless
        a request still holds blocks ({"success": false})."""
        return web.json_response({"success": self.runtime.reset_prefix_cache()})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.runtime.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
