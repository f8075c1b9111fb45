"""vLLM's Prometheus metrics for one simulated replica, on a registry of its own.

Names, types and labels follow vLLM V1 (see /work/shared/vllm-reference.md §1): every series
carries `model_name` and `engine` (its data-parallel rank, "0" by default), except `vllm:cache_config_info`, which carries the cache
configuration as labels and no `model_name`. Gauges and the engine's counters are read from
the engine when scraped; histograms and `vllm:request_success_total` are observed as tokens
and requests finish. Times are simulated seconds. tests/conformance/test_metrics.py checks
the names, types, labels, buckets and help strings against the installed vLLM's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.sim.admission import REASONS as ADMISSION_REASONS
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.reports import StepResult, TokenOutput
from kvgate.sim.request import FinishReason, SimRequest

LABELS = ("model_name", "engine")
VLLM_ONLY_FINISH_REASONS = ("error", "repetition")

# vLLM's bucket bounds (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                        40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                     8192.0, 16384.0)  # fmt: skip


def one_two_five_buckets(limit: int) -> list[float]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(float(value))
        exponent += 1


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, config: SimConfig, engine: Engine, created: float) -> None:
        self._config = config
        self._engine = engine
        self._created = created
        self._labels = [config.served_model_name, str(config.data_parallel_rank)]

    def collect(self) -> Iterator[Metric]:
        engine, labels, stats = self._engine, self._labels, self._engine.stats
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             len(engine.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             len(engine.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             engine.pool.usage()),
        )  # fmt: skip
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        yield self._cache_config_info()
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             stats.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             stats.generation_tokens),
        )  # fmt: skip
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=LABELS)
            counter.add_metric(labels, float(value), created=self._created)
            yield counter

    def _cache_config_info(self) -> GaugeMetricFamily:
        cfg = self._config
        # vLLM's labels are its CacheConfig's fields, which change between releases: these are
        # a subset of the installed vLLM's, with its values (tests/conformance checks both).
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto" if cfg.kv_dtype_bytes == 2 else "fp8",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": str(cfg.data_parallel_rank),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "is_attention_free": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "num_gpu_blocks_override": "None" if cfg.model_preset else str(cfg.num_gpu_blocks),
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
        }
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        gauge.add_metric(list(info.values()), 1.0)
        return gauge


# key: (name, help, buckets); None = 1-2-5 buckets up to max_model_len (token counts).
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...] | None]] = {
    "ttft": ("vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", REQUEST_TIME_BUCKETS),
    "queue": ("vllm:request_queue_time_seconds",
              "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS),
    "prefill": ("vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS),
    "decode": ("vllm:request_decode_time_seconds",
               "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS),
    "inference": ("vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS),
    "prompt_tokens": ("vllm:request_prompt_tokens",
                      "Number of prefill tokens processed.", None),
    "generation_tokens": ("vllm:request_generation_tokens",
                          "Number of generation tokens processed.", None),
    "max_tokens": ("vllm:request_params_max_tokens",
                   "Histogram of the max_tokens request parameter.", None),
    "iteration_tokens": ("vllm:iteration_tokens_total",
                         "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS),
}  # fmt: skip


class SimMetrics:
    """The metrics of one engine's lifetime; a restarted replica gets a new one."""

    def __init__(self, config: SimConfig, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(config, engine, time.time()))
        values = (config.served_model_name, str(config.data_parallel_rank))
        sizes = tuple(one_two_five_buckets(config.max_model_len))
        self._h = {
            key: Histogram(
                name, doc, LABELS, registry=self.registry, buckets=buckets or sizes
            ).labels(*values)
            for key, (name, doc, buckets) in HISTOGRAMS.items()
        }
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._success = {reason: success.labels(*values, reason.value) for reason in FinishReason}
        # vLLM starts with a series for each of its finish reasons; the simulator never
        # finishes a request with these two.
        for reason in VLLM_ONLY_FINISH_REASONS:
            success.labels(*values, reason)
        # counted by the API server, not an engine: `model_name` and `reason`, no `engine`
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._rejections = {
            reason: rejections.labels(config.served_model_name, reason)
            for reason in ADMISSION_REASONS
        }

    def observe_admission_rejection(self, reason: str) -> None:
        self._rejections[reason].inc()

    def observe_step(self, result: StepResult) -> None:
        self._h["iteration_tokens"].observe(result.num_prefill_tokens + result.num_decode_seqs)

    def observe_token(self, output: TokenOutput) -> None:
        request = output.request
        if output.index == 0 and request.first_token_time is not None:
            self._h["ttft"].observe(request.first_token_time - request.arrival_time)
        elif output.inter_token_s is not None:
            self._h["itl"].observe(output.inter_token_s)

    def observe_finished(self, request: SimRequest) -> None:
        reason = request.finish_reason
        assert reason is not None
        self._success[reason].inc()
        end, scheduled = request.finished_time, request.first_scheduled_time
        first = request.first_token_time
        if reason is FinishReason.ABORT or end is None or scheduled is None or first is None:
            return
        h = self._h
        h["e2e"].observe(end - request.arrival_time)
        h["queue"].observe(scheduled - request.arrival_time)
        h["prefill"].observe(first - scheduled)
        h["decode"].observe(end - first)
        h["inference"].observe(end - scheduled)
        h["prompt_tokens"].observe(request.num_prompt_tokens)
        h["generation_tokens"].observe(request.num_output_tokens)
        h["max_tokens"].observe(request.max_tokens)
