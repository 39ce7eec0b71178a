"""The failure taxonomy: which kind of outcome each request had.

Every request falls in exactly one kind, decided in this order:
- `oom`: not ok, and the error message or class says the server ran out of memory;
- `rejected`: status `rejected`, error class `rejected_429` or HTTP 429;
- `timeout`: status `timeout` or error class `timeout`;
- `cancelled`: status `cancelled`;
- `unknown`: status `unknown` or missing (the outcome is not known: e.g. a reset mid-stream);
- `error`: any other status that is not `ok`;
- `wrong_output`: status `ok` but the output is unusable: the run table marks it
  (`output_valid` false, where a verifier wrote that column) or no output token came back;
- `ok`: everything else.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from slo.runrecord import (
    ErrorClass,
    RequestColumn,
    RequestStatus,
    float_column,
    string_column,
)

OUTCOME_KINDS = (
    "ok",
    "rejected",
    "timeout",
    "oom",
    "cancelled",
    "unknown",
    "wrong_output",
    "error",
)
_OOM_PATTERN = re.compile(r"out of memory|\boom\b|outofmemory|memoryerror", re.IGNORECASE)


def _bool_column(table: pa.Table, name: str) -> np.ndarray | None:
    if name not in table.column_names:
        return None
    return np.asarray([v if v is not None else True for v in table[name].to_pylist()], dtype=bool)


def classify_outcomes(requests: pa.Table) -> np.ndarray:
    """One OUTCOME_KINDS string per row of a contract `requests` table (object array)."""
    status = string_column(requests, RequestColumn.STATUS)
    error_class = string_column(requests, RequestColumn.ERROR_CLASS)
    message = string_column(requests, RequestColumn.ERROR_MESSAGE)
    http = float_column(requests, RequestColumn.HTTP_STATUS)
    output_tokens = float_column(requests, RequestColumn.OUTPUT_TOKENS)
    valid = _bool_column(requests, RequestColumn.OUTPUT_VALID)
    kinds = np.empty(requests.num_rows, dtype=object)
    for i in range(requests.num_rows):
        s, cls, msg = status[i], error_class[i], message[i]
        if s == RequestStatus.OK:
            unusable = (valid is not None and not valid[i]) or not output_tokens[i] > 0
            kinds[i] = "wrong_output" if unusable else "ok"
        elif _OOM_PATTERN.search(f"{msg or ''} {cls or ''}"):
            kinds[i] = "oom"
        elif s == RequestStatus.REJECTED or cls == ErrorClass.REJECTED_429 or http[i] == 429:
            kinds[i] = "rejected"
        elif s == RequestStatus.TIMEOUT or cls == ErrorClass.TIMEOUT:
            kinds[i] = "timeout"
        elif s == RequestStatus.CANCELLED:
            kinds[i] = "cancelled"
        elif s is None or s == RequestStatus.UNKNOWN:
            kinds[i] = "unknown"
        else:
            kinds[i] = "error"
    return kinds


def count_outcomes(kinds: np.ndarray) -> dict[str, int]:
    """`{kind: count}` for every OUTCOME_KINDS entry (0 when absent), in OUTCOME_KINDS order."""
    return {kind: int(np.count_nonzero(kinds == kind)) for kind in OUTCOME_KINDS}
