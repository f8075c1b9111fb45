"""The shared-prefix table keeps each replica's live blocks as entries open, are granted and
drop: the same figure a scan of every entry gives, after any sequence of steps."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission.shared_prefix import SharedPrefixes

STEPS = st.lists(st.tuples(
    st.sampled_from(["open", "grant", "drop", "drop_stale"]),
    st.sampled_from(["r1", "r2", "r3"]),
    st.sampled_from(["p1", "p2"]),
    st.integers(1, 40),
), max_size=80)


@given(STEPS)
@settings(max_examples=300, deadline=None)
def test_held_blocks_per_replica_match_a_scan_of_the_live_entries(steps):
    table = SharedPrefixes()
    opened = []  # every entry ever opened, including replaced and dropped ones
    for op, replica, key, blocks in steps:
        if op == "open" and table.get(replica, key) is None:
            opened.append(table.open(replica, key, blocks))
        elif op == "grant" and (entry := table.get(replica, key)) is not None:
            table.granted(entry)
        elif op == "drop" and (entry := table.get(replica, key)) is not None:
            table.drop(entry)
        elif op == "drop_stale" and opened:  # an entry no longer in the table: a no-op
            stale = opened[blocks % len(opened)]
            if table.get(stale.replica_id, stale.key) is not stale:
                table.drop(stale)
                table.granted(stale)
        for r in ("r1", "r2", "r3"):
            live = [table.get(r, k) for k in ("p1", "p2")]
            assert table.held_blocks(r) == sum(e.blocks for e in live if e is not None and e.live)
