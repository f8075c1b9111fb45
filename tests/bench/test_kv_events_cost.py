"""bench/kv_events.py at a small rate: a publisher process in vLLM's wire format (today's
tagged maps, and 0.10's arrays), one subscriber; every event applied, none lost (the figure
itself is the benchmark's)."""

from __future__ import annotations

import kv_events  # bench/kv_events.py
import pytest


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["maps", "arrays"])
async def test_the_subscriber_keeps_up_with_a_publisher_and_misses_nothing(layout):
    result = await kv_events.measure(rate=2000, batch=20, seconds=1.5, layout=layout)
    assert result["gaps"] == 0
    assert result["events_per_s"] >= 1500, result
    assert result["index_blocks"] > 2000  # nine in ten events store a block
