"""The gauges /metrics shows that no request sets: per replica, the store's, the prompt
fingerprints' and the calibration's, computed off the request path once a second from the
fleet as routing sees it."""

from __future__ import annotations

import asyncio
import math

from kvgate.config import Config
from kvgate.fleet.health import STATE_VALUE
from kvgate.fleet.snapshot import BASES
from kvgate.gateway import Gateway
from kvgate.metrics import Metrics
from kvgate.metrics.families import Counter
from kvgate.request.calibration import Terms
from kvgate.state.base import CountsCalls, FallsBack, StateStore

GAUGE_INTERVAL_S = 1.0


async def refresh_gauges(gateway: Gateway, store: StateStore) -> None:
    """Per-replica and store gauges, computed off the request path once a second, from the
    fleet as routing sees it (the ledger's figures are read back by its own loop)."""
    m = gateway.metrics
    exported: set[tuple[str, str]] = set()
    while True:
        config = gateway.current()
        fleet = gateway.view.take(config)
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
        _store_gauges(store, m)
        gateway.front.prompts.export(config)  # the prompt fingerprints' gauges
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


def _store_gauges(store: StateStore, m: Metrics) -> None:
    backend = store.backend
    figures: list[tuple[Counter, float]] = []
    if isinstance(store, CountsCalls):
        figures += [(m.store_round_trips, store.round_trips), (m.store_calls, store.calls)]
    if isinstance(store, FallsBack):
        m.store_latency.labels(backend).set(store.last_latency_s)
        figures += [
            (m.store_errors, store.errors), (m.store_fallback_calls, store.fallback_calls),
            (m.store_outage_seconds, store.outage_seconds),
            (m.store_reconciled_units, store.reconciled_units),
        ]
    m.store_up.labels(backend).set(0 if isinstance(store, FallsBack) and not store.up else 1)
    for counter, value in figures:
        m.mirror(counter, (backend,), value)
