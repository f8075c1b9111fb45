"""`/sim/*`: the simulator's own control routes (faults, stop/restart, live engine state).

    GET    /sim/faults    the active faults
    POST   /sim/faults    merge the given faults into the active ones (JSON object)
    DELETE /sim/faults    clear every fault
    POST   /sim/stop      close the listener; `{"restart_after_s": X}` reopens it after X s
    POST   /sim/restart   close and reopen the listener now (engine state is lost)
    GET    /sim/state     the engine's live state; `?requests=1` lists the requests too

Stop and restart answer first, then act, since they close the connection they came on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from kvgate.sim.faults import Faults
from kvgate.sim.runtime import EngineRuntime

if TYPE_CHECKING:
    from kvgate.sim.server import SimReplica


def routes(replica: SimReplica, runtime: EngineRuntime) -> list[web.RouteDef]:
    async def get_faults(request: web.Request) -> web.Response:
        return web.json_response(replica.faults.to_dict())

    async def post_faults(request: web.Request) -> web.StreamResponse:
        body = await _object_body(request)
        try:
            merged = Faults.from_mapping({**replica.faults.to_dict(), **body})
        except ValueError as exc:
            return _bad_request(str(exc))
        if merged.stopped and not replica.faults.stopped:
            return await _answer_then(request, merged.to_dict(), replica,
                                      lambda: replica.set_faults(merged))  # fmt: skip
        replica.faults = merged
        return web.json_response(merged.to_dict())

    async def delete_faults(request: web.Request) -> web.Response:
        replica.faults = Faults()
        return web.json_response(replica.faults.to_dict())

    async def stop(request: web.Request) -> web.StreamResponse:
        body = await _object_body(request)
        restart_after = body.get("restart_after_s")
        if restart_after is not None and (
            isinstance(restart_after, bool) or not isinstance(restart_after, int | float)
        ):
            return _bad_request("restart_after_s must be a number")
        seconds = None if restart_after is None else float(restart_after)
        return await _answer_then(request, {"stopping": True, "restart_after_s": seconds},
                                  replica, lambda: replica.stop_for(seconds))  # fmt: skip

    async def restart(request: web.Request) -> web.StreamResponse:
        return await _answer_then(request, {"restarting": True}, replica, replica.restart)

    async def state(request: web.Request) -> web.Response:
        with_requests = request.query.get("requests", "") in ("1", "true", "yes")
        body = runtime.engine.state(with_requests=with_requests)
        body["faults"] = replica.faults.to_dict()
        body["max_model_len"] = replica.config.max_model_len
        body["max_num_seqs"] = replica.config.max_num_seqs
        body["max_num_batched_tokens"] = replica.config.max_num_batched_tokens
        body["served_model_name"] = replica.config.served_model_name
        body["sim_time_s"] = runtime.clock.now()
        body["starts"] = replica.starts
        return web.json_response(body)

    return [
        web.get("/sim/faults", get_faults),
        web.post("/sim/faults", post_faults),
        web.delete("/sim/faults", delete_faults),
        web.post("/sim/stop", stop),
        web.post("/sim/restart", restart),
        web.get("/sim/state", state),
    ]


async def _object_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


async def _answer_then(
    request: web.Request, body: dict[str, Any], replica: SimReplica, action: Any
) -> web.StreamResponse:
    """Send the whole answer, then run `action()` (a coroutine factory) in the background."""
    response = web.Response(body=orjson.dumps(body), content_type="application/json")
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    replica.spawn(action())
    return response

