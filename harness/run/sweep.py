"""`bench sweep`: one run per load point (request rates or concurrencies), repeated, against
one target started once; `sweep.json` in the sweep directory lists the points and their run
directories, and is rewritten after every point, so a stopped sweep keeps what it measured."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.load.recorder import prepare_run_dir
from harness.run.config import RunConfig
from harness.run.orchestrator import load_tokenizer_for, removed_if_left_empty, run_benchmark
from harness.targets.target import launch_plan_for, target_for

SWEEP_FILE = "sweep.json"
SWEEP_VERSION = 1
SWEEP_KINDS = ("request_rate", "concurrency")


@dataclass(frozen=True)
class SweepPlan:
    """The load points of a sweep: `kind` is `request_rate` (requests/s, `inf` allowed) or
    `concurrency` (closed-loop users, or a cap when the base run sets a request rate);
    each value runs `repeat` times, in the order given."""

    kind: str
    values: tuple[float, ...]
    repeat: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SWEEP_KINDS:
            raise HarnessError(f"a sweep is over {' or '.join(SWEEP_KINDS)}, not {self.kind!r}.")
        if not self.values:
            raise HarnessError("a sweep needs at least one load point.")
        if isinstance(self.repeat, bool) or int(self.repeat) != self.repeat or self.repeat < 1:
            raise HarnessError(
                f"--repeat must be a whole number of at least 1, got {self.repeat!r}."
            )

    @classmethod
    def parse(cls, kind: str, text: str, repeat: int = 1) -> SweepPlan:
        """`1,2,4,8` (rates may be `inf`; concurrencies are whole numbers) as a plan."""
        flag = "--" + kind.replace("_", "-")
        values = []
        for item in (p.strip() for p in text.split(",")):
            try:
                value = float(item)
            except ValueError:
                raise HarnessError(f"{flag} takes a comma list of numbers, got {item!r}.") from None
            integer = kind == "concurrency"
            if not value > 0 or math.isnan(value) or (integer and not float(value).is_integer()):
                what = "whole numbers of at least 1" if integer else "numbers above 0 (or inf)"
                raise HarnessError(f"{flag} takes {what}, got {item!r}.")
            values.append(int(value) if integer else value)
        return cls(kind, tuple(values), repeat)

    def points(self) -> list[tuple[str, float, int]]:
        """(directory name, value, repetition) per run, in order."""
        out = []
        for i, value in enumerate(self.values):
            unit = "rps" if self.kind == "request_rate" else "users"
            for rep in range(self.repeat):
                suffix = f"-rep{rep + 1}" if self.repeat > 1 else ""
                out.append((f"point-{i:02d}-{value:g}{unit}{suffix}", value, rep + 1))
        return out


def run_sweep(
    config: RunConfig,
    plan: SweepPlan,
    *,
    out: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Run every point of `plan` with `config` (its rate or concurrency replaced) against one
    target started once; returns the sweep directory. Raises `HarnessError` for bad input
    before anything runs."""
    if plan.kind == "concurrency" and config.load.concurrency is not None:
        raise HarnessError("--concurrency is what this sweep varies; drop it from the base run.")
    if plan.kind == "request_rate" and config.load.request_rate is not None:
        raise HarnessError("--request-rate is what this sweep varies; drop it from the base run.")
    out_dir = Path(out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-sweep")
    with removed_if_left_empty(out_dir):
        prepare_run_dir(out_dir)
        try:
            return _run_points(config, plan, out_dir, progress)
        except BaseException:
            if not json.loads((out_dir / SWEEP_FILE).read_text())["points"]:
                (out_dir / SWEEP_FILE).unlink()  # refused before any point ran: leave nothing
            raise


def _run_points(config: RunConfig, plan: SweepPlan, out_dir: Path, progress) -> Path:
    record = {"version": SWEEP_VERSION, "kind": plan.kind, "values": list(plan.values),
              "repeat": plan.repeat, "slo": config.recording.slo, "started_at": _now(), "points": []}  # fmt: skip
    _write(out_dir, record)
    launch = launch_plan_for(config.server)  # a managed external engine's: its weights' tokenizer
    tokenizer = load_tokenizer_for(config, launch)
    with target_for(config.server, plan=launch) as target:
        for name, value, rep in plan.points():
            change = {plan.kind: value, "out": out_dir / name}
            outcome = run_benchmark(dataclasses.replace(config, **change), target=target,
                                    tokenizer=tokenizer)  # fmt: skip
            record["points"].append({
                "kind": plan.kind, "value": "inf" if value == math.inf else value,
                "repeat": rep, "run_dir": name, "complete": outcome.complete,
                "exit_code": outcome.verdict.exit_code,
            })  # fmt: skip
            _write(out_dir, record)
            if progress is not None:
                rate = outcome.summary.throughput.output_tokens_per_s
                shown = "—" if rate is None else f"{rate:.1f}"
                progress(f"{name}: {shown} output tokens/s, exit {outcome.verdict.exit_code}")
            if not outcome.complete:
                break  # interrupted: the remaining points are not run
    record["ended_at"] = _now()
    _write(out_dir, record)
    return out_dir


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _write(out_dir: Path, record: dict) -> None:
    path = out_dir / SWEEP_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
