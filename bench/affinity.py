"""Prefix-cache hit rate of chats through kvgate's router, against round robin and vllm-router.

Two workloads (`--workload`):
- `chats` (the default): each chat opens with its own short document (`--doc-words`) under one
  short shared system prompt, then asks `--turns` questions, resending the whole history each
  turn as chat clients do.
- `rag`: a few dozen long documents (`--documents`, `--doc-words` each), each asked about by
  many users in chats of their own (`--chats` in all, starting at random over `--spread-s`;
  each picks a document at random and asks `--turns` questions), under one shared system prompt: every chat has the same fingerprint,
  so only what the replicas really cache can tell them apart.

`kvgate-events` is kvgate with the replicas' KV cache events (`pools.<name>.kv_events`) and
the simulator's chat template and markers (`config/sim-chatml.jinja`), so it knows each chat's
token ids and routes by the blocks each replica holds; `kvgate` routes by the fingerprint. Simulated replicas (real sockets, in this process) count their own prefix-cache hits; the
figure is theirs: vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the
fleet, read from each replica's /metrics. Contenders run on fresh replicas, in alternating
order, `--repeats` times; the ratio is taken within each repeat.

While the chats run through kvgate, the ledger of every replica is read at each admission and
every 10 ms. `over_bound` is the most the replica that took a request held, as it was
admitted, against what bounded load allows it, max((1 + load_factor) × the pool's reserved blocks / replicas,
load_floor × its admissible blocks, one request): 1.0 is exactly at the bound.
`over_bound_any_time` is the most any replica held in any 10 ms sample: it also counts what
happens after admission (predicted reservations growing with their answers, other replicas' requests
finishing), which no placement decision can see. The replicas' KV caches are small enough (1,024 blocks)
that the chats load them and the bound matters.

`vllm-router` (the Rust router from PyPI, `pip install -e '.[bench]'`) runs as a process in
front of the same simulated replicas with its cache_aware policy, when it is installed.

    .venv/bin/python bench/affinity.py [--workload chats|rag] [--documents 24] [--replicas 4]
        [--chats 128] [--turns 4] [--doc-words 60] [--repeats 3]
        [--contenders kvgate round_robin ...] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetbench.processes import free_port  # bench/ is on the path when run
from fleetbench.prompts import SIM_TOKENIZER

from kvgate.commands.demo import start_gateway
from kvgate.config import parse_config
from kvgate.fleet.scrape import parse_vllm_metrics
from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica

# The `routing:` section of each kvgate contender; "kvgate" is the shipped default (session,
# prefix, load; load_factor 0.25). None: not kvgate (vllm-router's cache_aware policy).
CONTENDERS: dict[str, dict[str, Any] | None] = {
    "kvgate": {},
    "kvgate-load_factor-1": {"load_factor": 1.0},
    "round_robin": {"scorers": {"round_robin": 1.0}},
    "least_loaded": {"scorers": {"least_loaded": 1.0}},
    "vllm-router-cache_aware": None,
    "kvgate-events": {},
    "kvgate-events-load_factor-1": {"load_factor": 1.0},
}
# kvgate contenders that read the replicas' KV cache events (and know the chats' token ids)
WITH_EVENTS = {"kvgate-events", "kvgate-events-load_factor-1"}
EVENTS = orjson.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                       "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}).decode()
BLOCK = 16
LARGEST_REQUEST_BLOCKS = 64  # a late turn's prompt and its answer, about
SYSTEM = "You are a careful analyst. Answer from the document; say so when it does not say."
WORDS = ["latency", "throughput", "replica", "cache", "block", "tenant", "budget", "queue", "prefix", "session", "token", "decode", "prefill", "scheduler", "memory", "fleet", "request", "answer", "stream", "gateway", "ledger"]


@dataclass
class Result:
    contender: str
    hit_rate: float
    hits: float
    queries: float
    requests: int
    failures: int
    over_bound: float  # the most, at the moments a request was admitted
    over_bound_any_time: float  # the most, in any 10 ms sample
    seconds: float
    per_replica: dict[str, float] = field(default_factory=dict)
    p50_s: float = 0.0  # request latency, wall seconds (the replicas run time-scaled)
    p99_s: float = 0.0


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def converse(
    http: aiohttp.ClientSession, url: str, chat: int, turns: int, doc_words: int, seed: int,
    think_s: float = 0.05, latencies: list[float] | None = None,
) -> tuple[int, int]:
    """One chat, turn after turn, each resending the history; (requests ok, failures)."""
    rng = random.Random(seed * 10_007 + chat)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document {chat}:\n{document(rng, doc_words)}\n\nSummarize it."},
    ]
    return await talk(http, url, messages, turns, rng, think_s, latencies,
                      lambda turn: f"Question {turn}: what about {rng.choice(WORDS)}?")


async def ask(
    http: aiohttp.ClientSession, url: str, chat: int, turns: int, doc_words: int, seed: int,
    documents: int, spread_s: float, think_s: float = 0.05,
    latencies: list[float] | None = None,
) -> tuple[int, int]:
    """One user's chat about one of the shared documents (RAG), starting at a random moment
    of the first `spread_s` seconds: (requests ok, failures)."""
    rng = random.Random(seed * 10_007 + chat)
    await asyncio.sleep(rng.uniform(0, spread_s))
    doc = rng.randrange(documents)
    text = document(random.Random(seed * 7_919 + doc), doc_words)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document {doc}:\n{text}\n\n"
                                    f"Question: what does it say of {rng.choice(WORDS)}?"},
    ]
    return await talk(http, url, messages, turns, rng, think_s, latencies,
                      lambda turn: f"And {rng.choice(WORDS)}? ({turn})")


async def talk(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], turns: int,
    rng: random.Random, think_s: float, latencies: list[float] | None,
    follow_up: Callable[[int], str],
) -> tuple[int, int]:
    """`turns` requests, each resending the history with the answer and `follow_up(turn)`
    appended; (requests ok, failures)."""
    ok = failed = 0
    for turn in range(turns):
        await asyncio.sleep(rng.expovariate(1 / think_s))  # the user reads, then types
        body = {"model": "sim-model", "messages": messages, "max_tokens": 160}
        sent = time.monotonic()
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            raw = await resp.read()
        if latencies is not None:
            latencies.append(time.monotonic() - sent)
        if resp.status != 200:
            failed += 1
            continue
        ok += 1
        reply = orjson.loads(raw)["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": reply},
                    {"role": "user", "content": follow_up(turn)}]
    return ok, failed


async def run_once(
    contender: str, *, replicas: int, chats: int, turns: int, doc_words: int, seed: int,
    time_scale: float = 0.02, sim: dict[str, Any] | None = None, workload: str = "chats",
    documents: int = 24, spread_s: float = 8.0,
) -> Result:
    events = contender in WITH_EVENTS
    extra = {"kv_events_config": EVENTS} if events else {}
    sims = [SimReplica(SimConfig(**{"num_gpu_blocks": 1024, "max_model_len": 8192,
                                    "time_scale": time_scale, "seed": seed + i,
                                    "output_len_dist": "uniform", **extra, **(sim or {})}))
            for i in range(replicas)]
    for s in sims:
        await s.start()
    entries = [{"url": s.url, "name": f"r{i}",
                **({"kv_events": s.kv_events_endpoints} if events else {})}
               for i, s in enumerate(sims)]
    tree: dict[str, Any] = {
        "pools": {"default": {"replicas": entries, **({"kv_events": {}} if events else {})}},
        "discovery": {"interval_s": 0.2},
        "admission": {"queue": {"max_wait_s": 60}},
    }
    if events:
        tree["models"] = [{"name": "sim-model", "tokenizer": SIM_TOKENIZER}]
    routing = CONTENDERS[contender]
    if routing:
        tree["routing"] = routing
    tree["server"] = {"port": 0}
    runner, url = await start_gateway(parse_config(tree))  # listening, replicas discovered
    app = runner.app
    from kvgate.api.routes import GATEWAY

    gateway = app[GATEWAY]
    at_admission: list[tuple[int, list[int]]] = []
    watch_admissions(gateway, replicas, at_admission)
    router = None
    try:
        if routing is None:
            router, url = await start_vllm_router([s.url for s in sims])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            before = await scrape(http, sims)
            started = time.monotonic()
            samples: list[list[int]] = []
            latencies: list[float] = []
            if workload == "rag":
                work = asyncio.gather(*(ask(http, url, c, turns, doc_words, seed, documents,
                                            spread_s, latencies=latencies)
                                        for c in range(chats)))
            else:
                work = asyncio.gather(*(converse(http, url, c, turns, doc_words, seed,
                                                 latencies=latencies)
                                        for c in range(chats)))
            task = asyncio.ensure_future(work)
            while not task.done():
                samples.append([gateway.admission.reserved.get(f"r{i}", 0)
                                for i in range(replicas)])
                await asyncio.sleep(0.01)
            config = gateway.runtime.config
            admissible = [v.admissible_blocks or 0 for v in gateway.view.take(config)]
            if router is not None:
                samples = []  # not kvgate's: its ledger saw nothing
            outcomes = task.result()
            seconds = time.monotonic() - started
            after = await scrape(http, sims)
    finally:
        if router is not None:
            router.terminate()
            await router.wait()
        await runner.cleanup()
        for s in sims:
            await s.stop()
    hits = {k: after[k][0] - before[k][0] for k in after}
    queries = {k: after[k][1] - before[k][1] for k in after}
    total_hits, total_queries = sum(hits.values()), sum(queries.values())
    return Result(
        contender, total_hits / total_queries if total_queries else 0.0, total_hits,
        total_queries, sum(o for o, _ in outcomes), sum(f for _, f in outcomes),
        over_bound(at_admission if router is None else [], admissible,
                   config.routing.load_factor, config.routing.load_floor),
        over_bound([(None, s) for s in samples], admissible, config.routing.load_factor,
                   config.routing.load_floor),
        seconds,
        {k: round(hits[k] / queries[k], 3) if queries[k] else 0.0 for k in hits},
        *quantiles(latencies),
    )


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values) or [0.0]
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return round(pick(0.5), 4), round(pick(0.99), 4)


def watch_admissions(gateway: Any, replicas: int, into: list[tuple[int, list[int]]]) -> None:
    """Record, each time admission places a request, which replica took it and every
    replica's reserved blocks (the bench's instrument, wrapped around the placement step)."""
    placer = gateway.admission.placer

    class Watched:
        def __getattr__(self, name: str) -> Any:
            return getattr(placer, name)

        async def place(self, *args: Any, **kwargs: Any) -> Any:
            slot = await placer.place(*args, **kwargs)
            if slot is not None:
                reserved = [gateway.admission.reserved.get(f"r{i}", 0) for i in range(replicas)]
                into.append((int(slot.replica.id.removeprefix("r")), reserved))
            return slot

    gateway.admission.placer = Watched()


def over_bound(
    samples: list[tuple[int | None, list[int]]], admissible: list[int], load_factor: float,
    load_floor: float,
) -> float:
    """The most a replica held against what bounded load allows it (the replicas have equal
    capacity here): the replica that took the request, at an admission; any, in a sample."""
    worst = 0.0
    for took, reserved in samples:
        share = (1 + load_factor) * sum(reserved) / len(reserved)
        for i, (held, limit) in enumerate(zip(reserved, admissible, strict=True)):
            if took is None or i == took:
                allowed = max(share, load_floor * limit, LARGEST_REQUEST_BLOCKS)
                worst = max(worst, held / allowed)
    return worst


async def start_vllm_router(workers: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """vllm-router with its cache_aware policy in front of `workers`."""
    command = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
        "vllm-router")
    if command is None:
        raise RuntimeError("vllm-router is not installed (pip install -e '.[bench]')")
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        command, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
        "--policy", "cache_aware", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1", "--log-level", "warning",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return process, url
            await asyncio.sleep(0.1)
    process.terminate()
    raise RuntimeError("vllm-router did not become ready")


async def scrape(http: aiohttp.ClientSession, sims: list[SimReplica]) -> dict[str, tuple[float, float]]:
    """Each replica's own (prefix_cache_hits, prefix_cache_queries) from its /metrics."""
    out = {}
    for s in sims:
        async with http.get(f"{s.url}/metrics") as resp:
            parsed = parse_vllm_metrics(await resp.text(), time.monotonic())
        out[s.url] = (parsed.prefix_hits or 0.0, parsed.prefix_queries or 0.0)
    return out


async def main(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    for repeat in range(args.repeats):
        order = args.contenders if repeat % 2 == 0 else list(reversed(args.contenders))
        for contender in order:
            result = await run_once(contender, replicas=args.replicas, chats=args.chats,
                                    turns=args.turns, doc_words=args.doc_words,
                                    seed=args.seed + repeat, workload=args.workload,
                                    documents=args.documents, spread_s=args.spread_s)
            results.append(result)
            print(f"repeat {repeat} {contender:>13}: hit rate {result.hit_rate:.3f}  "
                  f"over bound {result.over_bound:.2f} (any time {result.over_bound_any_time:.2f})"
                  f"  p50 {result.p50_s:.3f}s  "
                  f"p99 {result.p99_s:.3f}s  ok {result.requests}  "
                  f"failed {result.failures}  {result.seconds:.1f}s", flush=True)
    return results


def summary(results: list[Result], contenders: list[str]) -> str:
    lines = ["| contender | hit rate | × round robin | most held vs bounded share: at admission "
             "/ any time | latency p50 / p99 (s) | failures |", "|---|---|---|---|---|---|"]
    repeats = max(1, len(results) // max(1, len(contenders)))
    by = {c: [r for r in results if r.contender == c] for c in contenders}
    for c in contenders:
        rows = by[c]
        ratios = [r.hit_rate / b.hit_rate for r, b in zip(rows, by.get("round_robin", []), strict=False)
                  if b.hit_rate]
        ratio = f"{statistics.median(ratios):.2f}×" if ratios else "—"
        bound = "—" if c.startswith("vllm-router") else (
            f"{max(r.over_bound for r in rows):.2f} / "
            f"{max(r.over_bound_any_time for r in rows):.2f}")
        latency = (f"{statistics.median(r.p50_s for r in rows):.3f} / "
                   f"{statistics.median(r.p99_s for r in rows):.3f}")
        lines.append(f"| {c} | {statistics.median(r.hit_rate for r in rows):.3f} | {ratio} | "
                     f"{bound} | {latency} | {sum(r.failures for r in rows)} |")
    lines.append(f"\nMedians over {repeats} repeat(s); the ratio is the median of per-repeat "
                 "ratios; bounded share: the most over every admission (or sample) and repeat.")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["chats", "rag"], default="chats")
    parser.add_argument("--documents", type=int, default=24, help="rag: shared documents")
    parser.add_argument("--spread-s", type=float, default=8.0,
                        help="rag: the chats start at random over this many seconds")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--chats", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=list(CONTENDERS))
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args()
    found = asyncio.run(main(arguments))
    print(summary(found, arguments.contenders))
    if arguments.json:
        arguments.json.write_bytes(orjson.dumps([r.__dict__ for r in found], option=orjson.OPT_INDENT_2))
