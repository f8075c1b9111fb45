"""The fleet benchmark's parts: `bench/fleet.py` and `bench/real_fleet.py` run them.

    workloads.py    the seeded workloads (the demo's `mix`, `realistic`, the trace's) in simulated
                    seconds, with their run settings
    trace.py        `trace` and `trace-mixed`: a production trace (bench/traces/) replayed
    prompts.py      the words, system prompts and chat bodies the workloads send
    fleet.py        the simulated fleet: replica settings per workload, the YAML `kvgate sim` reads
    capacity.py     the fleet's capacity for a workload, by stepping the simulator's engine offline
    processes.py    child processes: start, wait until ready, stop every one whatever happens
    contenders.py   what is measured: the bare fleet, vllm-router, kvgate in its modes
    measure.py      one run: fresh fleet, one contender, one workload at one load; results in
    metrics.py      pure functions from results and scraped counters to the reported figures
    report.py       medians over repeats, the table, the markdown summary, the JSON, the plots
    real.py         bench/real_fleet.py's fleet: two real vLLM CPU engines, their chats, capacity, one run
"""
