"""The upstream call and what wraps it.

    base.py      Transport (one method: send), UpstreamRequest, UpstreamResponse, Outcome
    http.py      the HTTP transport over the pooled aiohttp client session
    breaker.py   a transport that judges each attempt for the replica's circuit
    failover.py  what an attempt says of its replica, and whether to try elsewhere
    attempts.py  the attempts stage: failover and placing again around each attempt
    relay.py     the answer relayed to the client (the gateway's edge I/O)
"""
