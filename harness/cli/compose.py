"""What `bench run` composes around a run from its flags: the fault plan of `--faults`, as a
target hook (the managed engine's arguments) and a transport layer (the fault session)."""

from __future__ import annotations

from faults.plan import FaultPlan, FaultPlanError, load_plan
from faults.session import FaultSession
from harness.errors import HarnessError
from harness.http.client import ClientOptions
from harness.run import orchestrator
from harness.run.config import RunConfig
from harness.run.extensions import RunExtensions
from harness.run.outcome import RunOutcome
from harness.targets.process import ServerProcess


def load_fault_plan(name: str | None) -> FaultPlan | None:
    """The `faults.plan.FaultPlan` named by `--faults` (a file or a built-in), or None."""
    if name is None:
        return None
    try:
        return load_plan(name)
    except FaultPlanError as exc:
        raise HarnessError(str(exc)) from exc


def run_extensions(config: RunConfig) -> RunExtensions | None:
    """The `RunExtensions` of `config.faults` (None without a fault plan): the plan's engine
    arguments for a managed engine, and a fault session (proxy, client faults, engine faults)
    in front of the target while the load runs."""
    plan = load_fault_plan(config.faults)
    if plan is None:
        return None

    def fault_session(
        options: ClientOptions, server: ServerProcess | None, max_connections: int
    ) -> FaultSession:
        return FaultSession(plan, options, server=server, max_connections=max_connections)

    return RunExtensions(engine_args=plan.managed_engine_args, transport_layer=fault_session)


def run_benchmark(config: RunConfig, **kwargs) -> RunOutcome:
    """`harness.run.orchestrator.run_benchmark` with what `bench run` composes from `config`
    (its fault plan); `kwargs` are passed on (console, quiet, target, tokenizer, transport)."""
    return orchestrator.run_benchmark(config, extensions=run_extensions(config), **kwargs)
