"""Builders for synthetic run directories, written with the production writer
(`slo.runrecord.RunWriter`), so a fixture can hold only values the contract admits."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from slo.runrecord import RequestRecord, RunManifest, RunWriter
from slo.runrecord.schema import CHUNKS_SCHEMA, columns_table, requests_table


def ms(value_ms: float | None) -> int | None:
    """Milliseconds to integer nanoseconds (None stays None)."""
    return None if value_ms is None else round(value_ms * 1_000_000)


def records(rows: list[dict]) -> list[RequestRecord]:
    """Request records from dicts of column values (missing columns are null)."""
    return [RequestRecord(**row) for row in rows]


def requests_table_of(rows: list[dict]) -> pa.Table:
    """A contract requests table, validated by the writer's own table builder."""
    return requests_table(records(rows))


def chunks_rows(rows: list[tuple]) -> list[tuple]:
    """(request_id, t_ns, n_tokens) tuples as chunk rows; n_chars = 4 * tokens."""
    return [(r, t, n, 4 * n) for r, t, n in rows]


def write_run(
    run_dir: Path, requests: list[dict], chunks: list[tuple], manifest: dict | None = None
) -> Path:
    """Write a run directory with `RunWriter`: the requests, their chunks and a manifest with
    `t0_ns` 0 (fields in `manifest` override); returns `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fields = {"t0_ns": 0, **(manifest or {})}
    complete = fields.pop("complete", True)
    writer = RunWriter(run_dir, RunManifest(**fields))
    writer.append_requests(records(requests))
    writer.append_chunks(chunks_rows(chunks))
    writer.close(complete=complete, reason=fields.get("interrupted_reason"))
    return run_dir


def hand_requests() -> tuple[list[dict], list[tuple]]:
    """Five requests whose metrics the tests work out by hand (times in ms).

    r1 ok: sent 0, token chunks at 100 (1 tok), 150 (2), 250 (1); done 260; 4 out, 10 in.
    r2 ok: scheduled 100, sent 102; role chunk at 150 (0 tok); tokens at 302, 422; done 430.
    r3 ok: sent 200; one token chunk at 500; done 505; 1 out (counted as chunks).
    r4 error (http_5xx): scheduled 300, sent 330, done 400; no tokens.
    r5 rejected (rejected_429): sent 400, done 401.
    """
    requests = [
        dict(request_id="r1", t_scheduled_ns=ms(0), t_sent_ns=ms(0), t_first_token_ns=ms(100),
             t_last_token_ns=ms(250), t_done_ns=ms(260), status="ok", input_tokens=10,
             output_tokens=4, output_tokens_source="usage"),
        dict(request_id="r2", t_scheduled_ns=ms(100), t_sent_ns=ms(102), t_first_token_ns=ms(302),
             t_last_token_ns=ms(422), t_done_ns=ms(430), status="ok", input_tokens=20,
             output_tokens=2, output_tokens_source="usage"),
        dict(request_id="r3", t_scheduled_ns=ms(200), t_sent_ns=ms(200), t_first_token_ns=ms(500),
             t_last_token_ns=ms(500), t_done_ns=ms(505), status="ok", input_tokens=30,
             output_tokens=1, output_tokens_source="chunk_count"),
        dict(request_id="r4", t_scheduled_ns=ms(300), t_sent_ns=ms(330), t_done_ns=ms(400),
             status="error", http_status=500, error_class="http_5xx", input_tokens=40),
        dict(request_id="r5", t_scheduled_ns=ms(400), t_sent_ns=ms(400), t_done_ns=ms(401),
             status="rejected", http_status=429, error_class="rejected_429", input_tokens=50),
    ]  # fmt: skip
    chunks = [
        ("r1", ms(100), 1), ("r1", ms(150), 2), ("r1", ms(250), 1),
        ("r2", ms(150), 0), ("r2", ms(302), 1), ("r2", ms(422), 1),
        ("r3", ms(500), 1),
    ]  # fmt: skip
    return requests, chunks


def request_metrics(requests: list[dict], chunks: list[tuple]):
    """`slo.frame.RequestMetrics` straight from rows, without writing a run directory."""
    from slo.frame import RequestMetrics

    return RequestMetrics.from_tables(
        requests_table_of(requests), columns_table(chunks_rows(chunks), CHUNKS_SCHEMA)
    )
