"""The front of the request path: the body parsed and validated, the tenant identified and
allowed, the prompt normalized, fingerprinted and counted — everything before the request is
bounded and routed, and everything on the path whose cost grows with the body.

A large body (over OFF_PROCESS_BYTES, or OFF_PROCESS_OBJECTS objects) goes through its
parse, normalization, fingerprint and count in a worker process. On the loop, or in a thread
of its process, each would hold the event loop as long as it takes: orjson and pydantic parse
and validate holding the GIL, the normalization's regular expressions and the tokenizer run
over the whole text (an 8 MiB body held the loop 0.3-1.2 s; `bench/body_stall.py`). The loop gets back only what the rest
of the path needs: the body's small values as they are, every larger one (a message's content,
the tools, a prompt) as the JSON it serializes to, forwarded as it is (`orjson.Fragment`) and
never parsed again here; the count, the fingerprint and the normalization's tally. Errors come
back as the same OpenAI-style 4xx and are raised in the same order as on the loop: the body's
own (400) before the tenant's (401, 403) and the model's (404), a count's last.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson

from kvgate.config import Config, TenantConfig
from kvgate.errors import KvgateError, NotFound
from kvgate.normalize.fingerprint import preview
from kvgate.normalize.stage import Prepared, PromptStage, prepare, settings_for
from kvgate.request.catalog import Catalog
from kvgate.request.parsed import Endpoint, ParsedRequest, parse_body, with_model
from kvgate.request.tokens import PromptCount
from kvgate.runtime import Runtime
from kvgate.tenants import check_access

# A body larger than this, or with more JSON objects than that, goes through the front in a
# worker process: the front's cost on the loop grows with the bytes (about 7 ms at 128 KiB of
# prose) and with the objects (messages, tool schemas: 4,000 tiny messages, 32 KiB, took
# 40-60 ms). Below both it costs the loop a few milliseconds at most, less than the round
# trip to a worker.
OFF_PROCESS_BYTES = 128 * 1024
OFF_PROCESS_OBJECTS = 256  # counted as "{" bytes, those in strings too: an overestimate
# A value of the body that serializes to more than this comes back from the worker as JSON.
LIGHT_BYTES = 256
# Top-level values the loop reads or edits whatever their size (upstream_body adds usage to a
# stream's options): they come back as values, never as JSON.
LOOP_READS = frozenset({"stream_options"})
WORKERS = 2


class Labels(Protocol):
    """What the front tells a request's record as it learns it (`kvgate.exchange.Exchange`):
    a request refused midway is labelled by what was known."""

    model: str
    tenant_name: str


@dataclass(frozen=True, slots=True)
class Front:
    """A request past the front: as it will be counted and forwarded (normalized), whether
    normalization changed it (then it is forwarded serialized, not as the client's bytes), who
    sent it, its prefix fingerprint and its count."""

    parsed: ParsedRequest
    edited: bool
    tenant: TenantConfig
    fingerprint: str | None
    count: PromptCount


def allowed(serves: Callable[[str], bool], rt: Runtime, parsed: ParsedRequest,
            tenant: TenantConfig) -> None:
    """The tenant may use the model (403), and the model exists: the config names it, or a
    replica `serves` it (404)."""
    check_access(tenant, parsed.model)
    model = parsed.model
    if not rt.config.knows(model) and not serves(model):
        raise NotFound(f"the model {model!r} does not exist", code="model_not_found",
                       param="model")


@dataclass(frozen=True, slots=True)
class Taken:
    """What a worker process sends back: the parse's error; or the request (its large values
    as JSON bytes), prepared for the tenant when one was identified (normalized, then
    `prepared.request` is the request), and its count or the count's error."""

    error: KvgateError | None = None
    request: ParsedRequest | None = None
    prepared: Prepared | None = None
    count: PromptCount | None = None
    count_error: KvgateError | None = None
    rewritten: bool = False  # the gateway's model replaced the client's


class FrontStage:
    """Takes a body through the front, on the loop or in a worker process by its size. The
    processes start with the first large body (each loads the config's tokenizers) and stop
    with the app (`close`)."""

    def __init__(
        self, prompts: PromptStage, *, off_process_bytes: int = OFF_PROCESS_BYTES,
        off_process_objects: int = OFF_PROCESS_OBJECTS, workers: int = WORKERS,
    ) -> None:
        self.prompts = prompts
        self.off_process_bytes, self.off_process_objects = off_process_bytes, off_process_objects
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # the pool is made and replaced from threads
        self._config: tuple[Config, bytes, bytes] | None = None  # config, digest, pickle

    async def take(
        self,
        raw: bytes,
        endpoint: Endpoint,
        rt: Runtime,
        labels: Labels,
        identify: Callable[[], TenantConfig],
        allow: Callable[[ParsedRequest, TenantConfig], None],
        model: str | None = None,
    ) -> Front:
        """Parse (400), identify the tenant (401), `allow` it the model (403, 404), prepare and
        count the prompt; `labels` learn the model and the tenant as each is known, whatever
        is raised after. `model`: the model to serve it as, where the gateway
        rewrites the client's."""
        if len(raw) > self.off_process_bytes or raw.count(b"{") > self.off_process_objects:
            return await self._take_off_process(raw, endpoint, rt, labels, identify, allow, model)
        client = parse_body(raw, endpoint, rt.config.server.max_messages)
        as_sent = with_model(client, model)
        labels.model = as_sent.model
        tenant = identify()
        labels.tenant_name = tenant.name
        allow(as_sent, tenant)
        parsed, fingerprint = self.prompts.apply(as_sent, tenant, rt.config)
        count = await rt.catalog.count(parsed)
        return Front(parsed, parsed is not client, tenant, fingerprint, count)

    async def _take_off_process(
        self,
        raw: bytes,
        endpoint: Endpoint,
        rt: Runtime,
        labels: Labels,
        identify: Callable[[], TenantConfig],
        allow: Callable[[ParsedRequest, TenantConfig], None],
        model: str | None,
    ) -> Front:
        """`take`, its parse, preparation and count done by a worker process (for the tenant
        identified first: a body's own errors still come before the tenant's)."""
        tenant: TenantConfig | None = None
        denied: KvgateError | None = None
        try:
            tenant = identify()
        except KvgateError as exc:
            denied = exc
        taken = await self._off_process(raw, endpoint, rt.config, tenant, model)
        if taken.error is not None:
            raise taken.error
        assert taken.request is not None
        labels.model = taken.request.model
        if denied is not None:
            raise denied
        assert tenant is not None and taken.prepared is not None
        labels.tenant_name = tenant.name
        allow(taken.request, tenant)  # by its model: normalization leaves that as it was
        prepared = replace(taken.prepared, request=heavy(taken.request))
        self.prompts.took(prepared, tenant, rt.config)
        if taken.count_error is not None:
            raise taken.count_error
        assert taken.count is not None
        edited = prepared.edited or taken.rewritten
        return Front(prepared.request, edited, tenant, prepared.fingerprint, taken.count)

    async def _off_process(
        self, raw: bytes, endpoint: Endpoint, config: Config, tenant: TenantConfig | None,
        model: str | None,
    ) -> Taken:
        digest, blob = self._pickled(config)
        for attempt in (1, 2):
            try:
                # a submit may start a worker process (fork and exec) and always writes to
                # the executor's wake-up pipe: done from a thread, never on the loop
                submitted = await asyncio.to_thread(
                    self._submit, raw, endpoint, digest, blob, tenant, model
                )
                return await asyncio.wrap_future(submitted)
            except BrokenProcessPool:  # a worker died (killed, out of memory): start anew
                with self._lock:
                    self._pool = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _pickled(self, config: Config) -> tuple[bytes, bytes]:
        """The config as the workers get it, pickled once per config."""
        if self._config is None or self._config[0] is not config:
            blob = pickle.dumps(config)
            self._config = (config, hashlib.blake2b(blob, digest_size=16).digest(), blob)
        return self._config[1], self._config[2]

    def _submit(
        self, raw: bytes, endpoint: Endpoint, digest: bytes, blob: bytes,
        tenant: TenantConfig | None, model: str | None,
    ) -> Future[Taken]:
        """`take_off_process` handed to the workers (started on first use). In a thread."""
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn")
                )
            return self._pool.submit(
                take_off_process, raw, endpoint, digest, blob, tenant, model
            )

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


# In a worker process: the configs seen lately (by digest), each with its tokenizers loaded.
_CONFIGS: dict[bytes, tuple[Config, Catalog]] = {}
_LOOP: asyncio.AbstractEventLoop | None = None


def take_off_process(
    raw: bytes, endpoint: Endpoint, digest: bytes, blob: bytes, tenant: TenantConfig | None,
    model: str | None = None,
) -> Taken:
    """The front's work on a body, in a worker process: parse (as for `model`, where the
    gateway rewrites it), and for an identified tenant prepare and count the prompt; every
    large value of the request goes back as JSON."""
    config, catalog = _config(digest, blob)
    try:
        client = parse_body(raw, endpoint, config.server.max_messages)
    except KvgateError as exc:
        return Taken(error=exc)
    as_sent = with_model(client, model)
    rewritten = as_sent is not client
    keep = config.routing.sessions.conversation_messages
    if tenant is None:  # refused: the request is read for its model alone
        return Taken(request=lighten(as_sent, keep), rewritten=rewritten)
    prepared = prepare(as_sent, settings_for(config, as_sent.model, tenant))
    chars = config.normalization.fingerprints.preview_chars
    text = preview(prepared.request, chars) if prepared.fingerprint is not None else None
    light = lighten(prepared.request, keep)  # one object: pickled once for both fields
    sent_back = replace(prepared, request=light, system_preview=text)
    global _LOOP
    _LOOP = _LOOP or asyncio.new_event_loop()
    try:
        count = _LOOP.run_until_complete(catalog.count(prepared.request))
    except KvgateError as exc:
        return Taken(request=light, prepared=sent_back, count_error=exc, rewritten=rewritten)
    return Taken(request=light, prepared=sent_back, count=count, rewritten=rewritten)


def _config(digest: bytes, blob: bytes) -> tuple[Config, Catalog]:
    found = _CONFIGS.get(digest)
    if found is None:
        config: Config = pickle.loads(blob)
        previous = next(reversed(_CONFIGS.values()), None)
        found = (config, Catalog(config, previous[1] if previous else None))
        _CONFIGS[digest] = found
        while len(_CONFIGS) > 2:
            del _CONFIGS[next(iter(_CONFIGS))]
    return found


def lighten(parsed: ParsedRequest, keep_messages: int) -> ParsedRequest:
    """The request with each value of its body that serializes to more than LIGHT_BYTES as
    those bytes: at the top level and in each message. The contents of the first
    `keep_messages` messages stay values when they are arrays of parts (a session key hashes
    them with sorted keys; a text content hashes the same as its JSON)."""
    body: dict[str, Any] = {}
    for key, value in parsed.body.items():
        if key == "messages" and isinstance(value, list):
            body[key] = [
                {k: v if k == "content" and isinstance(v, list) and i < keep_messages
                 else _light(v) for k, v in m.items()} if isinstance(m, dict) else _light(m)
                for i, m in enumerate(value)
            ]
        elif key in LOOP_READS:
            body[key] = value
        else:
            body[key] = _light(value)
    return replace(parsed, body=body)


def _light(value: Any) -> Any:
    if isinstance(value, str | list | dict):
        encoded = orjson.dumps(value)
        if len(encoded) > LIGHT_BYTES:
            return encoded
    return value


def heavy(parsed: ParsedRequest) -> ParsedRequest:
    """A request from a worker process as the loop keeps it: each value sent as JSON bytes
    becomes an `orjson.Fragment`, serialized as those bytes and never parsed here."""
    body: dict[str, Any] = {}
    for key, value in parsed.body.items():
        if key == "messages" and isinstance(value, list):
            body[key] = [{k: _fragment(v) for k, v in m.items()} if isinstance(m, dict)
                         else _fragment(m) for m in value]
        else:
            body[key] = _fragment(value)
    return replace(parsed, body=body)


def _fragment(value: Any) -> Any:
    return orjson.Fragment(value) if isinstance(value, bytes) else value
