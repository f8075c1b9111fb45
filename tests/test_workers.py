"""`kvgate serve --workers N`: N processes on one port over Redis, one /metrics for all, and
the configurations it refuses."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.commands.serve import workers_refusal
from kvgate.workers import default_workers, merge
from tests.plugins.gateway import gateway_config
from tests.plugins.processes import chat, free_port, wait_ready

EXPOSITION = """# HELP kvgate_requests_total Requests finished.
# TYPE kvgate_requests_total counter
kvgate_requests_total{outcome="ok"} {n}
# HELP kvgate_state_store_up 1 when the state store answers.
# TYPE kvgate_state_store_up gauge
kvgate_state_store_up{backend="redis"} 1.0
"""


def test_merged_metrics_label_every_sample_with_its_worker_and_parse_as_one_exposition():
    text = merge({0: EXPOSITION.replace("{n}", "3.0"), 1: EXPOSITION.replace("{n}", "5.0")})
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    requests = families["kvgate_requests"]
    assert requests.type == "counter"
    by_worker = {s.labels["worker"]: s.value for s in requests.samples if s.name.endswith("_total")}
    assert by_worker == {"0": 3.0, "1": 5.0}
    assert {s.labels["worker"] for s in families["kvgate_state_store_up"].samples} == {"0", "1"}


def test_several_workers_need_the_shared_store_and_a_fixed_port():
    memory = gateway_config(["http://127.0.0.1:9"])
    assert "state.backend: redis" in (workers_refusal(memory, 2) or "")
    assert workers_refusal(memory, 1) is None
    assert default_workers("memory") == 1
    assert default_workers("redis") >= 1


async def workers_with_a_healthy_replica(url: str, timeout_s: float = 20.0) -> set[str]:
    """Until every worker reports the replica healthy in the merged scrape (or time runs out):
    the workers that do."""
    deadline = time.monotonic() + timeout_s
    workers: set[str] = set()
    async with aiohttp.ClientSession() as http:
        while workers != {"0", "1"} and time.monotonic() < deadline:
            async with http.get(f"{url}/metrics") as response:
                text = await response.text()
            workers = {
                s.labels.get("worker", "")
                for f in text_string_to_metric_families(text) for s in f.samples
                if f.name == "kvgate_replica_healthy" and s.value == 1
            }  # fmt: skip
            await asyncio.sleep(0.2)
    return workers


async def test_two_workers_serve_one_port_and_one_scrape_shows_both(
    start_kvgate, stub_factory, redis_url
):
    stub = await stub_factory()
    port = free_port()
    kvgate = await start_kvgate("--upstream", stub.url, "--redis", redis_url,
                                "--port", str(port), "--workers", "2")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url)
    # the scrape shows every worker's own figures, whichever worker answers it: wait until
    # both workers have found the replica (a chat may land on either)
    assert await workers_with_a_healthy_replica(url) == {"0", "1"}
    for _ in range(8):
        status, _, _ = await chat(url)
        assert status == 200
    assert "kvgate: 2 workers" in kvgate.log or "2 workers" in kvgate.log
    assert await kvgate.stop() == 0
