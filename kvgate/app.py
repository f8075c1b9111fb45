"""Builds the aiohttp application from a config: wires the stages, starts the background
tasks (discovery, queue dispatchers, lease renewal, gauges), and reloads on demand.

Config reaches every stage one way: as the immutable snapshot `gateway.runtime`
(`kvgate.runtime`). A request takes it at its start and passes it down; background stages and
the state every request shares read the one in force through `gateway.current`. A reload
loads the new snapshot, swaps it in, and acts only where a change needs an action: the
replica registry, dispatchers for new pools, a new upstream connection pool, forgotten circuits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.stage import Admission
from kvgate.api.admin import admin_middleware
from kvgate.api.routes import GATEWAY, add_routes, errors_middleware
from kvgate.config import Config, ConfigError, UpstreamConfig, secret
from kvgate.fleet.discovery import discovery_loop, first_round_within
from kvgate.fleet.dns import dns_loop
from kvgate.fleet.drain import watch_drains
from kvgate.fleet.health import STATE_VALUE, Breakers
from kvgate.fleet.inference_pool import inference_pools_loop
from kvgate.fleet.kv_events import KvEvents, kv_events_loop
from kvgate.fleet.replicas import Registry
from kvgate.fleet.snapshot import BASES
from kvgate.fleet.view import FleetView
from kvgate.gateway import Gateway
from kvgate.intervals import Sleep
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from kvgate.request.calibration import Calibration, Terms
from kvgate.request.front import FrontStage
from kvgate.request.tokens import TokenizerError
from kvgate.routing.plugin import Deps
from kvgate.routing.router import Router
from kvgate.routing.sessions import Sessions
from kvgate.runtime import Runtime
from kvgate.state.base import StateStore
from kvgate.tenants import Budgets
from kvgate.transport.http import HttpTransport

if TYPE_CHECKING:
    from kvgate.epp.server import EppServer

log = logging.getLogger(__name__)

GAUGE_INTERVAL_S = 1.0
TASKS = web.AppKey("tasks", list)
RELOADING = web.AppKey("reloading", asyncio.Lock)  # one reload at a time
EPP = web.AppKey("epp", object)  # the endpoint picker's gRPC server, where it listens


def build_store(config: Config) -> StateStore:
    from kvgate.state.factory import build_store as factory

    state = config.state
    return factory(
        backend=state.backend,
        redis_url=secret(state.redis_url),
        key_prefix=state.key_prefix,
        failure_mode=state.failure_mode,
        timeout_s=state.timeout_s,
    )


def build_app(
    config: Config,
    store: StateStore | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> web.Application:
    """The whole gateway for one config. Tokenizers load here: a bad one raises
    TokenizerError before anything listens. `clock` and `sleep`: the time the lease keeper
    dates leases and times its renewals on (a test passes time it moves, with a MemoryStore on
    the same clock)."""
    app = web.Application(
        middlewares=[errors_middleware, admin_middleware],
        client_max_size=config.server.max_body_bytes,
    )
    runtime = Runtime.load(config)
    metrics = Metrics()
    registry = Registry()
    sync_registry(registry, config)
    store = store if store is not None else build_store(config)

    def current() -> Config:  # the gateway's, built below: whatever runtime is in force then
        return gateway.runtime.config

    keeper = LeaseKeeper(
        store,
        current,
        on_dropped=lambda kind: metrics.leases_dropped.labels(kind).inc(),
        clock=clock,
        sleep=sleep,
    )
    admission = Admission(store, metrics, current, keeper)
    sessions = Sessions(store, metrics)
    prompts = PromptStage(metrics)
    kv_events = KvEvents(metrics)
    breakers = Breakers(
        current,
        on_change=lambda replica, state: log.warning("replica %s: circuit %s", replica, state),
    )
    gateway = Gateway(
        runtime=runtime,
        current=current,
        registry=registry,
        admission=admission,
        budgets=Budgets(store, metrics, keeper),
        prompts=prompts,
        front=FrontStage(prompts),
        store=store,
        metrics=metrics,
        calibration=Calibration(),
        router=Router(Deps(sessions, breakers, metrics, kv_events)),
        breakers=breakers,
        view=FleetView(registry, admission, breakers),
        kv_events=kv_events,
    )
    app[GATEWAY] = gateway
    app[RELOADING] = asyncio.Lock()
    add_routes(app, admin=config.server.admin.port is None)
    app.cleanup_ctx.append(_services)
    return app


async def _services(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    config, current = gateway.current(), gateway.current
    gateway.connect(HttpTransport(client_session(config.upstream)))
    start = getattr(gateway.store, "start", None)
    if start is not None:
        await start()
    discovered = asyncio.Event()
    tasks = [
        _task(discovery_loop(
            lambda: gateway.http.session if gateway.http else None, gateway.registry, current,
            lambda: gateway.admission.after_discovery(gateway.registry), discovered,
        )),
        _task(dns_loop(gateway.registry, current)),
        _task(inference_pools_loop(gateway.registry, current)),
        _task(kv_events_loop(gateway.kv_events, gateway.registry, current)),
        _task(watch_drains(gateway.store, gateway.registry, current)),
        _task(gateway.admission.keeper.run()),
        _task(gateway.admission.ledger.grow()),
        _task(gateway.admission.ledger.reconcile(lambda: [r.id for r in gateway.registry])),
        _task(gateway.store.watch_releases(lambda _pool: gateway.admission.wake_all())),
        _task(_refresh_gauges(gateway)),
        *(_task(gateway.admission.dispatch(pool)) for pool in config.pools),
    ]
    app[TASKS] = tasks
    # Serve once the replicas are known (or the first round timed out): a request that came
    # before would find no replica serving its model, and be told the model does not exist.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(discovered.wait(), first_round_within(config.discovery))
    epp = await _start_epp(app, config)
    try:
        yield
    finally:
        if epp is not None:
            await epp.stop(config.server.drain_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gateway.front.close()
        if gateway.http is not None:
            await gateway.http.close()
        await gateway.store.close()


async def _start_epp(app: web.Application, config: Config) -> EppServer | None:
    """Envoy's endpoint picker, where `server.epp.port` is set (`kvgate.epp`)."""
    if config.server.epp.port is None:
        return None
    from kvgate.epp.server import EppServer  # gRPC and Envoy's protobufs: only when used
    from kvgate.epp.tls import certificate

    epp_config = config.server.epp
    tls = (await asyncio.to_thread(certificate, epp_config.tls, epp_config.host)
           if epp_config.tls.enabled else None)  # fmt: skip

    epp = app[EPP] = EppServer(app[GATEWAY], epp_config, tls)
    await epp.start()
    log.info("kvgate endpoint picker (Envoy ext_proc) listening on %s", epp.address)
    return epp


def _task(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """A background task that says so if it dies: a dead dispatcher would leave its pool's
    requests waiting until they time out."""
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(_report_death)
    return task


def _report_death(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("background task %s died", task.get_coro(), exc_info=task.exception())


async def _refresh_gauges(gateway: Gateway) -> None:
    """Per-replica and store gauges, computed off the request path once a second, from the
    fleet as routing sees it (the ledger's figures are read back by its own loop)."""
    m = gateway.metrics
    exported: set[tuple[str, str]] = set()
    while True:
        config = gateway.current()
        fleet = gateway.fleet(config)
        present = {(view.id, view.pool) for view in fleet}
        for replica_id, pool in exported - present:  # left the fleet: no stale series
            m.forget_replica(replica_id, pool)
        exported = present
        ids = {view.id for view in fleet}
        gateway.breakers.forget(ids)
        gateway.admission.backpressure.forget(ids)
        for view in fleet:
            labels = (view.id, view.pool)
            total, admissible = view.num_gpu_blocks, view.admissible_blocks
            m.healthy.labels(view.id).set(1 if view.healthy else 0)
            m.circuit_state.labels(view.id).set(STATE_VALUE[view.circuit])
            m.draining.labels(view.id).set(1 if view.draining else 0)
            m.blocks_reserved.labels(*labels).set(view.reserved_blocks)
            m.blocks_written.labels(*labels).set(view.written_blocks)
            if total is not None and admissible is not None:
                m.blocks_total.labels(*labels).set(total)
                m.blocks_admissible.labels(*labels).set(admissible)
                for basis in BASES:
                    headroom = view.headroom_requests(basis)
                    if headroom is not None:
                        m.headroom.labels(*labels, basis).set(headroom)
            age = view.scrape_age_s if view.scrape_age_s is not None else math.inf
            m.scrape_age.labels(view.id).set(age)
            usage = view.kv_usage if view.kv_usage is not None else math.nan
            m.vllm_kv_usage.labels(view.id).set(usage)
            hit_rate = view.prefix_hit_rate if view.prefix_hit_rate is not None else math.nan
            m.prefix_cache_hit_ratio.labels(view.id).set(hit_rate)
            scrape = view.replica.scrape
            if view.scraped and scrape is not None:
                m.vllm_waiting.labels(view.id).set(view.waiting or 0)
                m.vllm_running.labels(view.id).set(view.running or 0)
                for counter, figure in (
                    (m.vllm_preemptions, scrape.preemptions),
                    (m.vllm_prefix_queried, scrape.prefix_queries),
                    (m.vllm_prefix_hit, scrape.prefix_hits),
                ):
                    m.mirror(counter, (view.id,), figure or 0)
                if total and view.kv_usage is not None:
                    m.ledger_divergence.labels(view.id).set(
                        view.kv_usage - view.written_blocks / total
                    )
        _store_gauges(gateway)
        gateway.prompts.export(config)  # the prompt fingerprints' gauges
        _calibration_gauges(gateway, config)
        await asyncio.sleep(GAUGE_INTERVAL_S)


def _calibration_gauges(gateway: Gateway, config: Config) -> None:
    """The fits' gauges, with the other gauges once a second (off the request path: a fit
    refits on every 16th observation, its error moves on each)."""
    m, calibration = gateway.metrics, gateway.calibration
    for model, endpoint, _ in calibration.items():
        m.calibration.labels(model).set(calibration.ratio(model))
        terms = calibration.terms(model, endpoint, Terms(), config.calibration)
        for name, value in zip(("ratio", "per_message", "per_request"), terms.vector(),
                               strict=True):  # fmt: skip
            m.calibration_terms.labels(model, endpoint, name).set(value)
        error = calibration.error(model, endpoint)
        if error is not None:
            m.token_estimate_error.labels(model, endpoint).set(error)


def _store_gauges(gateway: Gateway) -> None:
    store, m = gateway.store, gateway.metrics
    backend = store.backend
    m.store_up.labels(backend).set(1 if getattr(store, "up", True) else 0)
    latency = getattr(store, "last_latency_s", None)
    if isinstance(latency, int | float):
        m.store_latency.labels(backend).set(latency)
    for counter, attribute in (
        (m.store_errors, "errors"),
        (m.store_fallback_calls, "fallback_calls"),
        (m.store_outage_seconds, "outage_seconds"),
        (m.store_reconciled_units, "reconciled_units"),
        (m.store_round_trips, "round_trips"),
        (m.store_calls, "calls"),
    ):
        value = getattr(store, attribute, None)
        if isinstance(value, int | float):
            m.mirror(counter, (backend,), value)


def sync_registry(registry: Registry, config: Config) -> None:
    """The registry follows the config's pools: listed replicas, and which pools find more
    (by DNS, or from an InferencePool)."""
    pools = config.pools
    registry.sync({name: pool.replicas for name, pool in pools.items()},
                  found={name for name, pool in pools.items() if pool.found_by is not None})


def client_session(upstream: UpstreamConfig) -> aiohttp.ClientSession:
    """The pooled HTTP client towards the replicas."""
    connector = aiohttp.TCPConnector(
        limit=upstream.max_connections,
        limit_per_host=upstream.max_connections_per_replica,
        keepalive_timeout=upstream.keepalive_s,
    )
    # No cookie jar: one client serves every tenant's requests, and a jar would send a cookie
    # one answer set along with everyone's requests after it (and parse each answer for them).
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    )


# Settings read once, when the process starts; a reload that changes them says so.
RESTART_ONLY = (
    "server.host", "server.port", "server.drain_s", "state",
    # the listeners' own limits (the body's read timeout follows a reload; the header's does not)
    "server.max_connections", "server.client_timeout_s", "server.admin.host", "server.admin.port",
    "server.epp",
)


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The restart-only settings that differ between two configs, as dotted paths."""
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    changed = []
    for path in RESTART_ONLY:
        a, b = before, after
        for key in path.split("."):
            a, b = a[key], b[key]
        if a != b:
            changed.append(path)
    return changed


async def reload(app: web.Application, load: Callable[[], Config]) -> bool:
    """Load the config again (`load` re-reads the file and applies the command line). A bad
    file — or one whose tokenizers or plugins do not load — is refused (logged) and the old
    config stays. Otherwise its snapshot replaces the old one: requests in flight finish
    under the snapshot they started with, new ones and the background stages read the new
    one. Every setting takes effect, except those in RESTART_ONLY: the log names any of them
    that changed. The file, its tokenizers and its chat templates are read in a thread, not
    on the loop that serves requests; reloads run one at a time, in the order asked."""
    async with app[RELOADING]:
        gateway = app[GATEWAY]
        old = gateway.runtime
        try:
            runtime = await asyncio.to_thread(lambda: Runtime.load(load(), previous=old))
        except (ConfigError, TokenizerError) as exc:
            log.error("config reload refused, keeping the old config:\n%s", exc)
            gateway.metrics.config_reloads.labels("refused").inc()
            return False
        install(app, old, runtime)
        return True


def install(app: web.Application, old: Runtime, runtime: Runtime) -> None:
    """`runtime` replaces `old` for new requests and the background stages."""
    gateway = app[GATEWAY]
    config = runtime.config
    gateway.runtime = runtime
    # what only an action can change: which replicas there are, and what follows from that
    sync_registry(gateway.registry, config)
    gateway.breakers.forget({r.id for r in gateway.registry})
    tasks = app.get(TASKS)
    if config.upstream != old.config.upstream and gateway.http is not None:
        # a new pool of connections for new requests; the old one closes once the requests
        # using it can have finished
        retiring = gateway.connect(HttpTransport(client_session(config.upstream)))
        if tasks is not None and retiring is not None:
            tasks.append(_task(_retire(retiring, old.config.timeouts.total_s)))
    if tasks is not None:
        known = set(gateway.admission.pools())
        for pool in config.pools:
            if pool not in known:
                tasks.append(_task(gateway.admission.dispatch(pool)))
    gateway.metrics.config_reloads.labels("ok").inc()
    pending = restart_only_changes(old.config, config)
    if pending:
        log.warning("config reloaded; these settings take effect only after a restart: %s",
                    ", ".join(pending))
    else:
        log.info("config reloaded")


async def _retire(transport: HttpTransport, after_s: float) -> None:
    try:
        await asyncio.sleep(after_s)
    finally:
        await transport.close()
