"""A replica that runs several data-parallel engines behind one server (vLLM's
`--data-parallel-size`: one API server, an engine per rank, each with its own KV cache and its
KV events at the ports + its rank). kvgate subscribes to every rank its /metrics names, counts
the replica as holding what its deepest rank holds, and pins a request to the rank that holds
its prompt with vLLM's `X-data-parallel-rank`; where no rank holds more, vLLM balances.

The replica here is two simulated engines, ranks 0 and 1, behind a front that does what vLLM's
API server does with them: a request goes to the rank its header names, else to the ranks in
turn; /metrics is both engines' series, each engine's cache config carrying the server's total
blocks, as vLLM's does."""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.fleet.block_index import block_keys
from kvgate.sim.server import SimReplica
from tests.plugins import client
from tests.plugins.gateway import gateway_config, serve_app
from tests.plugins.kv_events import SIM_CHATML
from tests.plugins.kv_events import document_chat as chat
from tests.plugins.processes import free_port
from tests.plugins.waiting import eventually

SIM = {"time_scale": 0.001, "num_gpu_blocks": 512, "max_model_len": 2048}


class DataParallelFront:
    """One server in front of its ranks' engines: what each request was pinned to, and the
    rank that served it."""

    def __init__(self, ranks: list[SimReplica]) -> None:
        self.ranks = ranks
        self.turns = itertools.cycle(range(len(ranks)))
        self.served: list[tuple[str | None, int]] = []  # (the header, the rank)
        self.session = aiohttp.ClientSession()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def forward(self, request: web.Request) -> web.Response:
        pinned = request.headers.get("X-data-parallel-rank")
        work = request.method == "POST" and request.path.startswith("/v1/")
        rank = int(pinned) if pinned is not None else next(self.turns) if work else 0
        if work:
            self.served.append((pinned, rank))
        async with self.session.request(
            request.method, self.ranks[rank].url + request.path_qs, data=await request.read(),
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as answer:
            return web.Response(status=answer.status, body=await answer.read(),
                                content_type=answer.content_type)

    async def metrics(self, request: web.Request) -> web.Response:
        families: dict[str, Any] = {}
        for replica in self.ranks:
            async with self.session.get(replica.url + "/metrics") as answer:
                for family in text_string_to_metric_families(await answer.text()):
                    if family.name in families:
                        families[family.name].samples.extend(family.samples)
                    else:
                        families[family.name] = family
        # as vLLM's API server: every engine's cache config carries the server's total blocks
        info = families["vllm:cache_config_info"]
        total = sum(int(sample.labels["num_gpu_blocks"]) for sample in info.samples)
        info.samples = [sample._replace(labels={**sample.labels, "num_gpu_blocks": str(total)})
                        for sample in info.samples]  # fmt: skip
        registry = CollectorRegistry()
        registry.register(type("Both", (), {"collect": lambda self: families.values()})())
        return web.Response(body=generate_latest(registry), content_type="text/plain")


def events_config(port: int, replay_port: int) -> str:
    return ('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
            f'"endpoint": "tcp://*:{port}", "replay_endpoint": "tcp://*:{replay_port}"}}')


async def test_each_rank_is_followed_and_a_request_is_pinned_to_the_rank_holding_its_prompt(
    sim_factory, gateway_factory
):
    port, replay_port = free_port(2), free_port(2)
    ranks = [await sim_factory(**SIM, kv_events_config=events_config(port, replay_port),
                               data_parallel_rank=rank) for rank in (0, 1)]
    front = DataParallelFront(ranks)
    runner, url = await serve_app(front.app())
    try:
        gw = await gateway_factory(gateway_config(
            [], pools={"default": {"replicas": [{"url": url, "name": "dp"}],
                                   "kv_events": {"port": port, "replay_port": replay_port}}},
            models=[SIM_CHATML],
        ))
        events = gw.gateway.kv_events
        async with aiohttp.ClientSession() as http:
            async def post(target: str, body: dict[str, Any], **headers: str) -> None:
                status, _, raw = await client.post(f"{target}/v1/chat/completions", body,
                                                   http=http, headers=headers)
                assert status == 200, raw

            warm = iter(range(100, 10_000))

            async def listening() -> bool:  # each rank's first batch starts its index
                for stream, replica in (("dp", ranks[0]), ("dp/dp1", ranks[1])):
                    if events.index(stream) is None:
                        await post(replica.url, chat(next(warm), "warm up"))
                return events.index("dp") is not None and events.index("dp/dp1") is not None

            await eventually(listening, timeout_s=10, what="both ranks' indexes")

            async def holds(stream: str, document: int) -> bool:
                counter = gw.gateway.runtime.catalog.counter("sim-model")
                ids = (await counter.count_chat(chat(document, "x")["messages"])).token_ids
                index = events.index(stream)
                assert ids is not None and index is not None
                return index.leading(block_keys(ids, 16)) >= 20

            # document 1 was read on rank 1, document 2 on rank 0 (before kvgate saw them)
            await post(ranks[1].url, chat(1, "Summarize."))
            await post(ranks[0].url, chat(2, "Summarize."))
            for stream, document in (("dp/dp1", 1), ("dp", 2)):
                await eventually(lambda s=stream, d=document: holds(s, d), timeout_s=5,
                                 what=f"document {document} in {stream}'s index")
            front.served.clear()
            hits_before = [r.engine.stats.prefix_cache_hits for r in ranks]
            await post(gw.url, chat(1, "What is clause 7?"))
            await post(gw.url, chat(2, "What is clause 8?"))
            # a document no rank holds: vLLM balances; and a client's own pin is not sent on
            await post(gw.url, chat(3, "Summarize."), **{"X-data-parallel-rank": "1"})
            assert front.served[:2] == [("1", 1), ("0", 0)]
            assert front.served[2][0] is None
            hits = [r.engine.stats.prefix_cache_hits for r in ranks]
            assert all(after > before for after, before in zip(hits, hits_before, strict=True))

            async with http.get(f"{gw.url}/admin/replicas") as response:
                (listing,) = (await response.json())["replicas"]
            assert listing["prefix_source"] == "kv_events"
            assert set(listing["kv_events"]["ranks"]) == {"0", "1"}
            assert all(r["subscribed"] for r in listing["kv_events"]["ranks"].values())
            async with http.get(f"{gw.url}/metrics") as response:
                exposition = await response.text()
            assert 'replica="dp/dp1"' in exposition
    finally:
        await front.session.close()
        await runner.cleanup()
