"""The run-record contract: everything a run directory holds, defined once.

`harness/` writes run directories with `RunWriter`; `slo/` and `reports/` read them with
`open_run`. Column names, statuses, error classes, token sources and endpoints are members of
the enums here, so no other module spells them. This package imports nothing else of the
project. `docs/CONTRACTS.md` is checked against it by `tests/slo/test_runrecord.py`.
"""

from slo.runrecord.documents import (
    MANIFEST_SCHEMA_VERSION,
    SUMMARY_SCHEMA_VERSION,
    RunManifest,
    RunSummary,
    write_json_atomic,
)
from slo.runrecord.enums import Endpoint, ErrorClass, OutputFlag, RequestStatus, TokenSource
from slo.runrecord.errors import RunRecordError
from slo.runrecord.reader import (
    RunTables,
    float_column,
    open_run,
    read_manifest,
    read_summary,
    string_column,
)
from slo.runrecord.schema import (
    CHUNKS_SCHEMA,
    REQUEST_TIME_COLUMNS,
    REQUESTS_SCHEMA,
    SCHEDULE_SCHEMA,
    SERVER_METRICS_SCHEMA,
    ChunkColumn,
    ChunkRecord,
    RequestColumn,
    RequestRecord,
    ScheduleColumn,
    ServerMetricColumn,
)
from slo.runrecord.writer import RunWriter, write_server_metrics, write_summary

__all__ = [
    "CHUNKS_SCHEMA",
    "MANIFEST_SCHEMA_VERSION",
    "REQUESTS_SCHEMA",
    "REQUEST_TIME_COLUMNS",
    "SCHEDULE_SCHEMA",
    "SERVER_METRICS_SCHEMA",
    "SUMMARY_SCHEMA_VERSION",
    "ChunkColumn",
    "ChunkRecord",
    "Endpoint",
    "ErrorClass",
    "OutputFlag",
    "RequestColumn",
    "RequestRecord",
    "RequestStatus",
    "RunManifest",
    "RunRecordError",
    "RunSummary",
    "RunTables",
    "RunWriter",
    "ScheduleColumn",
    "ServerMetricColumn",
    "TokenSource",
    "float_column",
    "open_run",
    "read_manifest",
    "read_summary",
    "string_column",
    "write_json_atomic",
    "write_server_metrics",
    "write_summary",
]
