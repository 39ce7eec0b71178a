"""Scrape the target's Prometheus `/metrics` during a run, into `server_metrics.parquet`.

Samples are stored raw (time, metric, labels, value); what they mean is for `slo`/`reports` to
decide. A target without `/metrics` (or one that answers with something that is not the
Prometheus text format) is simply not scraped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from slo.runrecord import write_server_metrics


def parse_metrics(text: str) -> list[tuple[str, str, float]]:
    """`(sample name, labels JSON, value)` for every sample in a Prometheus text exposition."""
    rows = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rows.append(
                (sample.name, json.dumps(sample.labels, sort_keys=True), float(sample.value))
            )
    return rows


@dataclass
class MetricsScraper:
    """Polls `metrics_url` every `interval_s` until stopped; keeps the samples in memory."""

    metrics_url: str
    interval_s: float = 1.0
    rows: list[tuple[int, str, str, float]] = field(default_factory=list)
    available: bool | None = None  # None until the first scrape answered

    async def run(self, session: aiohttp.ClientSession, t0_ns_getter) -> None:
        """Scrape until cancelled; stops for good on the first non-Prometheus answer."""
        while await self.scrape_once(session, t0_ns_getter):
            await asyncio.sleep(self.interval_s)

    async def scrape_once(self, session: aiohttp.ClientSession, t0_ns_getter) -> bool:
        """One sample of every metric; False once the target proved to have no /metrics.
        The run takes one last sample when its load is done, so counters cover all of it."""
        if self.available is False:
            return False
        t_ns = time.perf_counter_ns()
        try:
            async with session.get(
                self.metrics_url, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                text = await resp.text() if resp.status == 200 else None
            rows = parse_metrics(text) if text else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            rows = None
        if rows is None and self.available is None:
            self.available = False
            return False
        if rows:
            self.available = True
            t0 = t0_ns_getter() or t_ns
            self.rows.extend((t_ns - t0, name, labels, value) for name, labels, value in rows)
        return True

    def write(self, run_dir: Path) -> int:
        """Write `server_metrics.parquet` when anything was scraped; returns the row count."""
        return write_server_metrics(run_dir, self.rows)
