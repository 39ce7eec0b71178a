"""The built-in fault plans, and the bad-input probe when it is available, against one target:
a table of outcomes, recovery times and ledger verdicts per plan, for side-by-side notes.

    python benchmarks/fault_suite.py --url http://127.0.0.1:8000/v1 --model M --tokenizer T
    python benchmarks/fault_suite.py --managed smollm2-135m          # the reference engine

Each plan is one `bench run` (Poisson arrivals at `--rate` for `--duration` seconds, short
outputs), so a plan's windows (5 s to 15 s in the built-ins) fall inside the run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from harness.cli.compose import run_benchmark
from harness.run.config import RunConfig
from harness.targets.target import target_for
from slo.runrecord import LeakCheck, Ledger

DEFAULT_PLANS = (
    "latency-200ms",
    "reset-storm",
    "stall",
    "down",
    "limit-data",
    "cancel-storm",
    "slow-readers",
    "disconnect-storm",
)


def one_plan(target, args, plan: str | None, out: Path) -> dict:
    config = RunConfig(
        url=args.url,
        model=args.model or (None if args.url else args.managed),
        tokenizer=args.tokenizer,
        workload="random",
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=int(args.rate * args.duration),
        request_rate=args.rate,
        ignore_eos=True,
        timeout_s=args.timeout,
        out=out,
        faults=plan,
        scrape_interval_s=1.0,
    )
    outcome = run_benchmark(config, target=target)
    s = outcome.summary
    ledger = s.ledger or Ledger.empty()
    leak = ledger.leak or LeakCheck.empty()
    windows = (s.faults.windows if s.faults is not None else None) or []
    by_status = {k: v for k, v in s.counts.by_status.items() if v}
    return {
        "plan": plan or "(none)",
        "requests": s.counts.total + (s.counts.not_sent or 0),
        "outcomes": by_status,
        "error_classes": s.counts.by_error_class,
        "ttft_p50_ms": s.latency_ms.ttft.p50,
        "recovery_s": [w.recovery_s for w in windows],
        "ledger": ledger.verdict,
        "lost": ledger.lost,
        "unexpected": ledger.unexpected,
        "leak": leak.reasons or ([] if leak.checked else ["not checked"]),
        "exit_code": outcome.verdict.exit_code,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url")
    parser.add_argument("--managed", default="smollm2-135m")
    parser.add_argument("--model")
    parser.add_argument("--tokenizer")
    parser.add_argument("--plans", default=",".join(DEFAULT_PLANS))
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=8.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    plans = [None, *[p for p in args.plans.split(",") if p]]
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        target_for(RunConfig(url=args.url, model=args.model or args.managed).server) as target,
    ):
        for i, plan in enumerate(plans):
            row = one_plan(target, args, plan, Path(tmp) / f"{i:02d}-{plan or 'none'}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        "| plan | outcomes | error classes | TTFT p50 ms | recovery s | ledger (lost/unexpected) | leak | exit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
        classes = ", ".join(f"{k} {v}" for k, v in r["error_classes"].items()) or "-"
        rec = ", ".join("never" if x is None else f"{x:.2f}" for x in r["recovery_s"]) or "-"
        ttft = "-" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:.0f}"
        print(
            f"| {r['plan']} | {outcomes} | {classes} | {ttft} | {rec} | {r['ledger']} ({r['lost']}/{r['unexpected']}) | {'; '.join(r['leak']) or 'none'} | {r['exit_code']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
