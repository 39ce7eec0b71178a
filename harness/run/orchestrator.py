"""`run_benchmark`: one run end to end, in three steps. Plan (`harness.run.plan`: the workload,
the target's answers, the load plan, the `RunContext`), drive (`harness.run.drive`: the load
phase, here or in workers), finish (`harness.run.finish`: summary, verdict, outcome)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from rich.console import Console

from harness.errors import HarnessError
from harness.http.transport import Transport
from harness.load.ray_workers import require_ray
from harness.load.recorder import prepare_run_dir
from harness.run.config import RunConfig
from harness.run.context import warn
from harness.run.drive import drive, worker_split
from harness.run.extensions import RunExtensions
from harness.run.finish import finish
from harness.run.outcome import RunOutcome
from harness.run.plan import (
    RunInputs,
    materialise_workload,
    metrics_url,
    plan_run,
    release_free_memory,
)
from harness.targets.server_state import read_gauges, settle
from harness.targets.target import Target, launch_plan_for, target_for
from harness.targets.tokenizer_choice import choose_for_run, load_chosen
from slo import SLOError
from slo.spec import as_spec

NO_EXTENSIONS = RunExtensions()


def run_benchmark(
    config: RunConfig,
    *,
    console: Console | None = None,
    quiet: bool = True,
    target: Target | None = None,
    tokenizer=None,
    transport: Transport | None = None,
    extensions: RunExtensions | None = None,
) -> RunOutcome:
    """Run one benchmark end to end and return where its run directory is.

    Bad input raises `HarnessError` before anything is written. Ctrl-C (SIGINT) or SIGTERM
    stops the run: in-flight requests are recorded as `cancelled` and the run directory is
    closed and marked incomplete; the outcome says so. `target` reuses a target the caller
    already started, as a capacity search does for its probes. `transport` replaces the
    aiohttp client for every request (a test double); `extensions` add a target hook and a
    transport layer (`RunExtensions`: what `bench run --faults` composes from
    `config.faults`, which the run does not read itself).
    """
    if config.faults is not None and extensions is None:
        raise HarnessError(
            f"the fault plan {config.faults!r} is composed by the caller: pass "
            "extensions=harness.cli.compose.run_extensions(config), or call "
            "harness.cli.compose.run_benchmark, as bench run does."
        )
    extensions = extensions or NO_EXTENSIONS
    slo_spec = load_slo_spec(config.recording.slo)
    if config.load.ray_address is not None:
        require_ray()  # before anything is contacted: a missing extra is one sentence
    run_dir = Path(config.recording.out or default_run_dir(config))
    with removed_if_left_empty(run_dir):
        prepare_run_dir(run_dir)
        launch = launch_plan_for(config.server) if target is None else target.plan
        choice = choose_for_run(config.server, launch)
        if choice.warning and tokenizer is None:
            warn(console, choice.warning)
        tokenizer = tokenizer or load_chosen(choice)
        inputs = RunInputs(
            config=config,
            workload=materialise_workload(config, tokenizer),
            tokenizer=tokenizer,
            slo_spec=slo_spec,
            run_dir=run_dir,
            console=console,
            quiet=quiet,
            tokenizer_choice=choice,
        )
        if target is not None:
            started = Target(target.base_url, dict(target.entry), target.server, target.plan)
            return run_against(inputs, started, transport, extensions)
        with target_for(
            config.server, log_dir=run_dir, plan=launch, extra_args=extensions.engine_args
        ) as started:
            return run_against(inputs, started, transport, extensions)


def run_against(
    inputs: RunInputs,
    started: Target,
    transport: Transport | None,
    extensions: RunExtensions,
) -> RunOutcome:
    """Plan, drive and finish the run against a target that answers; the run directory is
    closed on every exit path."""
    config = inputs.config
    run = plan_run(inputs, started)
    run.sink_factory = extensions.record_sink
    metrics = metrics_url(started.base_url)
    idle_before = read_gauges(metrics, api_key=config.server.api_key)
    reason: str | None = "the harness stopped unexpectedly"
    server_state = None
    split = worker_split(run, transport)
    try:
        driven = drive(run, split, transport=transport, layer=extensions.transport_layer)
        run.end_energy()  # the load's end: the settle below is not the run's energy
        reason = driven.reason
        death = run.server_death() if reason is None else None
        if death is not None:  # it died after the watch's last look, before the load ended
            run.request_stop(death)
            reason = death
        server_state = settle(
            metrics, idle_before, api_key=config.server.api_key, settle_s=config.recording.settle_s
        )
    except BaseException as exc:
        reason = f"the harness crashed: {type(exc).__name__}: {exc}"
        raise
    finally:
        run.close(reason, server_state)
    stopped_by_errors = run.stop_reason is not None and reason == run.stop_reason
    options, workers = run.options, driven.workers
    # the plan (a request body each, about 1 KB a request) is done with: the summary's memory
    # should not grow with it (issue "Runs that last")
    del run, driven
    release_free_memory()
    return finish(
        inputs.run_dir,
        reason=reason,
        stopped_by_errors=stopped_by_errors,
        slo_spec=inputs.slo_spec,
        client_bound_ms=config.recording.client_bound_ms,
        check_outputs=config.recording.check_outputs,
        options=options,
        split=split,
        workers=workers,
    )


def default_run_dir(config: RunConfig) -> Path:
    """`runs/<time>-<workload name>`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workload = config.load.workload
    name = Path(workload).stem if Path(workload).suffix else workload
    return Path("runs") / f"{stamp}-{name}"


def load_tokenizer_for(config: RunConfig, plan=None):
    """The tokenizer that counts prompt tokens (and output tokens where usage is missing): the
    model under test's (see `harness.targets.tokenizer_choice`)."""
    return load_chosen(choose_for_run(config.server, plan))


def load_slo_spec(name: str | dict | None) -> dict | None:
    """The SLO spec dict for `--slo` (a name or file) or for one already built (`--goodput`)."""
    if name is None:
        return None
    try:
        return as_spec(name).to_dict()
    except SLOError as exc:
        raise HarnessError(str(exc)) from exc


@contextlib.contextmanager
def removed_if_left_empty(run_dir: Path):
    """Remove `run_dir` again when the run fails before writing anything into it (a bad
    workload, an unreachable target), so a refused run leaves nothing on disk."""
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first
    try:
        yield
    except BaseException:
        for path in created:  # the run directory, then parents made for it (e.g. runs/)
            if not path.is_dir() or any(path.iterdir()):
                break
            path.rmdir()
        raise
