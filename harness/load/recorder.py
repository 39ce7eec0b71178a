"""The harness side of the run directory: parse raw results in batches and hand the rows to
`slo.runrecord.RunWriter`, which owns the files and their schemas.

Raw results are kept until `flush` (every few seconds), so no parsing sits on the per-read hot
path; each flush appends one row group per table, so an interrupted run is readable. The raw
bytes kept are bounded too: once the finished results waiting hold `max_pending_bytes`, adding
one more flushes them, so a fast stream's memory is bounded by that, not by the flush interval.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.errors import HarnessError
from harness.http.client import RawResult
from harness.load.records import RecordContext, to_rows
from slo.runrecord import RunManifest, RunWriter


def prepare_run_dir(path: Path) -> Path:
    """Create an empty run directory; refuse one that already holds a run or is unwritable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HarnessError(f"--out {path} is a file, not a directory; choose another --out.")
    if path.is_dir() and any(path.iterdir()):
        raise HarnessError(
            f"--out {path} already holds files; choose an empty or new directory so nothing recorded is overwritten."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HarnessError(
            f"cannot write the run directory {path}: {exc.strerror or exc}."
        ) from exc
    return path


# Raw bytes of finished requests kept before a flush is forced: about 130k streamed tokens of
# a typical completions stream, a fraction of a second of parsing.
DEFAULT_MAX_PENDING_BYTES = 16 * 2**20


@dataclass
class RunRecorder:
    """Accumulates raw results and writes them through a `RunWriter`."""

    run_dir: Path
    context: RecordContext
    input_tokens: dict[str, int]
    manifest: RunManifest
    on_records: Callable[[list], None] | None = None  # sees each flush's measured rows
    # sees each flush's measured rows and each one's first stream event (ns from t0)
    on_batch: Callable[[list, dict[str, int]], None] | None = None
    sessions: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (session, turn)
    classes: dict[str, tuple] = field(default_factory=dict)  # id -> (priority, deadline, tenant)
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    _pending: list[RawResult] = field(default_factory=list)
    _pending_bytes: int = 0
    writer: RunWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = RunWriter(self.run_dir, self.manifest)

    @property
    def closed(self) -> bool:
        return self.writer.closed

    def add(self, raw: RawResult) -> None:
        """Keep a finished request's raw timeline until the next flush (cheap: no parsing);
        flush now if the results waiting hold `max_pending_bytes` or more."""
        self._pending.append(raw)
        self._pending_bytes += sum(len(data) for _, data in raw.reads) + len(raw.body or b"")
        if self._pending_bytes >= self.max_pending_bytes:
            self.flush()

    def flush(self) -> None:
        """Parse pending results and append them as one row group per table."""
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        records, warm_records, chunks = [], [], []
        for raw in pending:
            rid = raw.request_id
            record, rows = to_rows(
                raw,
                self.input_tokens.get(rid),
                self.context,
                self.sessions.get(rid),
                self.classes.get(rid),
            )
            if raw.is_warmup:
                warm_records.append(record)
            else:
                records.append(record)
                if len(rows):
                    chunks.append(rows)
        if self.on_records is not None:
            self.on_records(records)
        if self.on_batch is not None:
            self.on_batch(records, {rows.request_id: int(rows.t_ns.min()) for rows in chunks})
        self.writer.append_requests(records)
        self.writer.append_warmup(warm_records)
        if chunks:
            self.writer.append_chunk_columns(
                [rows.request_id for rows in chunks],
                np.array([len(rows) for rows in chunks], np.int64),
                np.concatenate([rows.t_ns for rows in chunks]),
                np.concatenate([rows.n_tokens for rows in chunks]),
                np.concatenate([rows.n_chars for rows in chunks]),
                reasoning=np.concatenate(
                    [
                        np.zeros(len(rows), bool) if rows.reasoning is None else rows.reasoning
                        for rows in chunks
                    ]
                ),
            )

    def close(self, *, complete: bool, reason: str | None = None, **manifest_changes) -> None:
        """Flush, close the tables and rewrite the manifest with the run's end state. Idempotent."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.writer.close(complete=complete, reason=reason, **manifest_changes)
