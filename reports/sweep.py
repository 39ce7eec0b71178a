"""The sweep card: one row per load point of a `bench sweep` (throughput, latency percentiles,
goodput), and the Pareto view of output tokens/s per user against total output tokens/s, the
trade-off MLPerf's endpoints client and vLLM's sweep plots show.

Every figure is read from the points' `summary.json` (written by `slo.summarize`). Output
tokens/s per user is 1000 / median TPOT (ms), the decode speed one user sees, the
"interactivity" axis of such charts. A point is on the Pareto frontier when no other point
has both more tokens/s in total and more per user.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from reports.card import round_floats
from reports.errors import ReportError
from slo.runrecord import (
    Distribution,
    Goodput,
    RequestStatus,
    RunRecordError,
    read_manifest,
    read_summary,
)

SWEEP_FILE = "sweep.json"  # written by harness.sweep
SWEEP_CARD_VERSION = 1


@dataclass(frozen=True)
class SweepPoint:
    """One run of the sweep; latencies in ms over ok requests, rates per second."""

    run_dir: str
    kind: str
    value: float | str
    repeat: int
    n: int
    n_ok: int
    error_rate: float | None
    request_per_s: float | None
    output_tokens_per_s: float | None
    output_tokens_per_s_per_user: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    goodput_request_per_s: float | None
    attainment: float | None
    saturated: bool | None
    on_frontier: bool = False


@dataclass(frozen=True)
class SweepCard:
    """A sweep: its load dimension, the points in run order, and what to read first."""

    sweep_id: str
    kind: str
    slo_name: str | None
    workload: str | None
    model: str | None
    points: list[SweepPoint]
    notes: list[str] = field(default_factory=list)
    schema_version: int = SWEEP_CARD_VERSION

    def to_json(self) -> str:
        data = {"schema_version": self.schema_version, "kind": "sweep", **asdict(self)}
        data.pop("schema_version")
        data = {"schema_version": self.schema_version, **data}
        return json.dumps(round_floats(data, 4), indent=2) + "\n"


def pareto_frontier(points: list[tuple[float | None, float | None]]) -> list[bool]:
    """For each (x, y) pair, whether no other pair is at least as good on both and better
    on one (higher is better on both axes); pairs with a None are never on it."""
    out = []
    for i, (x, y) in enumerate(points):
        if x is None or y is None:
            out.append(False)
            continue
        dominated = any(
            j != i and ox is not None and oy is not None and ox >= x and oy >= y
            and (ox > x or oy > y)
            for j, (ox, oy) in enumerate(points)
        )  # fmt: skip
        out.append(not dominated)
    return out


def _point(sweep_dir: Path, entry: dict) -> SweepPoint:
    run = sweep_dir / entry["run_dir"]
    try:
        summary = read_summary(run)
    except RunRecordError as exc:
        raise ReportError(f"sweep point {entry['run_dir']}: {exc}") from exc
    counts, throughput = summary.counts, summary.throughput
    by_status = counts.by_status or {}
    goodput = summary.goodput or Goodput.empty()
    latency = summary.latency_ms
    ttft, tpot, itl, e2e = (
        d or Distribution.empty() for d in (latency.ttft, latency.tpot, latency.itl, latency.e2e)
    )
    return SweepPoint(
        run_dir=entry["run_dir"], kind=entry["kind"], value=entry["value"],
        repeat=int(entry.get("repeat", 1)), n=int(counts.total or 0),
        n_ok=int(by_status.get(RequestStatus.OK.value, 0)),
        error_rate=summary.error_rate, request_per_s=throughput.request_per_s,
        output_tokens_per_s=throughput.output_tokens_per_s,
        output_tokens_per_s_per_user=1000.0 / tpot.p50 if tpot.p50 else None,
        ttft_p50_ms=ttft.p50, ttft_p99_ms=ttft.p99, tpot_p50_ms=tpot.p50, tpot_p99_ms=tpot.p99,
        itl_p50_ms=itl.p50, itl_p99_ms=itl.p99, e2e_p50_ms=e2e.p50, e2e_p99_ms=e2e.p99,
        goodput_request_per_s=goodput.request_per_s, attainment=goodput.attainment,
        saturated=summary.saturation.saturated if summary.saturation is not None else None,
    )  # fmt: skip


def build_sweep_card(sweep_dir: Path | str) -> SweepCard:
    """The sweep card of `sweep_dir` (a `bench sweep` directory). Raises ReportError when it
    holds no readable `sweep.json` or a point's run is unreadable."""
    sweep_dir = Path(sweep_dir)
    try:
        record = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(
            f"{sweep_dir} holds no readable {SWEEP_FILE}; is it a bench sweep directory?"
        ) from exc
    points = [_point(sweep_dir, entry) for entry in record.get("points") or []]
    if not points:
        raise ReportError(f"the sweep in {sweep_dir} has no finished point.")
    frontier = pareto_frontier(
        [(p.output_tokens_per_s, p.output_tokens_per_s_per_user) for p in points]
    )
    points = [
        SweepPoint(**{**asdict(p), "on_frontier": f}) for p, f in zip(points, frontier, strict=True)
    ]
    manifest = read_manifest(sweep_dir / points[0].run_dir)
    slo = record.get("slo")
    notes = [
        f"{p.run_dir}: the target could not keep up (TTFT and in-flight count rose together)."
        for p in points
        if p.saturated
    ]
    notes += [
        f"{p.run_dir}: {p.n - p.n_ok} of {p.n} requests failed." for p in points if p.n_ok < p.n
    ]
    return SweepCard(
        sweep_id=sweep_dir.name,
        kind=record.get("kind", "?"),
        slo_name=(slo or {}).get("name") if isinstance(slo, dict) else slo,
        workload=(manifest.workload or {}).get("name"),
        model=(manifest.target or {}).get("model"),
        points=points,
        notes=notes,
    )
