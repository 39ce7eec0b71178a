"""The failure taxonomy: which kind of outcome each request had.

Every request falls in exactly one kind, decided in this order:
- `oom`: not ok, and the error message or class says the server ran out of memory;
- `rejected`: status `rejected`, error class `rejected_429` or HTTP 429;
- `timeout`: status `timeout` or error class `timeout`;
- `cancelled`: status `cancelled`;
- `unknown`: status `unknown` or missing (the outcome is not known: e.g. a reset mid-stream);
- `error`: any other status that is not `ok`;
- `wrong_output`: status `ok` but the output is unusable: the run table marks it
  (`output_valid` false, where a verifier wrote that column) or no output token came back
  (from a generation request: an embeddings or rerank request, with its `num_texts`, generates
  none);
- `ok`: everything else.
"""

from __future__ import annotations

import re
from enum import StrEnum

import numpy as np
import pyarrow as pa

from slo.runrecord import (
    ErrorClass,
    RequestColumn,
    RequestStatus,
    float_column,
    string_column,
)


class OutcomeKind(StrEnum):
    """The card's outcome kinds (a request status refined by the checks above), in card order."""

    OK = "ok"
    REJECTED = "rejected"
    TIMEOUT = "timeout"
    OOM = "oom"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
    WRONG_OUTPUT = "wrong_output"
    ERROR = "error"
    NOT_SENT = "not_sent"  # scheduled, never sent: the run stopped first


OUTCOME_KINDS = tuple(kind.value for kind in OutcomeKind)
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
    generates = np.isnan(float_column(requests, RequestColumn.NUM_TEXTS))
    kinds = np.empty(requests.num_rows, dtype=object)
    for i in range(requests.num_rows):
        s, cls, msg = status[i], error_class[i], message[i]
        if s == RequestStatus.NOT_SENT:
            kinds[i] = OutcomeKind.NOT_SENT.value
        elif s == RequestStatus.OK:
            silent = generates[i] and not output_tokens[i] > 0
            unusable = (valid is not None and not valid[i]) or silent
            kinds[i] = (OutcomeKind.WRONG_OUTPUT if unusable else OutcomeKind.OK).value
        elif _OOM_PATTERN.search(f"{msg or ''} {cls or ''}"):
            kinds[i] = OutcomeKind.OOM.value
        elif s == RequestStatus.REJECTED or cls == ErrorClass.REJECTED_429 or http[i] == 429:
            kinds[i] = OutcomeKind.REJECTED.value
        elif s == RequestStatus.TIMEOUT or cls == ErrorClass.TIMEOUT:
            kinds[i] = OutcomeKind.TIMEOUT.value
        elif s == RequestStatus.CANCELLED:
            kinds[i] = OutcomeKind.CANCELLED.value
        elif s is None or s == RequestStatus.UNKNOWN:
            kinds[i] = OutcomeKind.UNKNOWN.value
        else:
            kinds[i] = OutcomeKind.ERROR.value
    return kinds


def count_outcomes(kinds: np.ndarray) -> dict[str, int]:
    """`{kind: count}` for every OUTCOME_KINDS entry (0 when absent), in OUTCOME_KINDS order."""
    return {kind: int(np.count_nonzero(kinds == kind)) for kind in OUTCOME_KINDS}
