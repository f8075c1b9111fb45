"""A simulated vLLM replica: a pure, steppable engine (`engine`) behind an aiohttp server
speaking vLLM's OpenAI-compatible API and metrics (`server`), with scripted faults.

    config.SimConfig      every knob, validated once
    blocks.BlockPool      the paged KV pool and prefix cache
    engine.Engine         continuous batching, preemption, prefix caching (no I/O)
    reports.StepResult    what a step did; EngineStats, its counters
    text.PromptEncoder    chat template + tiktoken, cached per message
    metrics.SimMetrics    vLLM's Prometheus metrics on a per-replica registry
    server.SimReplica     the HTTP server around one engine
    fleet / cli           `kvgate sim`
"""
