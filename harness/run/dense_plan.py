"""The batches of an embeddings or rerank run: which texts each request carries.

A workload row is one prompt; a dense request carries a batch of texts. The batch size is
`--batch-size`: a whole number, or a length distribution in the workload syntax
(`workloads.lengths`, e.g. `{dist: uniform, low: 1, high: 8}`), drawn once per request with
the run's seed (default 1, as vLLM's bench and AIPerf's `--batch-size-text` send one text a
request unless told otherwise). Request k keeps row k's id, arrival and class, and takes its
texts from the workload's prompts in order, wrapping around the end:

- embeddings: the prompts of rows k, k+1, ..., k+b-1 are its `input`;
- rerank: row k's prompt is the `query`, the prompts of rows k+1, ..., k+b its `documents`.

So every text has the workload's input length, the number of requests stays the workload's,
and a request's `input_tokens` is the sum of its texts' (query included). Multi-turn workloads
do not apply: a dense request has no conversation.
"""

from __future__ import annotations

import numpy as np
import orjson

from harness.errors import HarnessError
from harness.http.dense import DENSE_INPUTS, DENSE_QUERY
from harness.load.loadgen import LoadPlan
from slo.runrecord import Endpoint
from workloads import WorkloadError
from workloads.lengths import length_from_spec

DEFAULT_BATCH_SIZE = 1


def parse_batch_size(value) -> int | dict | None:
    """`--batch-size` as given (a whole number of at least 1, a distribution mapping, or its
    YAML/JSON text), checked; None stays None. Anything else is one sentence."""
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            value = None
    try:
        if isinstance(value, bool) or not isinstance(value, int | dict):
            raise WorkloadError("not a whole number or a distribution")
        length_from_spec(value, where="--batch-size")
    except WorkloadError:
        raise HarnessError(
            "--batch-size must be a whole number of at least 1 or a length distribution such "
            f"as '{{dist: uniform, low: 1, high: 8}}', got {given!r}."
        ) from None
    return value


def batch_sizes(spec: int | dict | None, n: int, seed: int) -> list[int]:
    """`n` batch sizes drawn from `spec` (None: every request one text)."""
    dist = length_from_spec(DEFAULT_BATCH_SIZE if spec is None else spec, where="--batch-size")
    return dist.sample(n, np.random.default_rng(seed)).tolist()


def dense_rows(rows: list[dict], endpoint: Endpoint, sizes: list[int]) -> list[dict]:
    """The rows as dense requests: row k with its batch of `sizes[k]` texts (see the module
    docstring) and its input tokens summed over them."""
    if any(r.get("session_id") is not None for r in rows):
        raise HarnessError(
            f"--endpoint {endpoint.value} sends single requests; the workload is multi-turn "
            "(sessions), choose a single-turn workload."
        )
    n = len(rows)
    out = []
    for k, (row, size) in enumerate(zip(rows, sizes, strict=True)):
        first = k + 1 if endpoint is Endpoint.RERANK else k
        picked = [rows[(first + j) % n] for j in range(size)]
        batched = dict(row)
        batched[DENSE_INPUTS] = [r["prompt"] for r in picked]
        tokens = sum(int(r["input_tokens"]) for r in picked)
        if endpoint is Endpoint.RERANK:
            batched[DENSE_QUERY] = row["prompt"]
            tokens += int(row["input_tokens"])
        batched["input_tokens"] = tokens
        out.append(batched)
    return out


def sent_batch_sizes(plan: LoadPlan, endpoint: Endpoint) -> dict[str, int]:
    """request id -> texts its body carries (inputs or documents), warm-up included: what
    the answer's vectors or scores are counted against."""
    key = "input" if endpoint is Endpoint.EMBEDDINGS else "documents"
    return {p.request_id: len(orjson.loads(p.body)[key]) for p in [*plan.warmup, *plan.payloads]}
