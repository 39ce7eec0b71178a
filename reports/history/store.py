"""The run history: one DuckDB file (default under the cache root) holding every added run's
keys and headline figures.

DuckDB lets one process at a time open a file for writing; a second process trying meanwhile
gets a lock error. Every command therefore holds the file only for its few statements (the
run directories are read before it is opened), and a connection that finds it locked retries
with a growing pause up to `lock_timeout_s` (default 60 s), then says so in one sentence.
So two `bench history add` started together both land, one after the other; nothing is lost.

`add` is idempotent: a run whose `run_id` is already present is left as it was (reported as
present). A file that is not a DuckDB database, a DuckDB file without the history's tables,
and a history written by a newer bench are refused with a sentence naming the file.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from bench_common.cache import CacheArea, cache_area
from reports.errors import ReportError
from reports.history.record import HistoryRun, MetricPoint, SeriesKey
from reports.history.schema import (
    CREATE_CURRENT,
    METRIC_COLUMNS,
    MIGRATIONS,
    RUN_COLUMNS,
    SCHEMA_VERSION,
)

HISTORY_FILE = "history.duckdb"
DEFAULT_LOCK_TIMEOUT_S = 60.0


def default_history_path() -> Path:
    """`<cache root>/history/history.duckdb` (`BENCH_CACHE_DIR` moves the root)."""
    return cache_area(CacheArea.HISTORY) / HISTORY_FILE


@dataclass(frozen=True)
class AddResult:
    """Run ids newly added and those the history already had."""

    added: list[str]
    present: list[str]


def _is_lock_error(exc: Exception) -> bool:
    return "lock" in str(exc).lower()


class HistoryStore:
    """The history database at `path`; every method opens it, works, and closes it."""

    def __init__(self, path: Path | str, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S):
        self.path = Path(path)
        self.lock_timeout_s = lock_timeout_s

    @property
    def exists(self) -> bool:
        return self.path.is_file()

    @contextmanager
    def connect(self, *, create: bool = False) -> Iterator:
        """A connection to a ready database (created when `create`, migrated when old)."""
        import duckdb

        if not self.exists and not create:
            raise ReportError(
                f"there is no history at {self.path} yet; add runs with `bench history add RUN`."
            )
        if create and not self.exists:
            self._create(duckdb)
        con = self._open(duckdb)
        try:
            self._prepare(con, duckdb)
            yield con
        finally:
            con.close()

    def _create(self, duckdb) -> None:
        """A new, empty history at `path`, appearing there whole: built in a file of its own
        and linked into place, so a second process creating it at the same moment never opens
        a file the first has only begun to write (it read as "not a readable history
        database" and its `add` failed). The one that links second keeps the first's."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
            fresh.unlink(missing_ok=True)
            con = duckdb.connect(str(fresh))
            try:
                self._apply(con, CREATE_CURRENT)
            finally:
                con.close()
            try:
                os.link(fresh, self.path)
            except FileExistsError:
                pass  # another process created it first: theirs is the history
            finally:
                fresh.unlink(missing_ok=True)
        except (OSError, duckdb.Error) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise ReportError(f"cannot create {self.path} ({why}).") from None

    def _open(self, duckdb):
        deadline = time.monotonic() + self.lock_timeout_s
        pause_s = 0.01
        while True:
            try:
                return duckdb.connect(str(self.path))
            except duckdb.Error as exc:
                if not _is_lock_error(exc):
                    raise ReportError(
                        f"{self.path} is not a readable history database ({exc}); move it "
                        "aside or pass --history with another file."
                    ) from None
                if time.monotonic() >= deadline:
                    raise ReportError(
                        f"another process kept {self.path} locked for {self.lock_timeout_s:g} s; "
                        "try again when it has finished."
                    ) from None
            time.sleep(pause_s * (0.5 + random.random()))  # jittered, so two waiters part
            pause_s = min(pause_s * 2, 0.2)

    def _prepare(self, con, duckdb) -> None:
        tables = {
            row[0] for row in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
        }
        if not tables:
            self._apply(con, CREATE_CURRENT)
            return
        if "schema_version" not in tables:
            raise ReportError(
                f"{self.path} is a DuckDB database but not a bench history (no schema_version "
                "table); pass --history with another file."
            )
        row = con.execute("SELECT max(version) FROM schema_version").fetchone()
        version = row[0] if row else None
        if version is None or version > SCHEMA_VERSION:
            raise ReportError(
                f"{self.path} has history schema version {version}, which this bench does not "
                f"read (it reads up to {SCHEMA_VERSION}); upgrade bench or pass another --history."
            )
        steps = [s for v in range(version, SCHEMA_VERSION) for s in MIGRATIONS[v]]
        if steps:
            self._apply(con, steps)

    @staticmethod
    def _apply(con, statements) -> None:
        con.execute("BEGIN TRANSACTION")
        try:
            for statement in statements:
                con.execute(statement)
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise

    def add(self, runs: list[HistoryRun]) -> AddResult:
        """Add `runs` in one transaction; those whose run id is present are skipped (and
        a run given twice is added once)."""
        unique = list({r.run_id: r for r in runs}.values())
        now = datetime.now(UTC).replace(tzinfo=None)
        with self.connect(create=True) as con:
            con.execute("BEGIN TRANSACTION")
            try:
                ids = pa.table({"run_id": [r.run_id for r in unique]})
                con.register("candidate_ids", ids)
                present = {
                    row[0]
                    for row in con.execute(
                        "SELECT run_id FROM runs WHERE run_id IN (SELECT run_id FROM candidate_ids)"
                    ).fetchall()
                }
                new = [r for r in unique if r.run_id not in present]
                if new:
                    con.register("new_runs", _runs_table(new, now))
                    con.register("new_metrics", _metrics_table(new))
                    con.execute(
                        f"INSERT INTO runs ({', '.join(RUN_COLUMNS)}) SELECT * FROM new_runs"
                    )
                    con.execute("INSERT INTO metrics SELECT * FROM new_metrics")
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise
        return AddResult(added=[r.run_id for r in new], present=sorted(present))

    def runs(self) -> list[HistoryRun]:
        """Every run with its figures, oldest first (by start time, then time added, then id)."""
        with self.connect() as con:
            rows = con.execute(
                f"SELECT {', '.join(RUN_COLUMNS)} FROM runs "
                "ORDER BY started_at NULLS LAST, added_at, run_id"
            ).fetchall()
            metric_rows = con.execute(f"SELECT {', '.join(METRIC_COLUMNS)} FROM metrics").fetchall()
        points: dict[str, dict[str, MetricPoint]] = {}
        for run_id, metric, value, low, high, n in metric_rows:
            points.setdefault(run_id, {})[metric] = MetricPoint(value, low, high, n)
        out = []
        for row in rows:
            data = dict(zip(RUN_COLUMNS, row, strict=True))
            key = SeriesKey(
                **{f: data[f] for f in SeriesKey.__dataclass_fields__}  # the key columns
            )
            out.append(
                HistoryRun(
                    run_id=data["run_id"],
                    key=key,
                    run_dir=data["run_dir"],
                    started_at=data["started_at"],
                    complete=data["complete"],
                    n_requests=data["n_requests"],
                    slo_name=data["slo_name"],
                    git_sha=data["git_sha"],
                    metrics=points.get(data["run_id"], {}),
                )
            )
        return out

    def count(self) -> int:
        """How many runs the history holds (0 when there is no file yet)."""
        if not self.exists:
            return 0
        with self.connect() as con:
            return int(con.execute("SELECT count(*) FROM runs").fetchone()[0])


def _runs_table(runs: list[HistoryRun], added_at: datetime) -> pa.Table:
    columns = {name: [] for name in RUN_COLUMNS}
    for run in runs:
        row = {
            "run_id": run.run_id,
            "series_id": run.key.series_id,
            "started_at": run.started_at,
            "added_at": added_at,
            "run_dir": run.run_dir,
            "complete": run.complete,
            "n_requests": run.n_requests,
            "slo_name": run.slo_name,
            "git_sha": run.git_sha,
            **{f: getattr(run.key, f) for f in SeriesKey.__dataclass_fields__},
        }
        for name in RUN_COLUMNS:
            columns[name].append(row[name])
    types = {"started_at": pa.timestamp("us"), "added_at": pa.timestamp("us"),
             "complete": pa.bool_(), "n_requests": pa.int64()}  # fmt: skip
    return pa.table({n: pa.array(v, type=types.get(n, pa.string())) for n, v in columns.items()})


def _metrics_table(runs: list[HistoryRun]) -> pa.Table:
    rows = [
        (run.run_id, key, p.value, p.ci_low, p.ci_high, p.n)
        for run in runs
        for key, p in run.metrics.items()
    ]
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in METRIC_COLUMNS]
    types = (pa.string(), pa.string(), pa.float64(), pa.float64(), pa.float64(), pa.int64())
    return pa.table(
        {
            n: pa.array(list(c), type=t)
            for n, c, t in zip(METRIC_COLUMNS, columns, types, strict=True)
        }
    )
