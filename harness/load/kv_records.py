"""A request's KV-handoff columns, from a prefill/decode cluster's `usage.kv_transfer`.

A P/D cluster prefills a request on one worker and decodes it on another; the reference
engine's router says what that cost in the final usage's `kv_transfer` extension
(docs/CONTRACTS.md, `engine_ref.cluster.pd`): the prefill time, the handoff's bytes and time,
the decode worker's install time, whether it succeeded and how a failure was retried, and
the workers. The run keeps them per request so `slo.disaggregation` can report the link's
effective bandwidth from the run alone.

Every field is read on its own and only when it is what the contract says: a time is a
finite, non-negative number below `MAX_MS`, the bytes a non-negative integer below
`MAX_BYTES` (an integral float passes), `ok` a JSON boolean, `retried` and the workers short
strings. Anything else (a string for a number, `true` for a count, a negative or absurdly
large figure, a list for the object) leaves that column null: a wrong field never fails the
request or the run. A target that sends no `kv_transfer` (every single server, every other
engine) leaves all of them null.

`served_by` names the worker that served the request: the decode worker when the extension
names one, else the answer's `x-bench-worker` header (a cluster's router sends it, for
replicas too), else the prefill worker the extension names.
"""

from __future__ import annotations

import math

from slo.runrecord import RequestColumn, RequestRecord

MAX_MS = 1e9  # about 11.6 days: no handoff takes longer; a larger figure is not a time
MAX_BYTES = 1 << 50  # a pebibyte: no request's KV is larger
MAX_NAME_CHARS = 128

# usage.kv_transfer field -> the column it fills (the wire's names are the router's)
TIMES_MS = (
    ("prefill_ms", RequestColumn.KV_PREFILL_MS),
    ("transfer_ms", RequestColumn.KV_TRANSFER_MS),
    ("install_ms", RequestColumn.KV_INSTALL_MS),
)


def _ms(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0.0 <= value < MAX_MS else None


def _bytes(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and 0 <= value < MAX_BYTES else None


def _name(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS and value.isprintable():
        return value
    return None


def set_kv_transfer(record: RequestRecord, usage: dict, worker_header: str | None) -> None:
    """Fill `record`'s KV-handoff columns and `served_by` from the answer's `usage` and its
    `x-bench-worker` header (module doc); columns the target did not say stay null."""
    transfer = usage.get("kv_transfer") if isinstance(usage, dict) else None
    transfer = transfer if isinstance(transfer, dict) else {}
    for key, column in TIMES_MS:
        setattr(record, str(column), _ms(transfer.get(key)))
    record.kv_transfer_bytes = _bytes(transfer.get("bytes"))
    ok = transfer.get("ok")
    record.kv_transfer_ok = ok if isinstance(ok, bool) else None
    record.kv_transfer_retried = _name(transfer.get("retried"))
    record.served_by = (
        _name(transfer.get("decode_worker"))
        or _name(worker_header)
        or _name(transfer.get("worker"))
    )
