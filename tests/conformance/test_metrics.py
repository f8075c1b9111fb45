"""The simulator's `/metrics` against vLLM's own metric definitions, not a list written by hand.

vLLM's side is its real `PrometheusStatLogger` (vllm/v1/metrics/loggers.py), built for the
simulator's configuration with `log_engine_initialized()` (which adds `vllm:cache_config_info`),
and served by vLLM's own `/metrics` route (`attach_router`,
vllm/entrypoints/serve/instrumentator/metrics.py). The simulator's side is an HTTP scrape of a
running replica. Both texts go through prometheus_client's parser, so a family is named as the
parser names it: a counter without `_total`, a histogram with its `_bucket`/`_sum`/`_count`
series inside, and each `_created` series folded into the family it belongs to.

vLLM registers its metrics on prometheus_client's global REGISTRY; the fixture moves them to a
registry of its own and leaves none behind, so the module can run again in the same process.

vLLM metrics the simulator does not expose are `ABSENT` below, each with why it is not needed;
a new vLLM release that adds one fails `test_vllm_metrics_the_simulator_lacks_are_known` until
it is added there (or to the simulator, if kvgate reads it or a dashboard uses it).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from conformance.vllm_setup import EngineShape, vllm_config
from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from vllm.config import VllmConfig
from vllm.entrypoints.serve.instrumentator import metrics as vllm_metrics_route
from vllm.v1.metrics.buckets import build_1_2_5_buckets
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from kvgate.fleet.scrape import Scrape, parse_vllm_metrics
from kvgate.sim.metrics import one_two_five_buckets
from kvgate.sim.server import SimReplica
from tests.plugins.sim import SimFactory

SHAPE = EngineShape()
# aiohttp's default, which kvgate's discovery sends; vLLM's route answers the same to any.
ACCEPT = {"Accept": "*/*"}
# Its labels are the fields of vLLM's CacheConfig (`CacheConfig.metrics_info`), which change
# from release to release: the simulator carries a subset, with vLLM's values.
INFO = "vllm:cache_config_info"

ROOT = Path(__file__).resolve().parents[2]
# Files that query vLLM's series by name: dashboards and rules, and the fleet benchmark.
QUERIERS = [
    *(p for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file()),
    *sorted((ROOT / "bench" / "fleetbench").glob("*.py")),
    ROOT / "kvgate" / "tools" / "dashboard.py",
]

# Names kvgate's scraper still accepts from older vLLM versions (vllm-reference.md §1), with
# the current name of each. The installed vLLM cannot vouch for these; it can say they are gone.
DEPRECATED = {
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
}

# vLLM's metrics the simulator does not expose: kvgate does not read them and no dashboard or
# rule in deploy/ uses them.
ABSENT = {
    # features the simulator does not model
    "vllm:engine_sleep_state": "sleep mode",
    "vllm:external_prefix_cache_queries": "KV connector",
    "vllm:external_prefix_cache_hits": "KV connector",
    "vllm:mm_cache_queries": "multi-modal inputs",
    "vllm:mm_cache_hits": "multi-modal inputs",
    "vllm:request_params_n": "n > 1",
    "vllm:estimated_flops_per_gpu": "performance model",
    "vllm:estimated_read_bytes_per_gpu": "performance model",
    "vllm:estimated_write_bytes_per_gpu": "performance model",
    # breakdowns and per-request figures the simulator could derive but nobody reads
    "vllm:num_requests_waiting_by_reason": "breakdown of num_requests_waiting",
    "vllm:prompt_tokens_by_source": "breakdown of prompt_tokens",
    "vllm:prompt_tokens_cached": "local + external prefix hits",
    "vllm:prompt_tokens_cached_by_source": "breakdown of prefix_cache_hits",
    "vllm:request_max_num_generation_tokens": "per-request figure",
    "vllm:request_time_per_output_token_seconds": "per-request figure",
    "vllm:request_num_preemptions": "per-request figure",
    "vllm:request_prefill_kv_computed_tokens": "per-request figure",
}


@dataclass(frozen=True)
class Family:
    """One metric family as prometheus_client's text parser reads it."""

    type: str
    help: str
    labels: frozenset[str]  # label names, `le` left out
    series: frozenset[frozenset[tuple[str, str]]]  # the label sets of its series, `le` left out
    buckets: tuple[float, ...] | None  # a histogram's upper bounds, +Inf left out
    created: bool  # prometheus_client's `_created` series come with it


def families(text: str) -> dict[str, Family]:
    """The `vllm:` families of an exposition, by the parser's family name."""
    parsed = [f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")]
    names = {f.name for f in parsed}
    out: dict[str, Family] = {}
    for family in parsed:
        stem = family.name.removesuffix("_created")
        if stem != family.name and stem in names:
            continue
        series = frozenset(
            frozenset((k, v) for k, v in s.labels.items() if k != "le") for s in family.samples
        )
        bounds = {
            float(s.labels["le"])
            for s in family.samples
            if s.name == family.name + "_bucket" and s.labels["le"] != "+Inf"
        }
        out[family.name] = Family(
            type=family.type,
            help=family.documentation,
            labels=frozenset(k for labels in series for k, _ in labels),
            series=series,
            buckets=tuple(sorted(bounds)) if family.type == "histogram" else None,
            created=family.name + "_created" in names,
        )
    return out


def series_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def by_family(text: str) -> dict[str, str]:
    """The `vllm:` families of an exposition, each as an exposition of its own (a block begins
    with its HELP line), by the parser's family name."""
    blocks = re.split(r"(?m)^(?=# HELP )", text)
    return {
        family.name: block
        for block in blocks if block.startswith("# HELP vllm:")
        for family in text_string_to_metric_families(block)
    }  # fmt: skip


def read_by_kvgate(text: str) -> dict[str, frozenset[str]]:
    """Family name -> the `Scrape` fields kvgate's scraper fills from that family alone."""
    empty = Scrape(at=0.0)
    read = {}
    for name, block in by_family(text).items():
        scrape = parse_vllm_metrics(block, at=0.0)
        filled = frozenset(
            f.name for f in dataclasses.fields(Scrape)
            if getattr(scrape, f.name) != getattr(empty, f.name)
        )  # fmt: skip
        if filled:
            read[name] = filled
    return read


@dataclass(frozen=True)
class Exposition:
    content_type: str
    text: str

    @property
    def families(self) -> dict[str, Family]:
        return families(self.text)


def take_vllm_collectors(into: CollectorRegistry) -> None:
    """Move vLLM's collectors off prometheus_client's global REGISTRY, found as vLLM's own
    `unregister_vllm_metrics` (vllm/v1/metrics/prometheus.py) finds them."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("vllm:"):
            REGISTRY.unregister(collector)
            into.register(collector)


@pytest.fixture(scope="module")
def vllm_config_for_sim() -> VllmConfig:
    config = vllm_config(SHAPE)
    # The simulator's `num_gpu_blocks` plays vLLM's --num-gpu-blocks-override.
    config.cache_config.num_gpu_blocks_override = SHAPE.num_gpu_blocks
    return config


@pytest.fixture(scope="module")
def vllm(vllm_config_for_sim: VllmConfig) -> Exposition:
    """What vLLM's own /metrics route serves for the simulator's configuration."""
    unregister_vllm_metrics()  # what an earlier run in this process may have left
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(vllm_config_for_sim, engine_indexes=[0])
    logger.log_engine_initialized()
    take_vllm_collectors(registry)
    app = FastAPI()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_metrics_route, "get_prometheus_registry", lambda: registry)
        vllm_metrics_route.attach_router(app)
    with TestClient(app) as client:
        response = client.get("/metrics", headers=ACCEPT)
    assert response.status_code == 200
    return Exposition(response.headers["Content-Type"], response.text)


@pytest.fixture
async def sim(sim_factory: SimFactory, vllm_config_for_sim: VllmConfig) -> Exposition:
    """A scrape of a running simulated replica configured as `vllm` is, after one request."""
    replica: SimReplica = await sim_factory(
        num_gpu_blocks=SHAPE.num_gpu_blocks,
        block_size=SHAPE.block_size,
        max_model_len=SHAPE.max_model_len,
        max_num_seqs=SHAPE.max_num_seqs,
        max_num_batched_tokens=SHAPE.max_num_batched_tokens,
        enable_prefix_caching=SHAPE.enable_prefix_caching,
        gpu_memory_utilization=vllm_config_for_sim.cache_config.gpu_memory_utilization,
        served_model_name=vllm_config_for_sim.model_config.served_model_name,
        time_scale=0.001,
    )
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
        async with http.get(replica.url + "/metrics", headers=ACCEPT) as response:
            assert response.status == 200
            return Exposition(response.headers["Content-Type"], await response.text())


def labels_conform(name: str, ours: frozenset[str], theirs: frozenset[str]) -> bool:
    return ours <= theirs if name == INFO else ours == theirs


def test_the_simulator_answers_with_vllms_content_type(sim: Exposition, vllm: Exposition) -> None:
    assert sim.content_type == vllm.content_type


def test_every_family_the_simulator_exposes_is_vllms_with_its_type_and_label_names(
    sim: Exposition, vllm: Exposition
) -> None:
    theirs = vllm.families
    wrong = {}
    for name, ours in sim.families.items():
        if name not in theirs:
            wrong[name] = "not a vLLM metric"
        elif (ours.type, ours.created) != (theirs[name].type, theirs[name].created):
            wrong[name] = f"{ours.type} (created: {ours.created}), vLLM: {theirs[name].type}"
        elif not labels_conform(name, ours.labels, theirs[name].labels):
            wrong[name] = f"labels {sorted(ours.labels)}, vLLM: {sorted(theirs[name].labels)}"
    assert not wrong


def test_the_simulator_has_vllms_series_for_each_family(sim: Exposition, vllm: Exposition) -> None:
    """Same label values too: model_name, engine, and one series for each of vLLM's
    finished_reasons (vLLM creates them all at start)."""
    theirs = vllm.families
    ours = {name: f for name, f in sim.families.items() if name in theirs and name != INFO}
    assert {n: f.series for n, f in ours.items()} == {n: theirs[n].series for n in ours}


def test_cache_config_info_carries_vllms_values_for_the_labels_it_has(
    sim: Exposition, vllm: Exposition
) -> None:
    (ours,), (theirs,) = ([dict(s) for s in e.families[INFO].series] for e in (sim, vllm))
    assert "model_name" not in ours
    assert ours == {k: theirs[k] for k in ours}
    missing = sorted(set(theirs) - set(ours))
    print(f"{INFO} labels vLLM has and the simulator does not: {missing}")


def test_histograms_have_vllms_buckets_at_the_same_max_model_len(
    sim: Exposition, vllm: Exposition
) -> None:
    theirs = vllm.families
    ours = {n: f.buckets for n, f in sim.families.items() if f.type == "histogram"}
    assert ours
    assert ours == {n: theirs[n].buckets for n in ours}


@pytest.mark.parametrize("max_model_len", [1, 2, 999, 1000, 4096, 8192, 131072])
def test_token_count_buckets_follow_vllms_rule_at_any_max_model_len(max_model_len: int) -> None:
    assert one_two_five_buckets(max_model_len) == build_1_2_5_buckets(max_model_len)


def test_help_strings_are_vllms(sim: Exposition, vllm: Exposition) -> None:
    theirs = vllm.families
    ours = {n: f.help for n, f in sim.families.items() if n in theirs}
    assert ours == {n: theirs[n].help for n in ours}


def test_every_metric_kvgates_scraper_reads_is_vllms_and_the_simulators(
    sim: Exposition, vllm: Exposition
) -> None:
    """kvgate's scraper, fed vLLM's own exposition, fills every field of its Scrape, and reads
    each from the same family of the simulator's."""
    theirs = read_by_kvgate(vllm.text)
    every = {f.name for f in dataclasses.fields(Scrape)} - {"at"}
    assert set().union(*theirs.values()) == every
    ours = read_by_kvgate(sim.text)
    assert {n: ours.get(n) for n in theirs} == theirs
    print("kvgate reads, current names:", sorted(theirs))


def test_every_vllm_series_the_repo_queries_is_vllms_and_the_simulators(
    sim: Exposition, vllm: Exposition
) -> None:
    """The Prometheus rules in deploy/ and the fleet benchmark's scrape name series of both."""
    used = {
        name
        for path in QUERIERS
        for name in re.findall(r"vllm:[a-z_]+", path.read_text())
    }  # fmt: skip
    assert used
    assert used - series_names(vllm.text) == set()
    assert used - series_names(sim.text) == set()


def test_deprecated_names_kvgate_accepts_are_gone_from_vllm_and_the_simulator(
    sim: Exposition, vllm: Exposition
) -> None:
    """Each still read as its current name is, from an exposition that carries the old one."""
    assert not set(DEPRECATED) & (set(vllm.families) | set(sim.families))
    blocks = by_family(vllm.text)
    for old, current in DEPRECATED.items():
        renamed = blocks[current].replace(current, old)
        assert read_by_kvgate(renamed) == {old: read_by_kvgate(blocks[current])[current]}


def test_vllm_metrics_the_simulator_lacks_are_known(sim: Exposition, vllm: Exposition) -> None:
    lacking = set(vllm.families) - set(sim.families)
    assert lacking <= set(ABSENT), sorted(lacking - set(ABSENT))
    print("vLLM metrics the simulator does not expose:", sorted(lacking))
