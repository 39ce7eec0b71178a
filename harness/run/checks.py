"""What a run checks besides timing: the requests as sent (greedy when outputs are checked),
the reference model that judges them, and the per-request output checks."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from harness.errors import HarnessError
from harness.load.output_checks import Expectation, OutputChecks
from harness.load.tool_checks import require_jsonschema
from harness.run.config import RunConfig
from harness.run.oracle import reference_texts
from harness.run.outcome import OutputTally
from harness.targets.engines import DEFAULT_MODEL
from harness.targets.tokenizer_choice import names_a_model
from slo.correctness import WRONG_FLAGS
from slo.runrecord import Endpoint, RequestColumn, RequestStatus
from workloads.tools import offers_by_row

# Rows turned into dicts at a time: a run's plan keeps a few small objects of every row (its
# id), and building all rows' dicts at once would leave those scattered over memory the
# allocator can then not give back (about 1 KB a request held through the run).
ROW_BATCH = 2048


def iter_request_rows(config: RunConfig, workload, batch_rows: int = ROW_BATCH):
    """The workload's rows as sent, a batch of dicts at a time: with `check_outputs`, rows
    without a temperature are greedy; each row carries the workload's output `constraint`
    and its `tools` (a shared `workloads.tools.ToolOffer`; None without either)."""
    constraint = workload.manifest.get("constraint")
    offers = iter(offers_by_row(workload.manifest.get("tools"), workload.table.num_rows))
    for batch in workload.table.to_batches(max_chunksize=batch_rows):
        rows = batch.to_pylist()
        for row in rows:
            row["constraint"] = constraint
            row["tools"] = next(offers)
            if config.recording.check_outputs and row.get("temperature") is None:
                row["temperature"] = 0.0
        yield from rows
        del rows


def request_rows(config: RunConfig, workload) -> list[dict]:
    """`iter_request_rows` as one list."""
    return list(iter_request_rows(config, workload))


def oracle_model(config: RunConfig) -> str:
    """The reference model whose batch-1 outputs judge the target's (`--check-outputs`)."""
    if not config.server.spec.is_url:
        return config.server.model or DEFAULT_MODEL
    for candidate in (config.server.model, config.server.tokenizer):
        if candidate and names_a_model(candidate):
            return candidate
    raise HarnessError(
        "--check-outputs against a URL target needs the reference model it serves; name it "
        "with --model or --tokenizer (a reference model name, GGUF file or HF directory)."
    )


def output_checks(config: RunConfig, workload, tokenizer, endpoint: Endpoint) -> OutputChecks:
    """The run's output checks: TEST06-style flags, the workload's output constraint and
    its tools' calls always; with `check_outputs`, the reference engine's batch-1 outputs for
    the greedy requests without tools (cached per workload)."""
    if workload.manifest.get("tools"):
        require_jsonschema()
    # the reference outputs need every row at once; otherwise a batch of dicts at a time
    rows = request_rows(config, workload) if config.recording.check_outputs else None
    shared: dict[tuple, Expectation] = {}  # one object per distinct expectation, not per row
    expectations = {}
    for r in rows if rows is not None else iter_request_rows(config, workload):
        key = (
            int(r["max_output_tokens"]),
            bool(r.get("ignore_eos")),
            id(r.get("constraint")),
            id(r.get("tools")),
        )
        if key not in shared:
            shared[key] = Expectation(key[0], key[1], r.get("constraint"), r.get("tools"))
        expectations[r["request_id"]] = shared[key]
    references = None
    if config.recording.check_outputs:
        references = reference_texts(
            [r for r in rows if r.get("tools") is None],  # calls are checked, not compared
            model=oracle_model(config),
            endpoint=endpoint,
            workload_sha256=str(workload.manifest.get("sha256")),
        )
    return OutputChecks(
        tokenizer, expectations, references, diverge_before=config.recording.diverge_before
    )


def tally_outputs(requests: pa.Table) -> OutputTally:
    """How many of the requests that ended ok have a `wrong output` (`output_valid` false),
    and those by each flag that makes an output wrong (a request may carry several)."""
    statuses = requests[RequestColumn.STATUS].to_pylist()
    valid = requests[RequestColumn.OUTPUT_VALID].to_pylist()
    flags = requests[RequestColumn.OUTPUT_FLAGS].to_pylist()
    n_ok, n_wrong, by_flag = 0, 0, Counter()
    for status, is_valid, flagged in zip(statuses, valid, flags, strict=True):
        if status != RequestStatus.OK:
            continue
        n_ok += 1
        if is_valid is False:
            n_wrong += 1
            by_flag.update(f for f in (flagged or "").split(",") if f in WRONG_FLAGS)
    return OutputTally(n_ok, n_wrong, dict(by_flag))
