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
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from kvgate.admission.leases import LeaseKeeper
from kvgate.admission.stage import Admission
from kvgate.api.admin import admin_middleware
from kvgate.api.gauges import refresh_gauges
from kvgate.api.routes import GATEWAY, add_routes, errors_middleware
from kvgate.config import Config, ConfigError, UpstreamConfig, secret
from kvgate.fleet.discovery import discovery_loop, first_round_within
from kvgate.fleet.dns import dns_loop
from kvgate.fleet.drain import watch_drains
from kvgate.fleet.health import Breakers
from kvgate.fleet.inference_pool import inference_pools_loop
from kvgate.fleet.kv_events import KvEvents, kv_events_loop
from kvgate.fleet.replicas import Registry
from kvgate.fleet.view import FleetView
from kvgate.gateway import Gateway
from kvgate.intervals import Sleep
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from kvgate.request.calibration import Calibration
from kvgate.request.front import FrontStage
from kvgate.request.tokenizers import TokenizerError
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

TASKS: web.AppKey[list[asyncio.Task[Any]]] = web.AppKey("tasks")
RELOADING = web.AppKey("reloading", asyncio.Lock)  # one reload at a time
STORE = web.AppKey("store", StateStore)  # closed last: every stage gives its holds back through it
# the endpoint picker's gRPC server, where it listens (gRPC is imported only then)
EPP: web.AppKey[EppServer] = web.AppKey("epp")


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
    kv_events = KvEvents(metrics)
    breakers = Breakers(
        current,
        on_change=lambda replica, state: log.warning("replica %s: circuit %s", replica, state),
    )
    front = FrontStage(PromptStage(metrics))
    gateway = Gateway(
        runtime=runtime,
        current=current,
        registry=registry,
        admission=admission,
        budgets=Budgets(store, metrics, keeper),
        front=front,
        metrics=metrics,
        calibration=Calibration(),
        router=Router(Deps(sessions, breakers, metrics, kv_events)),
        breakers=breakers,
        view=FleetView(registry, admission, breakers),
        kv_events=kv_events,
    )
    app[GATEWAY], app[STORE] = gateway, store
    app[RELOADING] = asyncio.Lock()
    add_routes(app, admin=config.server.admin.port is None)
    # each resource starts in this order and stops in the reverse one
    app.cleanup_ctx.extend([_store, _upstream, _workers, _background, _picker])
    return app


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    """The pooled connections to the replicas (a reload may replace them: `install`)."""
    gateway = app[GATEWAY]
    gateway.connect(HttpTransport(client_session(gateway.current().upstream)))
    try:
        yield
    finally:
        if gateway.http is not None:
            await gateway.http.close()


async def _store(app: web.Application) -> AsyncIterator[None]:
    """The state store, closed last: every stage above gives its holds back through it."""
    try:
        yield
    finally:
        await app[STORE].close()


async def _workers(app: web.Application) -> AsyncIterator[None]:
    """The front's worker processes (started with the first large body)."""
    try:
        yield
    finally:
        app[GATEWAY].front.close()


async def _background(app: web.Application) -> AsyncIterator[None]:
    """Discovery and what follows the fleet, the ledger's loops, the gauges and each pool's
    dispatcher; serving starts once the replicas are known (or the first round timed out): a
    request that came before would find no replica serving its model, and be told the model
    does not exist."""
    gateway, store = app[GATEWAY], app[STORE]
    config, current = gateway.current(), gateway.current
    discovered = asyncio.Event()
    tasks = [
        _task(discovery_loop(
            lambda: gateway.http.session if gateway.http else None, gateway.registry, current,
            lambda: gateway.admission.after_discovery(gateway.registry), discovered,
        )),
        _task(dns_loop(gateway.registry, current)),
        _task(inference_pools_loop(gateway.registry, current)),
        _task(kv_events_loop(gateway.kv_events, gateway.registry, current)),
        _task(watch_drains(store, gateway.registry, current)),
        _task(gateway.admission.keeper.run()),
        _task(gateway.admission.ledger.grow()),
        _task(gateway.admission.ledger.reconcile(lambda: [r.id for r in gateway.registry])),
        _task(store.watch_releases(lambda _pool: gateway.admission.wake_all())),
        _task(refresh_gauges(gateway, store)),
        *(_task(gateway.admission.dispatch(pool)) for pool in config.pools),
    ]
    app[TASKS] = tasks
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(discovered.wait(), first_round_within(config.discovery))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _picker(app: web.Application) -> AsyncIterator[None]:
    """Envoy's endpoint picker, where `server.epp.port` is set; it drains first."""
    config = app[GATEWAY].current()
    epp = await _start_epp(app, config)
    try:
        yield
    finally:
        if epp is not None:
            await epp.stop(config.server.drain_s)


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
