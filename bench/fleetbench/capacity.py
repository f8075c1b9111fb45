"""What the fleet can serve of a workload, measured once by stepping the simulator's engine
offline: no sockets, no wall clock, the same engine, settings and prompts as the replicas.

Each pool's replica is handed its share of a long sample of the workload all at once (a normal
replica every third chat, as round robin would give it; the long replica every document) and
stepped until done. Its *saturated throughput* is the rate at which requests finished while a
queue stood, between the 10th and the 90th percentile of completions (the ramp-up and the
tail, when the batch empties, left out). The fleet's capacity is the arrival rate at which the
first pool saturates:

    capacity = min(pool replicas x saturated throughput / share of the workload's requests)

"1x load" is that rate; preemption and prefix-cache hits are in it, as the engine has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.engine import Engine
from kvgate.sim.options import output_tokens
from kvgate.sim.text import PromptEncoder
from kvgate.tools.workload import WorkItem

from .fleet import Replica, sim_config
from .workloads import Workload

SAMPLE_DURATION_S, SAMPLE_RATE = 240.0, 4.0  # ~960 requests


@dataclass(frozen=True, slots=True)
class PoolThroughput:
    pool: str
    replicas: int
    share: float  # of the workload's requests
    requests: int  # handed to one replica
    per_replica_per_s: float  # saturated completions per simulated second
    output_tokens_per_s: float  # per replica, saturated
    preemptions: int

    @property
    def capacity_per_s(self) -> float:
        """Arrivals per second (of the whole workload) that saturate this pool."""
        return self.replicas * self.per_replica_per_s / self.share if self.share else float("inf")


def estimate(workload: Workload, fleet: list[Replica], seed: int = 0) -> dict[str, Any]:
    items = workload.build(seed, SAMPLE_DURATION_S, SAMPLE_RATE)
    encoder = PromptEncoder(load_tiktoken())
    pools = []
    for pool, kind in (("default", "short"), ("long", "long")):
        members = [r for r in fleet if r.pool == pool]
        mine = [i for i in items if i.kind == kind]
        if not mine or not members:
            continue
        share = len(mine) / len(items)
        handed = mine[:: len(members)]
        per_s, tokens_per_s, preemptions = saturated_throughput(members[0], handed, encoder)
        pools.append(PoolThroughput(pool, len(members), share, len(handed), per_s,
                                    tokens_per_s, preemptions))  # fmt: skip
    bottleneck = min(pools, key=lambda p: p.capacity_per_s)
    return {
        "requests_per_s": round(bottleneck.capacity_per_s, 3),
        "bottleneck_pool": bottleneck.pool,
        "pools": [{"pool": p.pool, "replicas": p.replicas, "share": round(p.share, 3),
                   "sample_requests_per_replica": p.requests,
                   "saturated_requests_per_s_per_replica": round(p.per_replica_per_s, 3),
                   "saturated_output_tokens_per_s_per_replica": round(p.output_tokens_per_s),
                   "preemptions": p.preemptions,
                   "capacity_requests_per_s": round(p.capacity_per_s, 3)} for p in pools],
        "method": __doc__.split("\n\n")[1].replace("\n", " ").strip() if __doc__ else "",
        "sample": {"seed": seed, "duration_s": SAMPLE_DURATION_S, "rate_per_s": SAMPLE_RATE,
                   "requests": len(items)},
    }  # fmt: skip


def submit(engine: Engine, items: list[WorkItem], encoder: PromptEncoder) -> None:
    """Every item into the engine at time 0, as a replica would take it: its prompt, its
    max_tokens (none: the rest of the context) and, where the item sets it, its answer's
    length (X-Sim-Output-Tokens)."""
    for n, item in enumerate(items):
        prompt = encoder.encode_chat(item.body["messages"])
        engine.add_request(f"r{n}", prompt, item.body.get("max_tokens"), 0.0,
                           output_len=output_tokens(item.headers))  # fmt: skip


def saturated_throughput(replica: Replica, items: list[WorkItem], encoder: PromptEncoder,
                         ) -> tuple[float, float, int]:  # fmt: skip
    """(requests/s, output tokens/s, preemptions) of one replica given every item at once."""
    engine = Engine(sim_config(replica))
    submit(engine, items, encoder)
    now = 0.0
    done: list[float] = []
    tokens: list[tuple[float, int]] = []
    while engine.has_unfinished_requests():
        result = engine.step(now)
        if result.idle:
            raise RuntimeError(f"{replica.name}: the engine cannot schedule what is left")
        now = result.end_time
        done.extend(now for _ in result.finished)
        tokens.append((now, len(result.outputs)))
    first, last = len(done) // 10, (len(done) * 9) // 10
    lo, hi = done[first], done[last]
    if hi <= lo:
        return float("inf"), float("inf"), engine.stats.num_preemptions
    between = sum(n for t, n in tokens if lo < t <= hi)
    return (last - first) / (hi - lo), between / (hi - lo), engine.stats.num_preemptions



def first_token_s(engine: Engine, request_id: str, prompt: Sequence[int],
                  max_tokens: int | None = 1, output_len: int | None = None) -> float:  # fmt: skip
    """Simulated seconds from handing an idle `engine` a prompt to its first token: its
    chunked prefill alone. The request is then aborted, so the engine is idle again with its
    prefix cache kept."""
    engine.add_request(request_id, prompt, max_tokens, 0.0, output_len=output_len)
    now = 0.0
    while True:
        result = engine.step(now)
        if result.idle:
            raise RuntimeError(f"an idle engine did not schedule {request_id}")
        now = result.end_time
        if result.outputs:
            engine.abort(request_id, now)
            while engine.has_unfinished_requests():  # let the abort land
                engine.step(now)
            return now


def first_token_floor_s(replica: Replica, prompt_tokens: int) -> float:
    """`first_token_s` of a prompt of `prompt_tokens` on the replica, its cache empty: no
    gateway can start a request sooner there, so a TTFT target below it cannot be met
    whatever the admission."""
    return first_token_s(Engine(sim_config(replica)), "floor", range(1, prompt_tokens + 1))
