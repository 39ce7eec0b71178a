"""The `disaggregation` block (`slo.disaggregation`) and the card's cluster section, through
`summarize` and `build_card` on run directories written with the production writer.

Five requests (sent at 0, ok), four with a KV handoff, worked by hand:
    r0 ok    1,000,000 B in 10 ms, prefill 20 ms, install 2 ms, decode-0
    r1 ok    3,000,000 B in 30 ms, prefill 40 ms, install 4 ms, decode-1
    r2 FAIL    500,000 B in  5 ms, prefill 30 ms, retried recompute, decode-1
    r3 ok    2,000,000 B in 60 ms, prefill 10 ms, install unsaid, decode-0
    r4 no handoff (ended at its first token), no worker named
Bandwidth over the handoffs not failed (r0, r1, r3): 6,000,000 B / 100 ms = 60 MB/s (the
failed r2 is left out: its bytes did not all arrive). Percentiles are numpy's linear ones:
prefill [10, 20, 30, 40] -> p50 25, p90 37, p99 39.7; transfer [5, 10, 30, 60] -> p50 20,
p90 51; bytes [0.5, 1, 2, 3] MB -> p50 1.5 MB; install [2, 4] -> p50 3."""

from __future__ import annotations

import pytest
from rich.console import Console
from slo_runs import ms, write_run

from reports.build import build_card
from reports.console import card_renderable
from reports.disaggregation_view import disaggregation_renderable
from reports.html import render_html
from slo.runrecord import RequestColumn, RunSummary, open_run
from slo.summary import summarize, summarize_tables

HANDOFFS = [  # bytes, transfer ms, prefill ms, install ms, ok, retried, worker
    (1_000_000, 10.0, 20.0, 2.0, True, None, "decode-0"),
    (3_000_000, 30.0, 40.0, 4.0, True, None, "decode-1"),
    (500_000, 5.0, 30.0, None, False, "recompute", "decode-1"),
    (2_000_000, 60.0, 10.0, None, True, None, "decode-0"),
]


def _row(i: int, handoff: tuple | None) -> dict:
    row = dict(request_id=f"r{i}", t_scheduled_ns=0, t_sent_ns=0, t_first_token_ns=ms(100),
               t_last_token_ns=ms(200), t_done_ns=ms(210), status="ok", input_tokens=4,
               output_tokens=2, output_tokens_source="usage")  # fmt: skip
    if handoff is not None:
        size, took, prefill, install, ok, retried, worker = handoff
        row.update(kv_transfer_bytes=size, kv_transfer_ms=took, kv_prefill_ms=prefill,
                   kv_install_ms=install, kv_transfer_ok=ok, kv_transfer_retried=retried,
                   served_by=worker)  # fmt: skip
    return row


def _run(tmp_path, handoffs: list[tuple | None], name: str = "run"):
    rows = [_row(i, h) for i, h in enumerate(handoffs)]
    chunks = [(r["request_id"], t, 1) for r in rows for t in (ms(100), ms(200))]
    return write_run(tmp_path / name, rows, chunks)


def test_the_block_by_hand(tmp_path):
    block = summarize(_run(tmp_path, [*HANDOFFS, None]))["disaggregation"]
    assert (block["requests_with_transfer"], block["transfers_ok"], block["transfers_failed"],
            block["transfers_retried"]) == (4, 3, 1, 1)  # fmt: skip
    prefill = block["prefill_time_ms"]
    assert (prefill["p50"], prefill["p90"], prefill["p99"], prefill["max"], prefill["n"]) == (
        pytest.approx(25.0),
        pytest.approx(37.0),
        pytest.approx(39.7),
        40.0,
        4,
    )
    transfer = block["transfer_time_ms"]
    assert (transfer["p50"], transfer["p90"], transfer["n"]) == (20.0, pytest.approx(51.0), 4)
    assert (block["install_time_ms"]["p50"], block["install_time_ms"]["n"]) == (3.0, 2)
    assert block["transfer_bytes_per_request"]["p50"] == 1_500_000.0
    assert (block["bandwidth_transfers"], block["total_transfer_bytes"]) == (3, 6_000_000)
    assert block["total_transfer_ms"] == 100.0
    assert block["effective_bandwidth_mb_per_s"] == pytest.approx(60.0)
    assert "sum(bytes) / sum(transfer_ms)" in block["bandwidth_formula"]
    assert block["requests_by_worker"] == {"decode-0": 2, "decode-1": 2}
    typed = RunSummary.from_dict(summarize(tmp_path / "run"))
    assert typed.disaggregation.effective_bandwidth_mb_per_s == pytest.approx(60.0)


def test_one_request(tmp_path):
    block = summarize(_run(tmp_path, [HANDOFFS[0]]))["disaggregation"]
    assert block["requests_with_transfer"] == 1 and block["transfer_time_ms"]["p99"] == 10.0
    assert block["effective_bandwidth_mb_per_s"] == pytest.approx(100.0)  # 1 MB in 10 ms


@pytest.mark.parametrize(
    ("handoff", "bandwidth"),
    [
        ((0, 0.0, 1.0, None, True, None, "d"), None),  # 0 bytes in 0 ms: no rate, not NaN
        ((4096, 0.0, 1.0, None, True, None, "d"), None),  # bytes in 0 ms: no rate, not inf
        ((0, 5.0, 1.0, None, True, None, "d"), 0.0),  # nothing moved in 5 ms: 0 MB/s
        ((1000, 0.001, 1.0, None, True, None, "d"), 1000.0),  # 1000 B in 1 us: 1000 MB/s
        ((4096, 8.0, 1.0, None, False, None, "d"), None),  # only a failed handoff
        ((None, 8.0, 1.0, None, True, None, "d"), None),  # bytes unsaid
    ],
)
def test_bandwidth_boundaries(tmp_path, handoff, bandwidth):
    block = summarize(_run(tmp_path, [handoff]))["disaggregation"]
    if bandwidth is None:
        assert block["effective_bandwidth_mb_per_s"] is None
    else:
        assert block["effective_bandwidth_mb_per_s"] == pytest.approx(bandwidth)


def test_a_run_without_handoffs_or_workers_has_no_block_and_no_section(tmp_path):
    run = _run(tmp_path, [None, None])
    assert summarize(run)["disaggregation"] is None
    card = build_card(run)
    assert card.disaggregation is None and "disaggregation" not in card.to_dict()
    assert disaggregation_renderable(card.disaggregation) is None
    # a table written before the columns existed reads the same
    tables = open_run(run)
    names = [str(c) for c in RequestColumn if str(c).startswith("kv_")] + ["served_by"]
    old = tables.requests.drop_columns(names)
    assert (
        summarize_tables(type(tables)(requests=old, chunks=tables.chunks))["disaggregation"] is None
    )


def test_workers_alone_make_a_block_without_handoffs(tmp_path):
    """A replica cluster names the serving worker (its `x-bench-worker` header), moves no KV."""
    rows = [dict(_row(i, None), served_by=f"replica-{i % 2}") for i in range(3)]
    run = write_run(tmp_path / "replicas", rows, [(r["request_id"], ms(100), 1) for r in rows])
    block = summarize(run)["disaggregation"]
    assert block["requests_with_transfer"] == 0 and block["effective_bandwidth_mb_per_s"] is None
    assert block["requests_by_worker"] == {"replica-0": 2, "replica-1": 1}
    assert block["transfer_time_ms"]["n"] == 0
    text = _console(build_card(run))
    assert "No request reported a KV handoff." in text
    assert "Requests per serving worker: replica-0 2, replica-1 1." in text
    assert "bandwidth" not in text


def _console(card) -> str:
    console = Console(width=200, record=True)
    console.print(card_renderable(card))
    return console.export_text()


def test_the_card_shows_the_cluster_section(tmp_path):
    card = build_card(_run(tmp_path, [*HANDOFFS, None]))
    assert card.to_dict()["disaggregation"]["effective_bandwidth_mb_per_s"] == 60.0
    text = _console(card)
    sentences = [
        "4 request(s) handed their KV from a prefill to a decode worker: 3 ok, 1 failed, "
        "1 retried.",
        "Effective link bandwidth: 60.000 MB/s (B_effective = sum(bytes) / sum(transfer_ms), "
        "handoffs not failed (MB/s); 6,000,000 bytes / 100.000 ms over 3 handoff(s)).",
        "Requests per serving worker: decode-0 2, decode-1 2.",
    ]
    flat = " ".join(text.split())
    for sentence in sentences:
        assert sentence in flat
    rows = {line.split("  ")[0].strip(): line.split() for line in text.splitlines()}
    assert rows["prefill time (ms)"][-5:] == ["4", "25.0", "37.0", "39.7", "40.0"]
    assert rows["KV bytes per handoff"][-5:] == ["4", "1,500,000", "2,700,000", "2,970,000",
                                                  "3,000,000"]  # fmt: skip
    assert rows["KV install time (ms)"][-5:] == ["2", "3.0", "3.8", "4.0", "4.0"]
    html = render_html(card)
    assert "Cluster: KV handoffs and serving workers" in html
    assert "Effective link bandwidth: 60.000 MB/s" in html
    assert "<td>1,500,000</td>" in html
