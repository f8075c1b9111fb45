"""Admission: a request runs on a replica only if it fits that replica's block ledger;
otherwise it waits in a fair queue or is refused clearly.

    stage.py          `Admission`: place a demand on the best replica with room, or queue it
    demand.py         what a request asks of a replica (blocks, priority, prediction)
    placement.py      per-replica limits: where a demand may go now, and whether it ever fits
    ledger.py         per-replica books of reserved blocks, shared across instances
    leases.py         reservations kept alive while held, dropped when leaked
    shared_prefix.py  blocks that live requests share, reserved once per replica
    queue.py          the fair queue: classes, tenants, weights
    waiting.py        how long a queued request waits, and when room frees
    prediction.py     answer lengths by request shape (predicted mode)
    overcommit.py     how far predictions may be trusted on each replica
    backpressure.py   vLLM refusing work itself (its 503), read as overload
    progress.py       how far a request has got on its replica, when the replica has not said

This package's `__init__` imports nothing, so that any module may import a part of it.
"""
