"""Workloads: specs, length distributions, arrival processes, dataset and trace loaders,
token-exact prompt synthesis and manifests. The harness calls `resolve_workload`."""

from workloads.options import WorkloadOptions
from workloads.registry import builtin_names, resolve_workload
from workloads.schema import REQUEST_SCHEMA, Workload, WorkloadError, table_sha256
from workloads.store import read_parquet, write_parquet

__all__ = [
    "REQUEST_SCHEMA",
    "Workload",
    "WorkloadError",
    "WorkloadOptions",
    "builtin_names",
    "read_parquet",
    "resolve_workload",
    "table_sha256",
    "write_parquet",
]
