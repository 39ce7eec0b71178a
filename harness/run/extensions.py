"""The seam a caller plugs into a run: `RunExtensions`, a target hook and a transport layer.

The CLI composes a fault plan into one (`harness.cli.compose`); the run calls what it holds at
two points and knows nothing else of it: the managed engine's command line when the target is
started, and the transport every request goes through while the load runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from harness.http.client import ClientOptions
from harness.http.transport import Transport
from harness.targets.process import ServerProcess


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
    """

    engine_args: tuple[str, ...] = ()
    transport_layer: TransportLayerFactory | None = None
