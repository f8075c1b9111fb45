"""Seeded logprobs and the framing of JSON content: pure, no server."""

from __future__ import annotations

import json
from itertools import pairwise

from kvgate.request.tokenizers import TiktokenTokenizer
from kvgate.sim.extras import JSON_CONTENT, PLAIN, TOOL_ARGUMENTS
from kvgate.sim.logprobs import ALTERNATIVES, LogprobTable, text_logprobs
from kvgate.sim.options import MAX_LOGPROBS
from kvgate.sim.text import filler_text


def test_alternatives_are_distinct_one_token_words(sim_tokenizer: TiktokenTokenizer) -> None:
    assert len(set(ALTERNATIVES)) == len(ALTERNATIVES) > MAX_LOGPROBS
    for word in ALTERNATIVES:
        assert len(sim_tokenizer.encode(word)) == 1, word


def test_alternatives_are_other_words_each_less_likely_than_the_token() -> None:
    table = LogprobTable(seed=0)
    for i in range(300):
        sampled = table.logprob(0, i)
        alternatives = table.alternatives(0, i, " the", MAX_LOGPROBS)
        assert len(alternatives) == MAX_LOGPROBS
        assert " the" not in {word for word, _ in alternatives}
        values = [sampled, *(value for _, value in alternatives)]
        assert all(a > b for a, b in pairwise(values)) and sampled < 0


def test_the_table_depends_on_the_seed_and_the_sequence_only() -> None:
    first, again, other = LogprobTable(1), LogprobTable(1), LogprobTable(2)
    assert [first.logprob(0, i) for i in range(50)] == [again.logprob(0, i) for i in range(50)]
    assert [first.logprob(0, i) for i in range(50)] != [other.logprob(0, i) for i in range(50)]
    assert [first.logprob(0, i) for i in range(50)] != [first.logprob(1, i) for i in range(50)]


def test_text_offsets_start_where_asked_and_follow_the_token_lengths() -> None:
    logprobs = text_logprobs(LogprobTable(0), 0, 3, [" a", " request", " from"], 0, 17)
    assert logprobs["text_offset"] == [17, 19, 27]
    assert [len(top) for top in logprobs["top_logprobs"]] == [1, 1, 1]


def test_framed_text_is_the_same_whole_or_in_any_run_of_chunks() -> None:
    for shape in (PLAIN, JSON_CONTENT, TOOL_ARGUMENTS):
        for count in (1, 2, 7):
            whole = "".join(shape.pieces(0, count, final=True))
            for cut in range(1, count):
                split = shape.pieces(0, cut, final=False) + shape.pieces(cut, count, final=True)
                assert "".join(split) == whole
            assert len(shape.pieces(0, count, final=True)) == count
            if shape is not PLAIN:
                assert json.loads(whole) == {
                    "text" if shape is JSON_CONTENT else "input": filler_text(0, count)
                }
