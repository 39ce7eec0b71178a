"""The ledger (`slo.ledger`) on run directories written by the production writer: a scheduled
request without a row is lost, a row for no scheduled request (or a second row for one) is
unexpected, and either fails the verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from slo.ledger import ledger_summary
from slo.runrecord import RequestRecord, RunManifest, RunWriter, open_run

SCHEDULED = ("r1", "r2", "r3")


def write_scheduled_run(
    run_dir: Path,
    rows: list[str],
    *,
    warmup: tuple[str, ...] = (),
    warm_rows: tuple = (),
    server_state: dict | None = None,
) -> Path:
    """A run that scheduled `warmup` and SCHEDULED and recorded one ok row per id in `rows`
    (an id may repeat) and one warm-up row per id in `warm_rows`, through `RunWriter`;
    `server_state` is the target's gauges before and after, as the run closes with them."""
    run_dir.mkdir(parents=True)
    writer = RunWriter(run_dir, RunManifest(t0_ns=0))
    writer.write_schedule(
        [(rid, None, True) for rid in warmup]
        + [(rid, 0.1 * i, False) for i, rid in enumerate(SCHEDULED)]
    )
    writer.append_requests(
        [RequestRecord(rid, t_sent_ns=1, t_done_ns=2, status="ok") for rid in rows]
    )
    writer.append_warmup([RequestRecord(rid, status="ok", is_warmup=True) for rid in warm_rows])
    writer.close(complete=True, server_state=server_state)
    return run_dir


@pytest.mark.parametrize(
    ("rows", "lost", "lost_ids", "unexpected", "verdict"),
    [
        (["r1", "r2", "r3"], 0, [], 0, "ok"),
        (["r1", "r3"], 1, ["r2"], 0, "failed"),  # r2 scheduled, no row
        (["r1", "r2", "r3", "r9"], 0, [], 1, "failed"),  # r9 never scheduled
        (["r1", "r2", "r2", "r3"], 0, [], 1, "failed"),  # r2 ended twice
        (["r1", "r9"], 2, ["r2", "r3"], 1, "failed"),
    ],
)
def test_lost_and_unexpected_are_counted_exactly(
    tmp_path, rows, lost, lost_ids, unexpected, verdict
):
    ledger = ledger_summary(open_run(write_scheduled_run(tmp_path / "run", rows)))
    assert (ledger["scheduled"], ledger["recorded"]) == (3, len(rows))
    assert (ledger["lost"], ledger["lost_ids"], ledger["unexpected"]) == (
        lost,
        lost_ids,
        unexpected,
    )
    assert ledger["verdict"] == verdict
    assert ledger["leaked"] == 0 and ledger["leak"]["checked"] is False
    assert ledger["outcomes"]["ok"] == len(rows)


def test_warmup_rows_balance_the_warmup_schedule(tmp_path):
    """Warm-up requests are scheduled too: their rows (in warmup.parquet) count for them."""
    run = write_scheduled_run(tmp_path / "ok", list(SCHEDULED), warmup=("w0",), warm_rows=("w0",))
    assert ledger_summary(open_run(run))["verdict"] == "ok"
    lost = write_scheduled_run(tmp_path / "lost", list(SCHEDULED), warmup=("w0",))
    ledger = ledger_summary(open_run(lost))
    assert (ledger["scheduled"], ledger["lost"], ledger["lost_ids"]) == (4, 1, ["w0"])
    assert ledger["verdict"] == "failed"


def test_a_run_without_a_schedule_is_unchecked(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    writer = RunWriter(run_dir, RunManifest(t0_ns=0))
    writer.append_requests([RequestRecord("r1", status="ok")])
    writer.close(complete=True)
    ledger = ledger_summary(open_run(run_dir))
    assert (ledger["scheduled"], ledger["lost"], ledger["unexpected"]) == (None, None, None)
    assert ledger["verdict"] == "unchecked"


def test_a_leak_fails_a_balanced_ledger(tmp_path):
    state = {
        "before": {"running": 0, "kv_blocks_used": 4},
        "after": {"running": 2, "kv_blocks_used": 9},
    }
    run_dir = write_scheduled_run(tmp_path / "run", list(SCHEDULED), server_state=state)
    ledger = ledger_summary(open_run(run_dir))
    assert (ledger["lost"], ledger["unexpected"], ledger["leaked"]) == (0, 0, 1)
    assert ledger["leak"]["reasons"] == [
        "2 running request(s) left after the run drained",
        "kv_blocks_used 9 after the run, 4 before it",
    ]
    assert ledger["verdict"] == "failed"
