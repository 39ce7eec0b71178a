"""Exports of a run directory in formats other tools read: vLLM's result JSON (`vllm`), the
llm-d Benchmark Report (`llmd`), one CSV row per request (`csv`) and OpenTelemetry traces,
one span per request (`otlp-json`, `reports.exports.otlp`)."""

from __future__ import annotations

from pathlib import Path

from reports.errors import ReportError
from slo.frame import RequestMetrics
from slo.runrecord import RunRecordError, RunTables, open_run


def read_run(run_dir: Path | str) -> tuple[RunTables, RequestMetrics]:
    """The run's tables and per-request metrics; ReportError for an unreadable directory."""
    try:
        tables = open_run(run_dir)
    except RunRecordError as exc:
        raise ReportError(str(exc)) from exc
    return tables, RequestMetrics.from_tables(tables.requests, tables.chunks)
