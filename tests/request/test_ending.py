"""How a request ended is decided in one place for both data planes: each way of ending gives
one outcome, one count, and one access-log line whose outcome and status agree."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from kvgate.config import parse_config
from kvgate.errors import ServerError, Unauthorized
from kvgate.exchange import Exchange
from kvgate.metrics import Metrics
from kvgate.request.ending import CLIENT_LEFT, finish
from kvgate.runtime import Runtime
from kvgate.transport.base import Outcome

CONFIG = parse_config({"pools": {"default": {"replicas": [{"url": "http://a:8000"}]}},
                       "server": {"access_log": True}})


def exchange(disconnected: bool = False, delivered: bool = False) -> Exchange:
    x = Exchange("r", "k", 0.0, {}, Runtime.load(CONFIG))
    x.model, x.tenant_name = "m", "t"
    x.attempts = [Outcome(client_disconnected=disconnected, done=delivered)]
    return x


@pytest.mark.parametrize(("fields", "status", "error", "outcome", "reason"), [
    ({}, 200, None, "ok", None),
    ({"disconnected": True}, 200, None, "disconnected", None),
    ({}, 404, None, "client_error", None),
    ({}, 502, None, "upstream_error", None),
    ({}, CLIENT_LEFT, asyncio.CancelledError(), "disconnected", None),
    ({"delivered": True}, CLIENT_LEFT, asyncio.CancelledError(), "ok", None),  # had [DONE]
    ({}, 401, Unauthorized("no key"), "refused", "unauthorized"),
    ({}, 500, ServerError("broke"), "upstream_error", "internal"),
])  # fmt: skip
def test_each_ending_is_counted_once_and_logged_with_its_outcome(
    caplog, fields, status, error, outcome, reason
):
    metrics = Metrics()
    with caplog.at_level(logging.INFO, logger="kvgate.access"):
        finish(metrics, CONFIG, exchange(**fields), status, error)
    counted = {s.labels["outcome"]: s.value for s in metrics.requests.collect()[0].samples
               if s.name.endswith("_total") and s.value}  # fmt: skip
    assert counted == {outcome: 1.0}
    refusals = [s for s in metrics.refusals.collect()[0].samples
                if s.name.endswith("_total") and s.value]  # fmt: skip
    assert [s.labels["reason"] for s in refusals] == ([] if reason is None else [reason])
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    assert (line["outcome"], line["status"], line["refusal_reason"]) == (outcome, status, reason)
