"""The seam a caller plugs into a run: `RunExtensions`, a target hook, a transport layer and a
record sink.

The CLI composes a fault plan and an OTLP push into one (`harness.cli.compose`); the run calls
what it holds at three points and knows nothing else of it: the managed engine's command line
when the target is started, the transport every request goes through while the load runs, and
the sink each flush's measured records are handed to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.http.client import ClientOptions
from harness.http.transport import Transport
from harness.targets.process import ServerProcess
from slo.runrecord import RequestRecord, RunManifest


class TransportLayer(Transport, Protocol):
    """A transport put between the load generator and the target for one run's load phase
    (a fault session is one). The run enters it around the load, calls `start` when the
    measured phase begins and, once it closed, records `manifest_changes()` in the manifest."""

    def start(self, t0_ns: int) -> None:
        """The measured phase began at `t0_ns` (a `time.perf_counter_ns()` value)."""

    def manifest_changes(self) -> dict:
        """Manifest sections to record, `RunManifest` field name -> value."""


# (the run's client options, the server the harness started or None, the pool size) -> layer
TransportLayerFactory = Callable[[ClientOptions, ServerProcess | None, int], TransportLayer]


class RecordSink(Protocol):
    """Sees the run's measured records as they are written (an OTLP push is one). `add` is
    called on the load's event loop after each flush and must return at once; `close` once
    after the last flush (it may wait, boundedly); then the run records `manifest_changes()`
    in the manifest and says `warning()`, when there is one, on the console."""

    def add(self, records: list[RequestRecord], first_chunk_ns: dict[str, int]) -> None:
        """One flush's measured records and, per request id, its first stream event (ns from
        t0; requests without one are absent)."""

    def close(self, *, complete: bool) -> None:
        """The run ended (`complete`: it was not stopped early)."""

    def manifest_changes(self) -> dict:
        """Manifest sections to record, `RunManifest` field name -> value."""

    def warning(self) -> str | None:
        """One sentence for the console, or None."""


# (the run's manifest when the measured phase begins, the run directory) -> sink
RecordSinkFactory = Callable[[RunManifest, Path], RecordSink]


@dataclass(frozen=True)
class RunExtensions:
    """What a caller adds to a run without the run knowing what it is.

    - `engine_args`: the target hook: arguments a managed engine is started with for the
      whole run, after `--server-arg`s (only the reference engine understands them; a managed
      external engine refuses them in one sentence).
    - `transport_layer`: called once the target answered its preflight; the layer it returns
      carries every request of the load phase in place of the aiohttp transport (one process
      only: `RunConfig` refuses a fault plan with `--workers`). None: requests go straight
      to the target.
    - `record_sink`: called when the measured phase begins; the sink it returns sees every
      flush's measured records (`RecordSink`). None: nothing does.
    """

    engine_args: tuple[str, ...] = ()
    transport_layer: TransportLayerFactory | None = None
    record_sink: RecordSinkFactory | None = None
