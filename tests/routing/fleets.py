"""Fleet snapshots made by hand for the router's unit tests: no server; what the plugins
use (`deps`) over the in-memory store; and a ranker that needs no router for admission's."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.admission.demand import Demand
from kvgate.admission.stage import Admission, Ranker
from kvgate.config import AdmissionConfig, Config, ReplicaConfig, parse_config
from kvgate.fleet.block_index import BlockIndex
from kvgate.fleet.health import Breakers
from kvgate.fleet.kv_events import KvEvents
from kvgate.fleet.kv_subscriber import ReplicaEvents
from kvgate.fleet.kv_wire import Event
from kvgate.fleet.replicas import Replica
from kvgate.fleet.scrape import Scrape
from kvgate.fleet.snapshot import Fleet, take_snapshot
from kvgate.fleet.view import FleetView
from kvgate.metrics import Metrics
from kvgate.routing.plugin import Deps
from kvgate.routing.ranking import Ranking
from kvgate.routing.route import Route
from kvgate.routing.sessions import Sessions
from kvgate.state.memory import MemoryStore

CONFIG: Config = parse_config({"pools": {"p": {"replicas": [{"url": "http://a:8000"}]}}})


def deps(
    store: MemoryStore | None = None,
    metrics: Metrics | None = None,
    breakers: Breakers | None = None,
) -> Deps:
    metrics = metrics or Metrics()
    return Deps(
        Sessions(store or MemoryStore(), metrics), breakers or Breakers(lambda: CONFIG), metrics
    )


def replica(
    name: str,
    *,
    pool: str = "p",
    blocks: int = 1000,
    healthy: bool = True,
    model: str = "m",
    max_model_len: int | None = None,
    waiting: float | None = None,
    drain: bool = False,
) -> Replica:
    r = Replica(
        ReplicaConfig(url=f"http://{name}:8000", name=name, num_gpu_blocks=blocks, block_size=16,
                      max_model_len=max_model_len, drain=drain),
        pool=pool, healthy=healthy, models=frozenset({model}),
    )
    if waiting is not None:
        r.scrape = Scrape(at=1e12, waiting=waiting)
    return r


def fleet(
    *replicas: Replica,
    reserved: dict[str, int] | None = None,
    circuits: dict[str, str] | None = None,
    busy: frozenset[str] = frozenset(),
) -> Fleet:
    return take_snapshot(
        replicas,
        config=AdmissionConfig(target_utilization=1.0),
        stale_after_s=1e13,
        reserved=reserved or {},
        shared_prefix_blocks=lambda rid: 0,
        circuit=lambda rid: (circuits or {}).get(rid, "closed"),
        overcommit=lambda rid: 1.0,
        busy=busy.__contains__,
        now=1e12,
    )


def route(
    tokens: int = 160,
    *,
    session: str | None = None,
    prefix: str | None = None,
    model: str = "m",
    exclude: frozenset[str] = frozenset(),
    holder: str | None = None,
) -> Route:
    demand = Demand("p", model, tokens, "t", "standard")
    return Route(demand, session_key=session, prefix=prefix, exclude=exclude, holder=holder)


def in_order(admission: Admission, replicas: Sequence[Replica]) -> Ranker:
    """A ranker that tries `replicas` in the order given, each as the fleet view shows it at
    the attempt, under the config in force."""
    view = FleetView(replicas, admission)

    async def rank(waited_s: float) -> Ranking:
        return Ranking(list(view.take(admission.current())))

    return rank


def indexed(held: dict[str, list[int]]) -> KvEvents:
    """KV events whose index for each replica holds the blocks of the given token ids (block
    size 16, as the fleets' replicas)."""
    events = KvEvents(Metrics())
    for replica_id, tokens in held.items():
        state = events.states[replica_id] = ReplicaEvents(BlockIndex(10_000))
        state.sequencer.last = 0  # it has heard from the replica: its index is trusted
        if tokens:
            state.index.apply(Event("stored", tuple(range(len(tokens) // 16)), None,
                                    tuple(tokens[: len(tokens) // 16 * 16]), 16))
    return events


DOCUMENT = list(range(1000, 1000 + 16 * 8))  # eight blocks
