"""The simulator against a real vLLM engine, over HTTP: the same requests to both.

The conformance suite proves the simulator's scheduler step by step against vLLM's own. This
asks what it cannot: whether a real server, with its own step times and its own /metrics, does
what the simulator configured like it does. One engine of vLLM's CPU build (the tiny model,
kvgate.tools.vllm_cpu) and one simulated replica with the same blocks, block size, batch
limits and prefix caching:

1. **The step-cost model, fitted.** The simulator's step costs `step_overhead_s +
   prefill_token_s × prompt tokens + decode_seq_s × decoding sequences`. On the engine: the
   time to a one-token answer for prompts of 64 to 1,536 tokens (prefill per token, and a fixed
   cost), and the time between tokens with 1 to 32 sequences decoding (decode per sequence,
   and the step's fixed cost). Each is a least-squares line; R² says whether the shape holds.
2. **The same stream to both.** A seeded burst of completions with token-id prompts (exact
   lengths on both sides; four shared 256-token prefixes), answers of fixed length
   (`ignore_eos` on the engine, `output_len_dist: max` on the simulator), the simulator timed by
   the fitted model. Compared: preemptions, peak KV blocks (the usage gauge sampled every
   50 ms), prefix-cache hits, finish reasons, output tokens, makespan.
3. **How late each series moves.** One request on an idle server, /metrics read every 10 ms:
   how long after sending each series kvgate reads first moves, and after the answer ends how
   long until it settles.

    .venv/bin/python bench/sim_vs_real.py [--requests 48] [--out-dir bench/results]

Writes bench/results/sim-vs-real-<date>.json and .md. A CPU's scale is not a GPU's: the fitted
costs are this machine's; what carries over is whether the model's shape holds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvgate.request.tokenizers import load_tiktoken
from kvgate.sim.config import SimConfig
from kvgate.sim.server import SimReplica
from kvgate.tools.tiny_model import MODEL_NAME, VOCAB_SIZE
from kvgate.tools.vllm_cpu import EngineSpec, read_series, running

ROOT = Path(__file__).resolve().parents[1]
SPEC = EngineSpec(num_blocks=160, max_num_seqs=32, max_num_batched_tokens=2048)
READ = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions_total",
        "prefix_queries": "vllm:prefix_cache_queries_total",
        "prefix_hits": "vllm:prefix_cache_hits_total",
        "generation_tokens": "vllm:generation_tokens_total",
        "prompt_tokens": "vllm:prompt_tokens_total"}  # fmt: skip


def ids(rng: random.Random, n: int) -> list[int]:
    """Ordinary token ids (past the special tokens), so nothing ends or means anything."""
    return [rng.randrange(5, VOCAB_SIZE) for _ in range(n)]


async def figures(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    found = await read_series(http, url, list(READ.values()))
    return {key: found[series] for key, series in READ.items()}


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                   *, stream: bool = False) -> dict[str, Any]:  # fmt: skip
    """One completion; with `stream`, the arrival time of every token too."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, "temperature": 1.0}  # fmt: skip
    sent = time.monotonic()
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if not stream:
            data = await response.json()
            return {"status": response.status, "s": time.monotonic() - sent,
                    "finish": data["choices"][0]["finish_reason"],
                    "tokens": data["usage"]["completion_tokens"]}  # fmt: skip
        arrivals, finish = [], None
        async for line in response.content:
            if line.startswith(b"data: {"):
                choice = orjson.loads(line[6:])["choices"][0]
                if choice.get("text"):
                    arrivals.append(time.monotonic() - sent)
                finish = choice.get("finish_reason") or finish
        return {"status": response.status, "arrivals": arrivals, "finish": finish}


def line_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = intercept + slope × x over the median y at each x (a CPU shared with
    other processes gives the odd 10× outlier), and R² over those medians."""
    by_x: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    ys = [statistics.median(by_x[x]) for x in xs]
    slope, intercept = statistics.linear_regression(xs, ys)
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"intercept": intercept, "slope": slope, "r2": 1 - residual / total if total else 1.0}


async def fit_steps(url: str, seed: int) -> dict[str, Any]:
    """Prefill per token from one-token answers; decode per sequence from inter-token times."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        await complete(http, url, ids(rng, 32), 4)  # warm
        lengths, times = [], []
        for length in (64, 256, 512, 1024, 1536) * 5:
            answer = await complete(http, url, ids(rng, length), 1)
            lengths.append(float(length))
            times.append(answer["s"])
        batches, gaps = [], []
        for batch in (1, 2, 4, 8, 16, 24, 32) * 2:
            answers = await asyncio.gather(*(complete(http, url, ids(rng, 32), 96, stream=True)
                                             for _ in range(batch)))  # fmt: skip
            per = [(a["arrivals"][-1] - a["arrivals"][8]) / (len(a["arrivals"]) - 9)
                   for a in answers if len(a["arrivals"]) > 16]  # fmt: skip
            batches.append(float(batch))
            gaps.append(statistics.median(per))
    prefill, decode = line_fit(lengths, times), line_fit(batches, gaps)
    return {
        "prefill": {**prefill, "points": list(zip(lengths, times, strict=True))},
        "decode": {**decode, "points": list(zip(batches, gaps, strict=True))},
        "model": {"step_overhead_s": max(decode["intercept"], 1e-4),
                  "prefill_token_s": max(prefill["slope"], 1e-7),
                  "decode_seq_s": max(decode["slope"], 1e-7)},
    }


def stream_plan(seed: int, requests: int) -> list[tuple[float, list[int], int]]:
    """(send at, prompt, answer length): a burst over 2 s, four shared prefixes."""
    rng = random.Random(seed)
    prefixes = [ids(rng, 256) for _ in range(4)]
    plan = []
    for i in range(requests):
        prompt = rng.choice(prefixes) + ids(rng, rng.randint(16, 96))
        plan.append((2.0 * i / requests, prompt, rng.choice([128, 256, 384, 512])))
    return plan


async def run_stream(url: str, plan: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        before = await figures(http, url)
        peak, done = [0.0], asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], (await figures(http, url))["kv_usage"])
                await asyncio.sleep(0.05)

        async def one(at: float, prompt: list[int], length: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
            return await complete(http, url, prompt, length)

        sampler = asyncio.create_task(sample())
        started = time.monotonic()
        answers = await asyncio.gather(*(one(*p) for p in plan))
        makespan = time.monotonic() - started
        done.set()
        await sampler
        await asyncio.sleep(1.5)  # the engine's last figures reach /metrics
        after = await figures(http, url)
    finishes: dict[str, int] = {}
    for a in answers:
        finishes[str(a["finish"])] = finishes.get(str(a["finish"]), 0) + 1
    delta = {k: after[k] - before[k] for k in ("preemptions", "prefix_queries", "prefix_hits",
                                               "generation_tokens", "prompt_tokens")}
    return {
        "completed": sum(a["status"] == 200 for a in answers),
        "finish_reasons": finishes,
        "output_tokens": sum(a.get("tokens", 0) for a in answers),
        "preemptions": delta["preemptions"],
        "peak_kv_blocks": round(peak[0] * SPEC.num_blocks),
        "prefix_hit_rate": round(delta["prefix_hits"] / delta["prefix_queries"], 3)
        if delta["prefix_queries"] else None,
        "prompt_tokens_computed": delta["prompt_tokens"],
        "makespan_s": round(makespan, 2),
    }


async def lags(url: str, seed: int) -> dict[str, Any]:
    """Seconds from sending one request until each series first moves; from its answer's end
    until each settles (running back to 0, usage back to its idle value)."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        idle = await figures(http, url)
        seen: dict[str, float] = {}
        settled: dict[str, float] = {}
        started = time.monotonic()
        task = asyncio.create_task(complete(http, url, ids(rng, 300), 256))
        ended: float | None = None  # when the answer was complete, from the start
        task.add_done_callback(lambda _: seen.setdefault("_ended", time.monotonic() - started))
        while time.monotonic() - started < 30:
            asked = time.monotonic() - started  # a read sent after the end sees the end
            now = await figures(http, url)
            t = time.monotonic() - started
            for key in ("running", "kv_usage", "generation_tokens", "prompt_tokens"):
                if key not in seen and now[key] != idle[key]:
                    seen[key] = round(t, 3)
            ended = seen.get("_ended")
            if ended is not None and asked > ended:
                if "running" not in settled and now["running"] == 0:
                    settled["running"] = round(t - ended, 3)
                if "kv_usage" not in settled and now["kv_usage"] <= idle["kv_usage"] + 1e-9:
                    settled["kv_usage"] = round(t - ended, 3)
                if len(settled) == 2:
                    break
            await asyncio.sleep(0.01)
        seen.pop("_ended", None)
        answer = await task
    return {"moved_after_send_s": seen, "settled_after_end_s": settled,
            "answer_s": round(answer["s"], 3)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    plan = stream_plan(args.seed, args.requests)
    async with running([SPEC]) as (engine,):
        print("fitting the step-cost model on the engine ...", file=sys.stderr)
        fit = await fit_steps(engine.url, args.seed)
        print(f"  {fit['model']}", file=sys.stderr)
        print("the stream, to the engine ...", file=sys.stderr)
        real = await run_stream(engine.url, plan)
        real_lags = await lags(engine.url, args.seed + 1)
    sim = SimReplica(SimConfig(
        num_gpu_blocks=SPEC.num_blocks, block_size=SPEC.block_size, max_model_len=SPEC.model_len,
        max_num_seqs=SPEC.max_num_seqs, max_num_batched_tokens=SPEC.max_num_batched_tokens,
        enable_prefix_caching=True, output_len_dist="max", served_model_name=MODEL_NAME,
        seed=args.seed, **fit["model"],
    ), tokenizer=load_tiktoken())
    await sim.start()
    try:
        print("the stream, to the simulator ...", file=sys.stderr)
        simulated = await run_stream(sim.url, plan)
        sim_lags = await lags(sim.url, args.seed + 1)
    finally:
        await sim.stop()
    return {"spec": {"num_blocks": SPEC.num_blocks, "block_size": SPEC.block_size,
                     "max_num_seqs": SPEC.max_num_seqs,
                     "max_num_batched_tokens": SPEC.max_num_batched_tokens},
            "requests": args.requests, "seed": args.seed, "fit": fit,
            "stream": {"engine": real, "simulator": simulated},
            "lags": {"engine": real_lags, "simulator": sim_lags}}  # fmt: skip


def markdown(result: dict[str, Any], command: str, date: str) -> str:
    fit, stream, lag = result["fit"], result["stream"], result["lags"]
    rows = [f"`{command}`, {date}, this 2-core machine; one engine of vLLM's CPU build "
            f"({result['spec']['num_blocks']} blocks of {result['spec']['block_size']}), "
            "and the simulator configured like it.", "",
            "| step-cost term | fitted on the engine | R² |", "|---|---|---|",
            f"| fixed per step (decode line's intercept) | {fit['decode']['intercept'] * 1e3:.2f} ms "
            f"| {fit['decode']['r2']:.3f} |",
            f"| decode per sequence | {fit['decode']['slope'] * 1e3:.3f} ms | |",
            f"| prefill per token | {fit['prefill']['slope'] * 1e6:.1f} µs "
            f"| {fit['prefill']['r2']:.3f} |",
            f"| a one-token answer's fixed cost (prefill line's intercept) "
            f"| {fit['prefill']['intercept'] * 1e3:.1f} ms | |", "",
            f"The same {result['requests']} requests (a 2 s burst, four shared prefixes, fixed "
            "answer lengths):", "",
            "| | engine | simulator |", "|---|---|---|"]
    for key in ("completed", "finish_reasons", "output_tokens", "preemptions", "peak_kv_blocks",
                "prefix_hit_rate", "prompt_tokens_computed", "makespan_s"):
        rows.append(f"| {key.replace('_', ' ')} | {stream['engine'][key]} | "
                    f"{stream['simulator'][key]} |")
    rows += ["", "How late /metrics moves, one request on an idle server (seconds):", "",
             "| series | engine: after send | simulator: after send |", "|---|---|---|"]
    for key in ("running", "kv_usage", "prompt_tokens", "generation_tokens"):
        rows.append(f"| {key} | {lag['engine']['moved_after_send_s'].get(key, '-')} | "
                    f"{lag['simulator']['moved_after_send_s'].get(key, '-')} |")
    for key in ("running", "kv_usage"):
        rows.append(f"| {key}, settled after the answer | "
                    f"{lag['engine']['settled_after_end_s'].get(key, '-')} | "
                    f"{lag['simulator']['settled_after_end_s'].get(key, '-')} |")
    return "\n".join(rows) + "\n"


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python bench/sim_vs_real.py " + " ".join(sys.argv[1:])
    result["meta"] = {"command": command.strip(), "date": date}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    day = date.split()[0]
    (args.out_dir / f"sim-vs-real-{day}.json").write_bytes(
        orjson.dumps(result, option=orjson.OPT_INDENT_2))
    text = markdown(result, command.strip(), date)
    (args.out_dir / f"sim-vs-real-{day}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
