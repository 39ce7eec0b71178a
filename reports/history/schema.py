"""The history database's tables, by schema version, and the steps from each version to the next.

A database records its version in `schema_version` (one row). Opening one written by an older
bench applies the steps in `MIGRATIONS` in order, in one transaction, so a history survives
upgrades; one written by a newer bench is refused (this code cannot know its columns).

Versions:
1. `runs` (one row per run: keys, where its directory was, when it started) and `metrics`
   (one row per run and figure: value, interval, n).
2. `runs.series_id`: the comparability key as one column (`SeriesKey.series_id`), so a series
   is one equality instead of seven; the migration backfills it from the key columns with the
   same md5 expression Python uses.
3. `runs.request_api`: how the requests were sent, when not streamed completions (e.g. `chat`,
   `embeddings, batch 8`), a key column: runs of one workload against other APIs measure other
   things. Older rows hold no value (""), as streamed completions runs do; `series_id` is
   recomputed with it.
"""

from __future__ import annotations

SCHEMA_VERSION = 3

_RUNS_V1 = """
CREATE TABLE runs (
    run_id VARCHAR PRIMARY KEY,
    started_at TIMESTAMP,
    added_at TIMESTAMP NOT NULL,
    run_dir VARCHAR NOT NULL,
    complete BOOLEAN,
    n_requests BIGINT,
    workload_name VARCHAR,
    workload_sha256 VARCHAR,
    engine VARCHAR,
    engine_version VARCHAR,
    model VARCHAR,
    model_sha256 VARCHAR,
    dtype VARCHAR,
    hardware VARCHAR,
    slo_name VARCHAR,
    git_sha VARCHAR
)"""

_METRICS_V1 = """
CREATE TABLE metrics (
    run_id VARCHAR NOT NULL,
    metric VARCHAR NOT NULL,
    value DOUBLE NOT NULL,
    ci_low DOUBLE,
    ci_high DOUBLE,
    n BIGINT,
    PRIMARY KEY (run_id, metric)
)"""

# The first schema, kept so a test can write a version-1 database and open it with this code.
CREATE_V1 = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    _RUNS_V1,
    _METRICS_V1,
    "INSERT INTO schema_version VALUES (1)",
)

# The key columns joined by U+001F (NULL as ""), md5, first 12 hex digits: SeriesKey.series_id
# (version 2's key had no `request_api`).
_KEY_SQL_V2 = (
    "coalesce(workload_sha256, ''), coalesce(engine, ''), coalesce(engine_version, ''), "
    "coalesce(model, ''), coalesce(model_sha256, ''), coalesce(dtype, ''), coalesce(hardware, '')"
)
SERIES_ID_SQL_V2 = f"substr(md5(concat_ws(chr(31), {_KEY_SQL_V2})), 1, 12)"
SERIES_ID_SQL = f"substr(md5(concat_ws(chr(31), {_KEY_SQL_V2}, coalesce(request_api, ''))), 1, 12)"

# version -> the statements that take a database from it to version + 1.
MIGRATIONS = {
    1: (
        "ALTER TABLE runs ADD COLUMN series_id VARCHAR",
        f"UPDATE runs SET series_id = {SERIES_ID_SQL_V2}",
        "UPDATE schema_version SET version = 2",
    ),
    2: (
        "ALTER TABLE runs ADD COLUMN request_api VARCHAR",
        f"UPDATE runs SET series_id = {SERIES_ID_SQL}",
        "UPDATE schema_version SET version = 3",
    ),
}

CREATE_CURRENT = (
    *CREATE_V1[:-1],
    MIGRATIONS[1][0],
    MIGRATIONS[2][0],
    f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION})",
)

RUN_COLUMNS = (
    "run_id",
    "series_id",
    "started_at",
    "added_at",
    "run_dir",
    "complete",
    "n_requests",
    "workload_name",
    "workload_sha256",
    "engine",
    "engine_version",
    "model",
    "model_sha256",
    "dtype",
    "hardware",
    "request_api",
    "slo_name",
    "git_sha",
)
METRIC_COLUMNS = ("run_id", "metric", "value", "ci_low", "ci_high", "n")
