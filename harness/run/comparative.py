"""Comparative runs: the same workload against several targets, repeated, interleaved across
repetitions (A B, B A, A B, ...) so slow drift of the machine cancels instead of favouring
whichever target ran first. Every run starts its managed target afresh: a server kept across
repetitions would serve the later ones from the prefix cache the first one filled. One run directory per target and repetition, under one parent,
and one comparative card (`comparison.json`, `comparison.html`, `comparison.md`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from harness.errors import HarnessError
from harness.run.config import RunConfig
from harness.run.extensions import RunExtensions
from harness.run.orchestrator import run_benchmark
from harness.run.outcome import EXIT_INTERRUPTED, EXIT_OK, RunOutcome
from harness.targets.spec import TargetSpec
from reports.repeated import compare_repeated, repeated_html, repeated_markdown


def interleaved(targets: list[str], repeat: int) -> list[tuple[int, str]]:
    """`(repetition, target)` in run order: forward on even repetitions, reversed on odd."""
    if repeat < 1:
        raise HarnessError(f"--repeat must be at least 1, got {repeat!r}.")
    if not targets:
        raise HarnessError("give at least one --target.")
    order = []
    for rep in range(repeat):
        for target in targets if rep % 2 == 0 else list(reversed(targets)):
            order.append((rep, target))
    return order


def target_labels(targets: list[str]) -> list[str]:
    """Directory-safe, unique labels: the engine name, `url`, with -2, -3 for repeats."""
    labels = []
    for target in targets:
        kind = TargetSpec.parse(target).kind
        label = kind
        k = 2
        while label in labels:
            label = f"{kind}-{k}"
            k += 1
        labels.append(label)
    return labels


@dataclass(frozen=True)
class ComparativeOutcome:
    out_dir: Path
    runs: dict[str, list[Path]]
    order: list[str]
    outcomes: list[RunOutcome]
    interrupted_reason: str | None = None

    @property
    def exit_code(self) -> int:
        if self.interrupted_reason is not None:
            return EXIT_INTERRUPTED
        return max((o.verdict.exit_code for o in self.outcomes), default=EXIT_OK)


def run_comparative(
    config: RunConfig,
    targets: list[str],
    repeat: int,
    *,
    console=None,
    quiet: bool = True,
    extensions: RunExtensions | None = None,
) -> ComparativeOutcome:
    """Run `config` against each of `targets`, `repeat` times, interleaved; then write the
    comparative card into the parent directory (`config.recording.out`, else
    runs/<time>-compare). Every run gets `extensions` (`run_benchmark`'s). Stops at the first
    interrupted run (what ran is still compared)."""
    order = interleaved(targets, repeat)
    labels = dict(zip(targets, target_labels(targets), strict=True))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = (
        Path(config.recording.out) if config.recording.out else Path("runs") / f"{stamp}-compare"
    )
    if out_dir.exists() and any(out_dir.iterdir()):
        raise HarnessError(f"--out {out_dir} already holds files; choose a new directory.")
    if config.server.spec.url_flag:
        raise HarnessError(
            "with several targets, name a running server as --target url:URL, not --url."
        )
    base = config
    runs: dict[str, list[Path]] = {labels[t]: [] for t in targets}
    outcomes, done, reason = [], [], None
    for rep, target in order:
        label = labels[target]
        run_dir = out_dir / f"{label}-r{rep + 1}"
        if console is not None and not quiet:
            console.print(f"run {len(done) + 1}/{len(order)}: {label}, repetition {rep + 1}")
        outcome = run_benchmark(
            replace(base, target=target, out=run_dir),
            console=console,
            quiet=quiet,
            extensions=extensions,
        )
        outcomes.append(outcome)
        runs[label].append(run_dir)
        done.append(f"{label}-r{rep + 1}")
        if outcome.interrupted_reason is not None and not outcome.complete:
            if (outcome.interrupted_reason or "").startswith("interrupted"):
                reason = outcome.interrupted_reason
                break
    write_comparison(out_dir, {k: v for k, v in runs.items() if v}, done)
    return ComparativeOutcome(out_dir, runs, done, outcomes, reason)


def write_comparison(out_dir: Path, runs: dict[str, list[Path]], order: list[str]):
    """Write comparison.json, .html and .md for `runs` into `out_dir`; returns the comparison."""
    comparison = compare_repeated(runs, order)
    (out_dir / "comparison.json").write_text(comparison.to_json())
    (out_dir / "comparison.html").write_text(repeated_html(comparison))
    (out_dir / "comparison.md").write_text(repeated_markdown(comparison))
    return comparison
