"""The live progress display: an observer of the load loop, shown only on a terminal."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.http.client import RawResult
from slo.runrecord import RequestStatus


class ProgressDisplay:
    """Counts done, in-flight and failed requests and an approximate output token rate.

    Tokens are estimated by counting `data:` events in finished streams (cheap bytes scans);
    the exact figures come from the recorded tables afterwards.
    """

    def __init__(self, total: int, console: Console) -> None:
        self.total = total
        self.done = 0
        self.in_flight = 0
        self.failed = 0
        self.events = 0
        self._t_start = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold]requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("run", total=total, detail="")

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._refresh()
        self._progress.stop()

    def on_sent(self, raw: RawResult) -> None:
        if not raw.is_warmup:
            self.in_flight += 1

    def on_done(self, raw: RawResult) -> None:
        if raw.is_warmup:
            return
        self.in_flight -= 1
        self.done += 1
        if raw.status not in (None, RequestStatus.OK):
            self.failed += 1
        self.events += sum(data.count(b"data:") for _, data in raw.reads)
        self._refresh()

    def _refresh(self) -> None:
        elapsed = max(time.perf_counter() - self._t_start, 1e-9)
        detail = (
            f"in flight {self.in_flight}  errors {self.failed}  ~{self.events / elapsed:,.0f} tok/s"
        )
        self._progress.update(self._task, completed=self.done, detail=detail)
