"""Run directories for the history tests: series of synthetic runs written by the production
writer (`rundir_builder.write_run`, which uses `slo.runrecord.RunWriter`), each given its own
start time and run id through the manifest document (`RunManifest.evolve`), never by hand."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rundir_builder import SyntheticRun, write_run

from slo.runrecord import read_manifest, write_json_atomic
from slo.runrecord.reader import MANIFEST_FILE

START = datetime(2026, 1, 1, 2, 0, tzinfo=UTC)


def restamp(
    run_dir: Path, *, started_at: datetime | None = None, run_id: str | None = None
) -> Path:
    """Give the run its own start time and/or run id in its manifest (other fields kept)."""
    manifest = read_manifest(run_dir)
    changes = {}
    if started_at is not None:
        changes["started_at"] = started_at.isoformat()
    if run_id is not None:
        changes["run_id"] = run_id
    write_json_atomic(run_dir / MANIFEST_FILE, manifest.evolve(**changes).to_json())
    return run_dir


def write_series(root: Path, scales: list[float], *, n_requests: int = 30, **spec) -> list[Path]:
    """One nightly run per entry of `scales` (its latency multiplier), a day apart, seeds 1..n:
    `root/run-01`, `root/run-02`, ... (run ids the directory names)."""
    runs = []
    for i, scale in enumerate(scales):
        path = root / f"run-{i + 1:02d}"
        write_run(
            path, SyntheticRun(n_requests=n_requests, seed=i + 1, latency_scale=scale, **spec)
        )
        runs.append(restamp(path, started_at=START + timedelta(days=i)))
    return runs


def clone_runs(source: Path, root: Path, count: int, prefix: str) -> list[Path]:
    """`count` copies of the run `source`, each its own run (`<prefix>-NNN` as run id and
    directory name, an hour apart)."""
    out = []
    for i in range(count):
        path = root / f"{prefix}-{i:03d}"
        shutil.copytree(source, path)
        out.append(restamp(path, run_id=path.name, started_at=START + timedelta(hours=i)))
    return out
