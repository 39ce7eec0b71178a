"""`slo.frame.attempted_requests` (the sent rows) and the ok ids the chunk pass counts tokens
for (`summary.digest_options`), on tables built by the production table builder: a table
with no `not_sent` row comes back as itself (no copy of its columns, which the summary asked
for many times), one with such rows without them; the ok ids are the ok rows' alone."""

from __future__ import annotations

import pytest
from slo_runs import requests_table_of

from slo.frame import attempted_requests, not_sent_count
from slo.runrecord import RequestStatus, RunTables
from slo.summary import digest_options

STATUSES = {
    "none": [],
    "all sent": ["ok", "error", "ok", "timeout"],
    "one not sent": ["ok", "not_sent", "error", "ok"],
    "all not sent": ["not_sent", "not_sent"],
}


def _table(statuses: list[str]):
    rows = [{"request_id": f"r{i}", "status": RequestStatus(s)} for i, s in enumerate(statuses)]
    return requests_table_of(rows)


@pytest.mark.parametrize("case", list(STATUSES))
def test_attempted_requests_drops_only_not_sent_rows_and_copies_nothing_else(case):
    statuses = STATUSES[case]
    table = _table(statuses)
    sent = attempted_requests(table)
    kept = [s for s in statuses if s != "not_sent"]
    assert sent["status"].to_pylist() == kept
    assert not_sent_count(table) == len(statuses) - len(kept)
    if len(kept) == len(statuses):
        assert sent is table  # nothing to drop: the table itself


@pytest.mark.parametrize("case", list(STATUSES))
def test_the_ok_ids_are_the_ok_rows(case):
    statuses = STATUSES[case]
    tables = RunTables(requests=_table(statuses), chunks=None, manifest=None)
    ok_ids = digest_options(tables, None, None)["ok_ids"]
    assert ok_ids == {f"r{i}" for i, s in enumerate(statuses) if s == "ok"}
