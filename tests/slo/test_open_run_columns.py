"""`open_run(..., columns=)`, what the summary reads beside its chunk pass: only the named
request columns (with the id and the warm-up flag), the same rows as a whole read (warm-up
rows dropped), from a closed run and from a writer's parts alike; a column the file lacks is
left out, not an error. Runs are written by the production writer."""

from __future__ import annotations

import pytest
from slo_runs import records, write_run

from slo.runrecord import RequestColumn, RunManifest, RunWriter, open_run

ROWS = [
    {"request_id": "w0", "status": "ok", "is_warmup": True},
    {"request_id": "r0", "status": "ok", "input_tokens": 5},
    {"request_id": "r1", "status": "error", "error_class": "http_5xx"},
    {"request_id": "r2", "status": "not_sent"},
]


def _unclosed(run_dir):
    """A run whose writer has not closed: its rows are in the writer's parts."""
    run_dir.mkdir()
    writer = RunWriter(run_dir, RunManifest(t0_ns=0))
    writer.append_requests(records(ROWS))
    return run_dir, writer


@pytest.mark.parametrize("closed", [True, False])
def test_named_columns_only_and_the_same_rows(tmp_path, closed):
    if closed:
        run = write_run(tmp_path / "run", ROWS, [])
    else:
        run, writer = _unclosed(tmp_path / "run")
    whole = open_run(run, chunks=False).requests
    narrow = open_run(
        run, chunks=False, columns=[RequestColumn.REQUEST_ID, RequestColumn.STATUS, "no_such"]
    )
    names = narrow.requests.column_names  # each once, though the id was asked for twice
    assert sorted(names) in (["request_id", "status"], ["is_warmup", "request_id", "status"])
    assert narrow.requests["request_id"].to_pylist() == whole["request_id"].to_pylist()
    assert narrow.requests["request_id"].to_pylist() == ["r0", "r1", "r2"]  # warm-up dropped
    assert narrow.requests["status"].to_pylist() == ["ok", "error", "not_sent"]
    assert len(whole.column_names) > 10  # the whole read has every column
    if not closed:
        writer.close(complete=True)
