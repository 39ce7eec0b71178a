"""What a run checks besides timing: the requests as sent (greedy when outputs are checked),
the reference model that judges them, and the per-request output checks."""

from __future__ import annotations

from harness.config import RunConfig
from harness.errors import HarnessError
from harness.output_checks import Expectation, OutputChecks
from harness.tokenizer_choice import names_a_model
from slo.runrecord import Endpoint


def request_rows(config: RunConfig, workload) -> list[dict]:
    """The workload's rows as sent: with `check_outputs`, rows without a temperature are greedy;
    each row carries the workload's output `constraint` (None without one)."""
    rows = workload.table.to_pylist()
    constraint = workload.manifest.get("constraint")
    for row in rows:
        row["constraint"] = constraint
        if config.check_outputs and row.get("temperature") is None:
            row["temperature"] = 0.0
    return rows


def oracle_model(config: RunConfig) -> str:
    """The reference model whose batch-1 outputs judge the target's (`--check-outputs`)."""
    from harness.tokenizer_choice import DEFAULT_MODEL

    if config.url is None and not config.target.startswith("url:"):
        return config.model or DEFAULT_MODEL
    for candidate in (config.model, config.tokenizer):
        if candidate and names_a_model(candidate):
            return candidate
    raise HarnessError(
        "--check-outputs against a URL target needs the reference model it serves; name it "
        "with --model or --tokenizer (a reference model name, GGUF file or HF directory)."
    )


def output_checks(config: RunConfig, workload, tokenizer, endpoint: Endpoint) -> OutputChecks:
    """The run's output checks: TEST06-style flags and the workload's output constraint
    always; with `check_outputs`, the reference engine's batch-1 outputs for the greedy
    requests (cached per workload)."""
    from harness.oracle import reference_texts

    rows = request_rows(config, workload)
    expectations = {
        r["request_id"]: Expectation(
            int(r["max_output_tokens"]), bool(r.get("ignore_eos")), r.get("constraint")
        )
        for r in rows
    }
    references = None
    if config.check_outputs:
        references = reference_texts(
            rows,
            model=oracle_model(config),
            endpoint=endpoint,
            workload_sha256=str(workload.manifest.get("sha256")),
        )
    return OutputChecks(tokenizer, expectations, references, diverge_before=config.diverge_before)
