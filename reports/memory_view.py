"""The card's memory section, from the summary's `memory` block (`slo.memory`): memory per
request as the target reported it (peak, token-weighted mean, amortised over sharers,
fragmentation, temporaries), or as the harness estimated it from the target's KV cache gauge,
said to be an estimate; requests whose context was evicted lossily are counted."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from reports.card import Memory
from reports.html import fmt_bytes
from slo.runrecord import Distribution
from slo.runrecord import Memory as MemoryBlock

REPORTED_SOURCE = "usage.kv_memory (reported by the server, per request)"
ESTIMATED_SOURCE = (
    "estimated: kv_cache_usage_perc / num_requests_running at each scrape (the pool spread "
    "evenly over the running requests)"
)
NO_BLOCK = "the summary has no memory block (written before memory per request was measured)"


def memory_card(block: MemoryBlock | None) -> Memory:
    """The card's `memory` from the summary's block (module doc)."""
    if block is None:
        return Memory(available=False, reason=NO_BLOCK)
    if block.source == "reported":
        rows = [
            _row("KV held, peak", block.kv_peak_bytes),
            _row("KV held, token-weighted mean", block.kv_mean_bytes),
            _row("KV amortised (shared blocks / sharers)", block.kv_amortised_bytes),
            _row("KV slots unused (fragmentation)", block.kv_unused_bytes),
            _row("temporary buffers, peak (modelled)", block.temp_peak_bytes),
        ]
        evicted = block.requests_evicted or 0
        note = (
            f"{evicted} request(s) had context evicted lossily ({block.evicted_tokens} tokens "
            "in all): their outputs are not those of exact attention."
            if evicted
            else "No request had context evicted: every request attended to its exact context."
        )
        return Memory(True, REPORTED_SOURCE, _dist(block.kv_peak_bytes), rows=rows, note=note)
    if block.source == "estimated" and block.estimate is not None:
        est = block.estimate
        rows = [_row("share of the KV pool per running request", est.pool_share, unit="share")]
        if est.bytes_per_request is not None:
            rows.append(_row("KV bytes per running request", est.bytes_per_request))
        note = (
            f"An estimate from {est.samples} scrapes of the target's /metrics, not a measurement "
            "per request: a long request holds more than its even share, a short one less."
        )
        return Memory(True, ESTIMATED_SOURCE, _dist(est.bytes_per_request), rows=rows, note=note)
    return Memory(available=False, reason=block.reason or NO_BLOCK)


def memory_renderable(memory: Memory) -> Group | None:
    """The console card's memory part (the HTML card's rows), or None when not available."""
    if not memory.available:
        return None
    table = Table(
        title=f"Memory per request: {memory.source}", box=box.SIMPLE_HEAD, title_justify="left"
    )
    for name, justify in (
        ("figure", "left"),
        ("n", "right"),
        ("p50", "right"),
        ("p99", "right"),
        ("max", "right"),
    ):
        table.add_column(name, justify=justify)
    for r in memory.rows:
        shown = [
            f"{r[k]:.3f}" if r["unit"] == "share" and r[k] is not None else fmt_bytes(r[k])
            for k in ("p50", "p99", "max")
        ]
        table.add_row(r["label"], str(r["n"]), *shown)
    return Group(table, Text(memory.note or "", style="dim"))


def _dist(d: Distribution | None) -> dict | None:
    return None if d is None else d.to_dict()


def _row(label: str, d: Distribution | None, unit: str = "bytes") -> dict:
    d = d or Distribution()
    return {"label": label, "unit": unit, "n": d.n, "p50": d.p50, "p99": d.p99, "max": d.max}
