"""What `bench run` composes around a run from its flags: the fault plan of `--faults`, as a
target hook (the managed engine's arguments) and a transport layer (the fault session), and
the live OTLP push of `--otlp`, as a record sink."""

from __future__ import annotations

from pathlib import Path

from faults.plan import FaultPlan, FaultPlanError, load_plan
from faults.session import FaultSession
from harness.errors import HarnessError
from harness.http.client import ClientOptions
from harness.run import orchestrator
from harness.run.config import RunConfig
from harness.run.extensions import RecordSinkFactory, RunExtensions
from harness.run.outcome import RunOutcome
from harness.targets.process import ServerProcess
from reports.exports.otlp_live import OtlpEndpoint, OtlpPush
from slo.runrecord import RunManifest


def load_fault_plan(name: str | None) -> FaultPlan | None:
    """The `faults.plan.FaultPlan` named by `--faults` (a file or a built-in), or None."""
    if name is None:
        return None
    try:
        return load_plan(name)
    except FaultPlanError as exc:
        raise HarnessError(str(exc)) from exc


def otlp_sink(endpoint: OtlpEndpoint, **limits) -> RecordSinkFactory:
    """The record sink factory of `--otlp`: each run pushes its spans to `endpoint`
    (`limits`: `OtlpPush`'s bounds, its defaults when none are given)."""

    def push(manifest: RunManifest, run_dir: Path) -> OtlpPush:
        return OtlpPush(endpoint, manifest, run_dir, **limits)

    return push


def run_extensions(config: RunConfig, otlp: OtlpEndpoint | None = None) -> RunExtensions | None:
    """The `RunExtensions` of `config.faults` and `otlp` (None with neither): the fault plan's
    engine arguments for a managed engine and a fault session (proxy, client faults, engine
    faults) in front of the target while the load runs; the OTLP push as a record sink."""
    plan = load_fault_plan(config.faults)
    sink = otlp_sink(otlp) if otlp is not None else None
    if plan is None:
        return RunExtensions(record_sink=sink) if sink is not None else None

    def fault_session(
        options: ClientOptions, server: ServerProcess | None, max_connections: int
    ) -> FaultSession:
        return FaultSession(plan, options, server=server, max_connections=max_connections)

    return RunExtensions(
        engine_args=plan.managed_engine_args, transport_layer=fault_session, record_sink=sink
    )


def run_benchmark(config: RunConfig, **kwargs) -> RunOutcome:
    """`harness.run.orchestrator.run_benchmark` with what `bench run` composes from `config`
    (its fault plan); `kwargs` are passed on (console, quiet, target, tokenizer, transport)."""
    return orchestrator.run_benchmark(config, extensions=run_extensions(config), **kwargs)
