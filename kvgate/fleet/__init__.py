"""The fleet: which replicas there are, whether they are healthy, and one immutable snapshot
of them that routing, admission, the gauges and the admin view all read.

    replicas.py   membership (listed, or found): the registry and what it knows of each replica
    scrape.py     each replica's /metrics read and parsed, and its decode clock
    discovery.py  the background loop that checks and scrapes every replica
    dns.py        resolving a headless service to replicas
    inference_pool.py  an InferencePool's ready pods as replicas, through the Kubernetes API
    health.py     passive health: a circuit breaker per replica
    drain.py      drain, fleet-wide, through the state store
    snapshot.py   the immutable picture of the fleet at one moment
    view.py       the one place that picture is taken, from the replicas, circuits and ledger
    kv_events.py  each replica's KV cache events, subscribed: its block index kept true
    kv_wire.py    those events decoded, in either layout vLLM publishes
    block_index.py  one replica's cached blocks, by content and by the engine's hash
    engine_hash.py  vLLM's own block hashes, computed from a prompt's tokens
"""
