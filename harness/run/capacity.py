"""Capacity search wired to real runs: each probe is a `bench run` at one request rate."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.run.config import RunConfig
from harness.run.orchestrator import load_tokenizer_for, run_benchmark
from harness.targets.target import launch_plan_for, target_for
from slo import load_slo
from slo.capacity import ProbeResult, search
from slo.runrecord import Goodput


@dataclass(frozen=True)
class CapacityRun:
    """The search result (`slo.capacity.CapacityResult`) and the directory holding its probes."""

    result: object
    out_dir: Path


def run_capacity_search(
    config: RunConfig,
    *,
    out: Path | None,
    start_rate: float,
    max_rate: float | None,
    max_iterations: int,
    rel_width: float,
    progress: Callable[[str], None] | None = None,
) -> CapacityRun:
    """Search the highest rate whose attainment meets `config.recording.slo`'s `attainment_min`.

    Every probe is a full run in `<out>/probe-NN-<rate>`, against one target started once.
    `capacity.json` in `out` holds the goodput-versus-rate curve and the search outcome.
    """
    if config.recording.slo is None:
        raise HarnessError(
            "bench capacity needs --slo (its attainment target is what is searched for)."
        )
    spec = load_slo(config.recording.slo)
    if spec.attainment_min is None:
        raise HarnessError(f"the SLO {spec.name!r} sets no attainment_min to search for.")
    out_dir = Path(out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-capacity")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise HarnessError(
            f"--out {out_dir} already holds files; choose an empty or new directory."
        )
    launch = launch_plan_for(config.server)  # a managed external engine's: its weights' tokenizer
    tokenizer = load_tokenizer_for(config, launch)
    probes: list[dict] = []

    with target_for(config.server, plan=launch) as target:

        def probe(rate: float) -> ProbeResult:
            run_dir = out_dir / f"probe-{len(probes):02d}-{rate:.4g}rps"
            run_cfg = dataclasses.replace(config, request_rate=rate, out=run_dir)
            outcome = run_benchmark(run_cfg, target=target, tokenizer=tokenizer)
            goodput = outcome.summary.goodput or Goodput.empty()
            attainment = goodput.attainment or 0.0
            probes.append({"rate_per_s": rate, "run_dir": run_dir.name, "attainment": attainment})
            if progress is not None:
                progress(f"probe {len(probes)}: {rate:.4g} req/s -> attainment {attainment:.3f}")
            return ProbeResult(rate, attainment, goodput.request_per_s, {"run_dir": run_dir.name})

        result = search(probe, target=spec.attainment_min, start_rate=start_rate, max_iterations=max_iterations,
                        rel_width=rel_width, max_rate=max_rate)  # fmt: skip
    record = {
        "slo": spec.to_dict(),
        "capacity_rate_per_s": result.capacity_rate_per_s,
        "bracket": list(result.bracket),
        "converged": result.converged,
        "confirmed": result.confirmed,
        "iterations": result.iterations,
        "stop_reason": result.stop_reason,
        "curve": result.curve_points(),
        "probes": probes,
    }
    (out_dir / "capacity.json").write_text(json.dumps(record, indent=2) + "\n")
    return CapacityRun(result=result, out_dir=out_dir)
