"""Comparative cards: several runs (engines, configurations) side by side.

Runs are only comparable when they drove the same requests (equal `workload.sha256` in their
manifests) under the same SLO; otherwise `compare_runs` refuses with a ReportError, unless
`allow_mismatch` is set, in which case the mismatches are listed on the card.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from reports.build import build_card, read_manifest
from reports.card import CARD_SCHEMA_VERSION, Card, round_floats
from reports.errors import ReportError
from slo.runrecord import RunManifest

# (key, label, higher_is_better, digits)
ROW_SPECS = (
    ("goodput_request_per_s", "goodput (requests/s)", True, 3),
    ("request_per_s", "requests/s (finished ok)", True, 3),
    ("output_tokens_per_s", "output tokens/s (ok requests)", True, 1),
    ("total_tokens_per_s", "total tokens/s (ok requests)", True, 1),
    ("ttft_p50_ms", "TTFT p50 (ms)", False, 1),
    ("ttft_p99_ms", "TTFT p99 (ms)", False, 1),
    ("tpot_p50_ms", "TPOT p50 (ms)", False, 2),
    ("tpot_p99_ms", "TPOT p99 (ms)", False, 2),
    ("itl_p99_ms", "ITL p99 (ms)", False, 2),
    ("e2e_p50_ms", "E2E p50 (ms)", False, 1),
    ("e2e_p99_ms", "E2E p99 (ms)", False, 1),
    ("failed_fraction", "failed requests (fraction)", False, 4),
    ("dispatch_lag_p99_ms", "client dispatch lag p99 (ms)", False, 3),
)


@dataclass(frozen=True)
class ComparisonRow:
    """One metric across runs; `best` lists the indices of the best value(s) (ties share it).

    `best` is empty when fewer than two runs have a value."""

    key: str
    label: str
    higher_is_better: bool
    digits: int
    values: list[float | None]
    best: list[int]


@dataclass(frozen=True)
class Comparison:
    """The cards of the compared runs, the side-by-side rows and any allowed mismatches."""

    cards: list[Card]
    rows: list[ComparisonRow]
    mismatches: list[str] = field(default_factory=list)
    schema_version: int = CARD_SCHEMA_VERSION

    def to_dict(self, *, decimals: int = 4) -> dict:
        """JSON form: `{schema_version, kind: "comparison", mismatches, rows, cards}`."""
        return round_floats(
            {
                "schema_version": self.schema_version,
                "kind": "comparison",
                "mismatches": list(self.mismatches),
                "rows": [asdict(r) for r in self.rows],
                "cards": [c.to_dict(decimals=decimals) for c in self.cards],
            },
            decimals,
        )

    def to_json(self) -> str:
        """`to_dict()` as indented JSON text (UTF-8, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"


def card_value(card: Card, key: str) -> float | None:
    """The figure named by a ROW_SPECS key, read from `card` (None when absent)."""
    if key == "goodput_request_per_s":
        return card.goodput.request_per_s if card.goodput is not None else None
    if key.endswith("_per_s"):
        return next((t.value for t in card.throughput if t.name == key), None)
    if key == "failed_fraction":
        total = card.failures.total
        return card.failures.failed / total if total else None
    if key == "dispatch_lag_p99_ms":
        return card.client_health.dispatch_lag_p99_ms
    metric, stat, _ = key.split("_")
    row = card.latency_row(metric)
    return None if row is None else getattr(row, f"{stat}_ms")


def best_indices(values: list[float | None], *, higher_is_better: bool) -> list[int]:
    """Indices of the best defined value (all of them on a tie); [] with fewer than two."""
    defined = [(i, v) for i, v in enumerate(values) if v is not None and np.isfinite(v)]
    if len(defined) < 2:
        return []
    target = (max if higher_is_better else min)(v for _, v in defined)
    return [i for i, v in defined if v == target]


def comparison_rows(cards: list[Card]) -> list[ComparisonRow]:
    """ROW_SPECS evaluated on every card, with the best value(s) per row marked."""
    rows = []
    for key, label, higher, digits in ROW_SPECS:
        values = [card_value(c, key) for c in cards]
        if all(v is None for v in values):
            continue
        rows.append(
            ComparisonRow(
                key=key,
                label=label,
                higher_is_better=higher,
                digits=digits,
                values=values,
                best=best_indices(values, higher_is_better=higher),
            )
        )
    return rows


def _short(sha: str | None) -> str:
    return "none recorded" if not sha else sha[:12]


def find_mismatches(manifests: list[tuple[str, RunManifest]]) -> list[str]:
    """Sentences naming each run whose workload hash or SLO differs from the first run's.

    `manifests` pairs a run label with its manifest. A run without a workload hash cannot
    prove it used the same requests and counts as a mismatch.
    """
    (ref_label, ref), *others = manifests
    ref_sha = (ref.workload or {}).get("sha256")
    ref_slo = json.dumps(ref.slo, sort_keys=True)
    sentences = []
    for label, manifest in [(ref_label, ref), *others] if not ref_sha else others:
        sha = (manifest.workload or {}).get("sha256")
        if not sha or sha != ref_sha:
            sentences.append(
                f"run {label} used workload {_short(sha)}, not {_short(ref_sha)} as run {ref_label}"
            )
    for label, manifest in others:
        if json.dumps(manifest.slo, sort_keys=True) != ref_slo:
            name = (manifest.slo or {}).get("name", "none")
            ref_name = (ref.slo or {}).get("name", "none")
            sentences.append(
                f"run {label} was judged by SLO {name!r}, not {ref_name!r} as run {ref_label}"
            )
    return sentences


def compare_runs(
    run_dirs: list[Path | str],
    *,
    allow_mismatch: bool = False,
    rng: np.random.Generator | None = None,
) -> Comparison:
    """Build a Comparison of `run_dirs` (at least one).

    Raises ReportError when the workload hashes or SLOs differ and `allow_mismatch` is false;
    with it, the mismatches are recorded on the comparison. `rng` seeds the cards' bootstrap
    intervals (None: seed 0).
    """
    if not run_dirs:
        raise ReportError("Give at least one run directory to report on.")
    paths = [Path(p) for p in run_dirs]
    labels = [p.name for p in paths]
    if len(set(labels)) != len(labels):
        labels = [str(p) for p in paths]
    manifests = [(label, read_manifest(p)) for label, p in zip(labels, paths, strict=True)]
    mismatches = find_mismatches(manifests) if len(paths) > 1 else []
    if mismatches and not allow_mismatch:
        raise ReportError(
            f"Refusing to compare runs that differ: {'; '.join(mismatches)}; "
            "compare runs of the same workload and SLO, or pass --allow-mismatch."
        )
    rng = rng if rng is not None else np.random.default_rng(0)
    cards = [build_card(p, rng=rng) for p in paths]
    return Comparison(cards=cards, rows=comparison_rows(cards), mismatches=mismatches)
