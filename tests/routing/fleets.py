"""Fleet snapshots made by hand for the router's unit tests: no server, no store."""

from __future__ import annotations

from kvgate.config import AdmissionConfig, ReplicaConfig
from kvgate.demand import Demand
from kvgate.replicas import Replica, Scrape
from kvgate.routing.fleet import Fleet, take_snapshot
from kvgate.routing.route import Route


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
) -> Fleet:
    return take_snapshot(
        replicas,
        config=AdmissionConfig(target_utilization=1.0),
        stale_after_s=1e13,
        reserved=reserved or {},
        shared_prefix_blocks=lambda rid: 0,
        circuit=lambda rid: (circuits or {}).get(rid, "closed"),
        overcommit=lambda rid: 1.0,
        now=1e12,
    )


def route(
    tokens: int = 160,
    *,
    session: str | None = None,
    prefix: str | None = None,
    model: str = "m",
    exclude: frozenset[str] = frozenset(),
) -> Route:
    demand = Demand("p", model, tokens, "t", "standard")
    return Route(demand, session_key=session, prefix=prefix, exclude=exclude)
