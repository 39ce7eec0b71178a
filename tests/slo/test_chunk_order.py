"""`slo.metrics.ChunkOrder`: the one ordering of a run's chunks every chunk metric uses. The
production writer leaves each request's chunks together and in time order, which it takes as
is; any other order (interleaved requests, times going back, one request in two runs) must
give the same figures through the public `summarize`."""

from __future__ import annotations

import numpy as np
import pytest
from slo_runs import chunks_rows, hand_requests, ms, write_run

from slo import summarize
from slo.conventions import chunk_view
from slo.metrics import ChunkOrder, itl_ms_by_request
from slo.runrecord.schema import CHUNKS_SCHEMA, columns_table


def _table(rows):
    return columns_table(chunks_rows(rows), CHUNKS_SCHEMA)


def test_hand_worked_gaps_per_request():
    _, chunks = hand_requests()
    gaps = itl_ms_by_request(_table(chunks))
    # r1: token chunks at 100, 150, 250; r2: role chunk at 150 (0 tokens), tokens at 302, 422
    assert {k: v.tolist() for k, v in gaps.items()} == {"r1": [50, 100], "r2": [120], "r3": []}
    ids = np.array(["r1", "r2", "r3", "absent"], dtype=object)
    view = chunk_view(_table(chunks), ids, "through_last_token")  # r2's role chunk counts
    assert view.gaps_by_request["r2"].tolist() == [152, 120]
    assert view.first_ns[1] == ms(150) and view.last_ns[1] == ms(422)
    assert np.isnan(view.first_ns[3]) and np.isnan(view.last_ns[3])
    for kind in ("any", "token"):  # without gaps: the same first and last times, no gaps
        full, bare = (chunk_view(_table(chunks), ids, kind, with_gaps=g) for g in (True, False))
        assert np.array_equal(full.first_ns, bare.first_ns, equal_nan=True)
        assert np.array_equal(full.last_ns, bare.last_ns, equal_nan=True)
        assert bare.gaps_ms.size == 0 and bare.gaps_by_request == {} and full.gaps_ms.size


@pytest.mark.parametrize(
    "reorder",
    [
        pytest.param(lambda rows: rows[::-1], id="times-going-back"),
        pytest.param(lambda rows: rows[1::2] + rows[0::2], id="interleaved"),
        # r1 in two runs, apart: contiguity is checked per request, not only times
        pytest.param(lambda rows: rows[:1] + rows[3:] + rows[1:3], id="one-request-in-two-runs"),
    ],
)
def test_any_row_order_gives_the_figures_of_the_written_order(tmp_path, reorder):
    requests, chunks = hand_requests()
    grouped = summarize(write_run(tmp_path / "a", requests, chunks), conventions="all")
    other = summarize(write_run(tmp_path / "b", requests, reorder(chunks)), conventions="all")
    for block in ("latency_ms", "chunking", "conventions"):
        assert other[block] == grouped[block], block
    assert grouped["latency_ms"]["itl"]["n"] == 3  # r1's two gaps and r2's one


@pytest.mark.parametrize("rows", [[], [("r1", 5, 1)], [("r1", 5, 1), ("r1", 5, 1)]])
def test_empty_single_and_tied_rows(rows):
    order = ChunkOrder.of(_table(rows))
    assert len(order) == len(rows)
    gaps = order.gaps_by_request(order.n_tokens > 0)
    assert {k: v.tolist() for k, v in gaps.items()} == (
        {} if not rows else {"r1": [0.0] * (len(rows) - 1)}
    )
