"""`ChunkOrder.read`: a run directory's chunks read row group by row group, ids dictionary-
encoded, must give exactly `ChunkOrder.of(open_run(run).chunks)`, written by the production
writer in every shape it leaves: parts while open, one merged file after close."""

from __future__ import annotations

import numpy as np
import pytest

from slo import summarize
from slo.metrics import ChunkOrder
from slo.runrecord import RequestRecord, RequestStatus, RunManifest, RunWriter, open_run


def _same(a: ChunkOrder, b: ChunkOrder) -> None:
    assert a.names == b.names
    for name in ("codes", "t_ns", "n_tokens", "n_chars"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert getattr(a, name).dtype == getattr(b, name).dtype, name


BATCHES = {
    # each request's chunks written together, in time order: the writer's usual layout
    "grouped": [
        [("a", 1, 1, 1), ("a", 2, 1, 1)],
        [("b", 3, 1, 2)],
        [("c", 4, 0, 0), ("c", 9, 2, 3)],
    ],
    # a request whose chunks land in two row groups, and times that go back: sorted on read
    "split-and-unordered": [[("a", 5, 1, 1), ("b", 1, 1, 1)], [("a", 2, 1, 1), ("b", 0, 3, 4)]],
    # ids repeated across groups in another order than first seen, one group of one row
    "reordered-dictionaries": [
        [("x", 1, 1, 1), ("y", 2, 1, 1)],
        [("y", 3, 1, 1), ("x", 4, 1, 1)],
        [("z", 5, 1, 1)],
    ],
    "a-null-id-and-null-counts": [[("a", 1, None, 1), (None, 2, 1, None)], [("", 3, 1, 1)]],
    "empty": [],
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_read_equals_of_the_table_open_and_closed(name, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    writer = RunWriter(run, RunManifest(t0_ns=0))
    for batch in BATCHES[name]:
        writer.append_chunks(batch)
    _same(ChunkOrder.read(run), ChunkOrder.of(open_run(run).chunks))  # the parts
    writer.close(complete=True, reason=None)
    _same(ChunkOrder.read(run), ChunkOrder.of(open_run(run).chunks))  # the merged file
    assert open_run(run, chunks=False).chunks.num_rows == 0


def test_summarize_reads_the_chunks_once_and_agrees_with_the_table_path(tmp_path):
    from slo.summary import summarize_tables

    run = tmp_path / "run"
    run.mkdir()
    writer = RunWriter(run, RunManifest(t0_ns=0))
    records = [
        RequestRecord(
            request_id=f"r{i}",
            status=RequestStatus.OK,
            t_sent_ns=0,
            t_first_byte_ns=5,
            t_first_token_ns=10,
            t_last_token_ns=10 + 30 * i,
            t_done_ns=20 + 30 * i,
            output_tokens=i + 1,
            input_tokens=4,
        )  # fmt: skip
        for i in range(1, 6)
    ]
    writer.append_requests(records)
    for i in range(1, 6):  # one row group per request, as the recorder's flushes leave them
        writer.append_chunks([(f"r{i}", 10 + 30 * k, 1, 2) for k in range(i + 1)])
    writer.close(complete=True, reason=None)
    assert summarize(run) == summarize_tables(open_run(run))
