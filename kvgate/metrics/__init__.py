"""Every Prometheus metric kvgate exports, declared in one place, by subsystem (documented in
docs/metrics.md; a test checks the two agree). One `Metrics` per application, each with its
own registry: no global state, so several gateways can run in one process (as tests do).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, generate_latest

from kvgate.fleet.snapshot import BASES
from kvgate.metrics.families import (
    BLOCK_BUCKETS,
    ERROR_BUCKETS,
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
    Counter,
    Gauge,
    Histogram,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._requests(r)
        self._replicas(r)
        self._prediction(r)
        self._fleet(r)
        self._routing(r)
        self._calibration(r)
        self._store(r)
        self._prompts(r)
        self._mirrored: dict[tuple[int, tuple[str, ...]], float] = {}

    def _requests(self, r: CollectorRegistry) -> None:
        """Requests as they finish or are refused, the queue, admissions."""
        self.requests = Counter(
            "kvgate_requests", "Requests finished, by outcome (ok, client_error, refused, "
            "upstream_error, disconnected).", ["model", "pool", "tenant", "outcome"], registry=r,
        )
        self.client_refusals = Counter(
            "kvgate_client_refusals", "Connections and requests refused before they reached "
            "the request path: too_many_connections, invalid_request (malformed HTTP), "
            "request_header_fields_too_large.", ["reason"], registry=r,
        )
        self.refusals = Counter(
            "kvgate_refusals", "Requests kvgate answered itself with an error, by reason.",
            ["pool", "tenant", "reason"], registry=r,
        )
        self.queue_depth = Gauge(
            "kvgate_queue_depth", "Requests waiting for KV capacity.", ["pool", "priority"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds", "Time spent waiting for KV capacity (admitted or not).",
            ["pool", "priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait_with_room = Histogram(
            "kvgate_queue_wait_with_room_seconds", "Of a queued request's wait, the time a "
            "replica it could use had room for it (held back for fair order): near zero while "
            "admission conserves work.", ["pool", "priority"], buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.wait_estimate_error = Histogram(
            "kvgate_queue_wait_estimate_error_seconds", "For each queued request placed, its "
            "wait less the wait estimated when it queued (positive: it started later than "
            "estimated); what refusals against a latency target are corrected by.",
            ["pool", "priority"], buckets=ERROR_BUCKETS, registry=r,
        )
        self.work_conserving = Counter(
            "kvgate_work_conserving_admissions", "Requests the ledger had no room for, "
            "started because the replica's own vLLM figures said it could run them now.",
            ["pool", "replica"], registry=r,
        )
        self.admissions = Counter(
            "kvgate_admissions", "Requests admitted onto a replica's block ledger.",
            ["pool", "replica", "queued"], registry=r,
        )

    def _replicas(self, r: CollectorRegistry) -> None:
        """Each replica's blocks on the ledger, and vLLM's own figures as scraped."""
        self.blocks_total = Gauge(
            "kvgate_replica_capacity_blocks", "KV blocks in the replica's pool (num_gpu_blocks).",
            ["replica", "pool"], registry=r,
        )
        self.blocks_reserved = Gauge(
            "kvgate_replica_reserved_blocks", "Blocks reserved for in-flight requests' worst "
            "case, by every kvgate instance sharing the ledger (the same on each instance).", ["replica", "pool"], registry=r,
        )
        self.blocks_written = Gauge(
            "kvgate_replica_written_blocks", "Blocks holding tokens already computed (prompt + "
            "generated so far) for THIS instance's in-flight requests: sum over instances.", ["replica", "pool"],
            registry=r,
        )
        self.blocks_admissible = Gauge(
            "kvgate_replica_admissible_blocks", "Ledger limit: target_utilization × blocks.",
            ["replica", "pool"], registry=r,
        )
        self.vllm_kv_usage = Gauge(
            "kvgate_replica_vllm_kv_usage_ratio", "vLLM's own kv_cache_usage_perc, as scraped "
            "(NaN when stale).", ["replica"], registry=r,
        )
        self.vllm_waiting = Gauge(
            "kvgate_replica_vllm_waiting_requests", "vLLM's num_requests_waiting, as scraped.",
            ["replica"], registry=r,
        )
        self.vllm_running = Gauge(
            "kvgate_replica_vllm_running_requests", "vLLM's num_requests_running, as scraped.",
            ["replica"], registry=r,
        )
        self.vllm_preemptions = Counter(
            "kvgate_replica_vllm_preemptions", "vLLM's num_preemptions_total, as scraped "
            "(mirrored: a replica restart counts on from zero).", ["replica"], registry=r,
        )
        self.vllm_prefix_queried = Counter(
            "kvgate_replica_vllm_prefix_cache_queried_tokens", "vLLM's prefix_cache_queries_total "
            "(prompt tokens looked up), as scraped.", ["replica"], registry=r,
        )
        self.vllm_prefix_hit = Counter(
            "kvgate_replica_vllm_prefix_cache_hit_tokens", "vLLM's prefix_cache_hits_total "
            "(prompt tokens found cached), as scraped.", ["replica"], registry=r,
        )
        self.scrape_age = Gauge(
            "kvgate_replica_scrape_age_seconds", "Age of the last good scrape of the replica's "
            "/metrics (+Inf before the first); figures older than discovery.stale_after_s are "
            "not used.", ["replica"], registry=r,
        )
        self.ledger_divergence = Gauge(
            "kvgate_replica_ledger_divergence_ratio", "vLLM's reported usage minus this "
            "instance's written-blocks ratio, in [-1, 1]. Positive: blocks kvgate does not see "
            "(other instances, direct traffic, cached blocks in use). Negative: kvgate counts "
            "more than vLLM holds (prefixes vLLM stores once, preempted requests, an estimate "
            "running ahead).", ["replica"], registry=r,
        )

    def _prediction(self, r: CollectorRegistry) -> None:
        """Overcommit, predicted reservations, headroom, and leases dropped."""
        self.overcommit = Gauge(
            "kvgate_replica_overcommit_ratio", "How far predicted reservations may fill the "
            "replica's admissible blocks (AIMD on its preemptions and usage; 1 is the plain "
            "limit).", ["replica", "pool"], registry=r,
        )
        self.reservation_growths = Counter(
            "kvgate_reservation_growths", "Predicted reservations grown because the answer "
            "outran its prediction.", ["pool"], registry=r,
        )
        self.length_predictions = Counter(
            "kvgate_length_predictions", "Answer lengths predicted for predicted-mode "
            "reservations, by the history that answered: shape, shape_any_tenant, "
            "tenant_budget, budget, model, fleet, or prior (nothing known yet).",
            ["pool", "source"], registry=r,
        )
        self.headroom = Gauge(
            "kvgate_replica_headroom_requests", "How many more requests of the pool's recent "
            "p95 size fit on the replica's ledger now, by basis: predicted (the predicted-mode "
            "limit, admissible × overcommit, less what is reserved, over the p95 of recent "
            "predicted reservations) or worst_case (the admissible blocks less what is "
            "reserved, over the p95 of recent worst cases). In worst_case mode both agree.",
            ["replica", "pool", "basis"], registry=r,
        )
        self.leases_dropped = Counter(
            "kvgate_leases_dropped", "Leases this instance held longer than their request may "
            "run, logged and released as leaked, by kind (ledger, concurrency). Should stay 0.",
            ["kind"], registry=r,
        )

    def _fleet(self, r: CollectorRegistry) -> None:
        """Health, circuits, drains and retries; vLLM's KV cache events and busy answers."""
        self.healthy = Gauge(
            "kvgate_replica_healthy", "1 when the last discovery succeeded.", ["replica"],
            registry=r,
        )
        self.circuit_state = Gauge(
            "kvgate_replica_circuit_state", "The replica's circuit breaker: 0 closed, 1 half "
            "open (one trial request), 2 open (ejected after consecutive failures).",
            ["replica"], registry=r,
        )
        self.draining = Gauge(
            "kvgate_replica_draining", "1 while the replica takes no new requests (drain).",
            ["replica"], registry=r,
        )
        self.upstream_retries = Counter(
            "kvgate_upstream_retries", "Requests sent to another replica after theirs failed "
            "before any byte reached the client, by reason.", ["pool", "reason"], registry=r,
        )
        self.kv_events = Counter(
            "kvgate_kv_events", "KV cache events read from each replica's vLLM, by kind "
            "(stored, removed, cleared; unknown kinds and unreadable batches).",
            ["replica", "kind"], registry=r,
        )
        self.kv_events_lag = Gauge(
            "kvgate_kv_events_lag_seconds", "Wall-clock seconds between the replica publishing "
            "its latest batch of KV cache events and kvgate applying it.", ["replica"],
            registry=r,
        )
        self.kv_events_gaps = Counter(
            "kvgate_kv_events_gaps", "Gaps in a replica's KV cache events: a sequence number "
            "skipped (filled by a replay where it can be), or batches no longer in its replay "
            "buffer.", ["replica"], registry=r,
        )
        self.kv_events_resets = Counter(
            "kvgate_kv_events_resets", "Times a replica's block index was emptied and read "
            "again: its sequence numbers went back (an engine restart), it failed its health "
            "check, its prompts missed its cache while it published nothing, or its "
            "subscription was made again.",
            ["replica", "reason"],
            registry=r,
        )
        self.kv_index_orphans = Counter(
            "kvgate_kv_index_orphan_blocks", "Blocks a replica stored under a parent its block "
            "index never saw (its chain began before a kvgate restart or a reset, beyond what "
            "the replay still held): left out of matching, so a prompt under them routes by "
            "fingerprint instead.", ["replica"], registry=r,
        )
        self.kv_index_blocks = Gauge(
            "kvgate_kv_index_blocks", "Distinct blocks the replica's KV cache events say it "
            "holds.", ["replica"], registry=r,
        )
        self.replica_rejections = Counter(
            "kvgate_replica_admission_rejections", "Requests a replica's vLLM refused as busy "
            "(503 at its queue limits), by vLLM's reason: sent elsewhere or queued again, never "
            "a circuit-breaker failure.", ["replica", "reason"], registry=r,
        )

    def _routing(self, r: CollectorRegistry) -> None:
        """Session and prefix routing, request sizes and times, tenants' budgets."""
        self.session_routes = Counter(
            "kvgate_session_routes", "Requests with a session key, by result (hit, new, "
            "rebound) and reason.", ["result", "reason"], registry=r,
        )
        self.prefix_routes = Counter(
            "kvgate_prefix_routes", "Requests with a prefix key, by where they ran: preferred "
            "(the prefix's replica under its bounded load) or elsewhere.", ["pool", "result"],
            registry=r,
        )
        self.worst_case_blocks = Histogram(
            "kvgate_request_worst_case_blocks", "Worst-case KV blocks per admitted request.",
            ["pool"], buckets=BLOCK_BUCKETS, registry=r,
        )
        self.efficiency = Histogram(
            "kvgate_reservation_efficiency_ratio", "Blocks actually used ÷ blocks reserved, "
            "at completion.", ["pool"], buckets=RATIO_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds", "Time from arrival at kvgate to the first streamed token.",
            ["pool", "model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds", "Time from arrival to the end of the response.",
            ["pool", "model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tenant_tokens = Counter(
            "kvgate_tenant_tokens", "Tokens per tenant: reserved (charged up front), refunded, "
            "prompt and completion (actual).", ["tenant", "kind"], registry=r,
        )
        self.tenant_concurrency = Gauge(
            "kvgate_tenant_concurrent_requests", "This instance's in-flight requests per tenant.",
            ["tenant"], registry=r,
        )
        self.tenant_remaining_tokens = Gauge(
            "kvgate_tenant_remaining_tokens", "Tokens left in the tenant's per-minute bucket "
            "after its last request.", ["tenant"], registry=r,
        )

    def _calibration(self, r: CollectorRegistry) -> None:
        """The token count's calibration against vLLM's."""
        self.calibration = Gauge(
            "kvgate_tokenizer_calibration_ratio", "vLLM's prompt_tokens ÷ kvgate's estimate, "
            "recent mean over the model's endpoints (1 is exact).", ["model"], registry=r,
        )
        self.calibration_terms = Gauge(
            "kvgate_tokenizer_calibration_terms", "The fitted estimate of vLLM's prompt_tokens: "
            "term is ratio (per text token), per_message or per_request.",
            ["model", "endpoint", "term"], registry=r,
        )
        self.calibration_floored = Counter(
            "kvgate_calibration_floored", "Estimates where the fit would have counted more "
            "than max_undercount_tokens below the raw count (tokenizer plus template "
            "overhead), so the raw count was used.", ["model", "endpoint"], registry=r,
        )
        self.calibration_outliers = Counter(
            "kvgate_calibration_outliers", "vLLM prompt_tokens counts left out of the fit: more "
            "than outlier_factor away from the estimate.", ["model", "endpoint"], registry=r,
        )
        self.token_estimate_error = Gauge(
            "kvgate_tokenizer_estimate_error_ratio", "Recent mean of (estimate − vLLM's "
            "prompt_tokens) ÷ prompt_tokens; negative means kvgate under-counts.",
            ["model", "endpoint"], registry=r,
        )

    def _store(self, r: CollectorRegistry) -> None:
        """The state store, and config reloads."""
        self.store_up = Gauge(
            "kvgate_state_store_up", "1 when the state store answers.", ["backend"], registry=r,
        )
        self.store_latency = Gauge(
            "kvgate_state_store_latency_seconds", "Last measured round trip to the store.",
            ["backend"], registry=r,
        )
        self.store_errors = Counter(
            "kvgate_state_store_errors", "Store calls that failed.", ["backend"], registry=r,
        )
        self.store_fallback_calls = Counter(
            "kvgate_state_store_fallback_calls", "Calls served from local memory while the "
            "store was down (fail_open).", ["backend"], registry=r,
        )
        self.store_outage_seconds = Counter(
            "kvgate_state_store_outage_seconds", "Time spent with the store down.", ["backend"],
            registry=r,
        )
        self.store_reconciled_units = Counter(
            "kvgate_state_store_reconciled_units", "Budget units (tokens or requests, as the "
            "bucket counts) used locally during outages and charged to the shared store when it "
            "returned.", ["backend"], registry=r,
        )
        self.store_round_trips = Counter(
            "kvgate_state_store_round_trips", "Round trips to the shared store (one pipeline "
            "carries every call made in one turn of the event loop).", ["backend"], registry=r,
        )
        self.store_calls = Counter(
            "kvgate_state_store_calls", "Calls to the shared store (one atomic script each), "
            "sent in the round trips counted by kvgate_state_store_round_trips_total.",
            ["backend"], registry=r,
        )
        self.config_reloads = Counter(
            "kvgate_config_reloads", "SIGHUP reloads, by result (ok, refused).", ["result"],
            registry=r,
        )

    def _prompts(self, r: CollectorRegistry) -> None:
        """Prompt normalization and system-prompt fingerprints (kvgate/normalize/)."""
        self.normalization_requests = Counter(
            "kvgate_normalization_requests", "Requests the normalizer saw, by result (modified, "
            "unchanged): the share modified is modified / (modified + unchanged).", ["result"],
            registry=r,
        )
        self.normalization_edits = Counter(
            "kvgate_normalization_edits", "Edits by normalization rule: texts, tool definitions "
            "or schemas changed, messages moved or merged, values relocated.", ["rule"],
            registry=r,
        )
        self.normalization_changed_bytes = Counter(
            "kvgate_normalization_changed_bytes", "Bytes of prompt the rule changed: removed "
            "or added, the span that differs when only the order changed, or moved.", ["rule"], registry=r,
        )
        self.normalization_changed_tokens = Counter(
            "kvgate_normalization_changed_tokens", "Estimated tokens the rule changed (changed "
            "bytes / 4).", ["rule"], registry=r,
        )
        self.normalization_relocations = Counter(
            "kvgate_normalization_relocations", "Values moved out of the system prompt, by "
            "configured pattern.", ["pattern"], registry=r,
        )
        self.fingerprint_requests = Gauge(
            "kvgate_prompt_fingerprint_requests", "Requests per prefix fingerprint (tools and "
            "system prompt) in the fingerprint window: the top N, the rest as \"other\".",
            ["fingerprint"], registry=r,
        )
        self.tenant_fingerprints = Gauge(
            "kvgate_prompt_fingerprints", "Distinct prefix fingerprints a tenant sent in the "
            "fingerprint window.", ["tenant"], registry=r,
        )
        self.system_prompt_changes = Counter(
            "kvgate_system_prompt_changes", "A tenant's system prompt (or tools) changed to a "
            "fingerprint it had not sent in the window.", ["tenant", "model"], registry=r,
        )
        self.prefix_cache_hit_ratio = Gauge(
            "kvgate_replica_prefix_cache_hit_ratio", "vLLM's prefix-cache hits ÷ queries (in "
            "tokens) since the replica started, as scraped (NaN when stale or unknown).",
            ["replica"], registry=r,
        )

    def mirror(self, counter: Counter, labels: tuple[str, ...], total: float) -> None:
        """Advance `counter` to a cumulative figure kept elsewhere (a store's error count,
        a replica's vLLM counter). A figure that went down was reset (a restart): it counts
        on from zero, as Prometheus' rate() expects of a counter."""
        key = (id(counter), labels)
        last = self._mirrored.get(key, 0.0)
        step = total - last if total >= last else total
        child = counter.labels(*labels)
        if step > 0:
            child.inc(step)
        self._mirrored[key] = total

    def forget_replica(self, replica: str, pool: str) -> None:
        """Remove every per-replica series of a replica that left the fleet."""
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", None)
            if not names or "replica" not in names:
                continue
            for basis in BASES:  # the only other label a per-replica gauge has
                values = {"replica": replica, "pool": pool, "basis": basis}
                if set(names) <= values.keys():
                    with contextlib.suppress(KeyError):
                        metric.remove(*(values[n] for n in names))

    def render(self) -> bytes:
        return generate_latest(self.registry)
