"""No reader spells a key of `summary.json`: `harness/`, `reports/` and `slo/` read the
summary's blocks as the typed sections of `slo.runrecord` (attributes), so a key is named once,
there, and a key renamed there cannot still be read the old way. The run-record counterpart for
table columns and statuses is `test_runrecord_literals.py`; this is the same scan over the
summary's keys.

Only `slo/runrecord` and the writers (`slo.summary` and the block builders it calls) spell the
keys."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

import slo.runrecord as runrecord
from slo.runrecord import RunSummary, Section

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "reports", "slo")
EXEMPT_DIRS = (ROOT / "slo" / "runrecord",)
# The writers: each builds the blocks named beside it, so it spells their keys.
WRITERS = {
    "slo/summary.py": "the summary itself, latency_ms, dispatch_lag_ms, chunking",
    "slo/metrics.py": "every distribution, throughput, counts",
    "slo/consistency.py": "little_law",
    "slo/conventions.py": "conventions",
    "slo/correctness.py": "correctness",
    "slo/goodput.py": "goodput",
    "slo/ledger.py": "ledger",
    "slo/prompt_tokens.py": "prompt_tokens",
    "slo/recovery.py": "faults.windows",
    "slo/saturation.py": "saturation",
    "slo/server_metrics.py": "server_metrics",
    "slo/sessions.py": "sessions",
    "slo/slices.py": "slices",
    "slo/verdicts.py": "slo",
    "slo/classes.py": "slices.tenant, slices.priority, fairness, deadlines",
    "slo/memory.py": "memory",
    "slo/reasoning.py": "reasoning, slo.ttft",
    "slo/dense.py": "dense",
}

SECTIONS = [
    kind
    for kind in vars(runrecord).values()
    if isinstance(kind, type) and issubclass(kind, Section) and kind is not Section
]
TOP_KEYS = {f.name for f in fields(RunSummary)}
SUMMARY_KEYS = TOP_KEYS.union(*({f.name for f in fields(kind)} for kind in SECTIONS))

# Words other documents use with their own meaning, so a literal of one is no summary read:
# statistics and the metric names; fields of the manifest, the SLO spec, capacity.json and
# sweep.json; the table headings and row keys of reports' own views; and the figures that the
# report card, the gate and the comparison rows name as the summary does, on purpose
# (reports/card_schema.md). The scan still catches these when looked up on a summary.
STATISTICS = {"n", "mean", "p50", "p90", "p95", "p99", "max", "total", "ok", "ratio", "ci"}
METRIC_NAMES = {"ttft", "tpot", "itl", "e2e", "ttft_ms"}
RECORD_WORDS = {
    "name", "kind", "label", "value", "source", "spec", "reason", "verdict", "metric", "metrics",
    "threshold", "percentile", "percentile_method", "definition", "time", "load", "turn",
    "complete", "schema_version", "sha256", "start_s", "end_s", "windows",
}  # fmt: skip
OTHER_CONTRACTS = {"input_tokens", "output_tokens", "not_sent", "slo", "slices", "dispatch_lag_ms"}
# RequestSpec columns and OpenAI body fields (`workloads.classes`) as well as slice names.
OTHER_CONTRACTS |= {"priority", "tenant"}
# OpenAI's chat body field and the workload manifest's entry (`workloads.tools`); in the
# summary, `conventions.tools` names other benchmark tools.
OTHER_CONTRACTS |= {"tools"}
OTHER_CONTRACTS |= {"series"}  # the run history's own word (reports/history): a series of runs
CARD_FIGURES = {
    "throughput", "request_per_s", "attempted_request_per_s", "input_tokens_per_s",
    "output_tokens_per_s", "total_tokens_per_s", "goodput", "goodput_request_per_s",
    "attainment", "good_requests", "total_requests",
}  # fmt: skip
SHARED = STATISTICS | METRIC_NAMES | RECORD_WORDS | OTHER_CONTRACTS | CARD_FIGURES
DISTINCTIVE = SUMMARY_KEYS - SHARED
# Words one package uses with a meaning of its own. harness: `bench faults` and the run
# config's fields and flat names (`faults`, `duration_s`, `diverge_before`), the OpenAI usage
# field `prompt_tokens`, and the manifest's `server_state` entry (`before`, `after`). slo: a
# workload stage's `duration_s`, read from the run manifest's workload (`slo.load_phases`).
OWN_WORDS = {
    # `reasoning`: the chat delta key vLLM 0.11 streams a reasoning model's thinking under
    "harness": {
        "faults",
        "duration_s",
        "diverge_before",
        "prompt_tokens",
        "before",
        "after",
        "reasoning",
    },
    "slo": {"duration_s"},
}


def _modules() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if not any(path.is_relative_to(d) for d in EXEMPT_DIRS)
        and path.relative_to(ROOT).as_posix() not in WRITERS
    ]


def _names_a_summary(node: ast.AST) -> bool:
    """Whether `node` is a summary by its name (`summary`, `run_summary`), or a lookup, or an
    `x or {}`, on one."""
    if isinstance(node, ast.Name):
        return "summary" in node.id
    if isinstance(node, ast.Attribute):
        return "summary" in node.attr
    if isinstance(node, ast.BoolOp):
        return _names_a_summary(node.values[0])
    if isinstance(node, ast.Subscript):
        return _names_a_summary(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return _names_a_summary(node.func.value)
    return False


def _lookup(node: ast.AST) -> tuple[ast.AST, ast.Constant] | None:
    """(receiver, key) of `x["key"]`, `x.get("key", ...)` / `.pop` / `.setdefault`, or
    `"key" in x`; None for anything else."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.value, node.slice
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("get", "pop", "setdefault")
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        return node.func.value, node.args[0]
    if (
        isinstance(node, ast.Compare)
        and isinstance(node.ops[0], ast.In | ast.NotIn)
        and isinstance(node.left, ast.Constant)
    ):
        return node.comparators[0], node.left
    return None


def _offences(source: str, rel: str) -> list[str]:
    distinctive = DISTINCTIVE - OWN_WORDS.get(rel.split("/", 1)[0], set())
    found = set()
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Constant) and node.value in distinctive:
            found.add(f"{rel}:{node.lineno}: {node.value!r} (a summary key)")
        lookup = _lookup(node)
        if lookup is not None:
            receiver, key = lookup
            if key.value in TOP_KEYS and _names_a_summary(receiver):
                found.add(f"{rel}:{key.lineno}: {key.value!r} (looked up on a summary)")
    return sorted(found)


def test_the_scan_sees_the_readers_and_knows_the_keys():
    files = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"reports/build.py", "reports/console.py", "reports/exports/llmd.py"} <= files
    assert {"harness/run/outcome.py", "harness/cli/main.py", "harness/load/prompt_watch.py"} <= (
        files
    )
    assert "slo/summary.py" not in files and "slo/spec.py" in files
    assert {"latency_ms", "by_error_class", "leaked", "cache_hit_rate", "tokens_per_chunk"} <= (
        DISTINCTIVE
    )


def test_every_writer_and_shared_word_is_real():
    # a stale entry would hide nothing, but it would mislead whoever reads the lists
    assert all((ROOT / path).is_file() for path in WRITERS)
    assert SHARED <= SUMMARY_KEYS
    assert set(OWN_WORDS) <= set(PACKAGES)
    assert all(words <= DISTINCTIVE for words in OWN_WORDS.values())


READER_PROBE = (
    "def f(summary, ledger, block):\n"
    '    p99 = summary["latency_ms"]["ttft"]["p99"]\n'
    '    good = (summary.get("goodput") or {}).get("request_per_s")\n'
    '    slo = "slo" in summary\n'
    '    return p99, good, slo, ledger.get("leaked"), block["cache_hit_rate"]\n'
)
# The harness's own words pass as words, and are still caught when looked up on a summary.
HARNESS_PROBE = (
    "def f(outcome, config):\n"
    '    counts = outcome.summary.get("counts") or {}\n'
    '    rate = (outcome.summary["goodput"] or {}).get("request_per_s")\n'
    '    faults = outcome.summary.get("faults")\n'
    '    return counts.get("by_status"), rate, faults, config["faults"], {"before": 1}\n'
)


@pytest.mark.parametrize(
    ("rel", "probe", "caught"),
    [
        (
            "reports/_probe.py",
            READER_PROBE,
            [
                "'latency_ms' (a summary key)",
                "'latency_ms' (looked up on a summary)",
                "'goodput' (looked up on a summary)",
                "'slo' (looked up on a summary)",
                "'cache_hit_rate' (a summary key)",
                "'leaked' (a summary key)",
            ],
        ),
        (
            "harness/run/_probe.py",
            HARNESS_PROBE,
            [
                "'counts' (a summary key)",
                "'counts' (looked up on a summary)",
                "'goodput' (looked up on a summary)",
                "'faults' (looked up on a summary)",
                "'by_status' (a summary key)",
            ],
        ),
    ],
)
def test_the_scan_catches_summary_keys_spelt_in_a_reader(rel, probe, caught):
    assert [o.split(": ", 1)[1] for o in _offences(probe, rel)] == caught


def test_attribute_reads_pass_the_scan():
    probe = (
        "def f(summary, rates):\n"
        "    lag = summary.dispatch_lag_ms.p99\n"
        '    return lag, summary.ledger.leaked, rates.get(name), {"request_per_s": 1.0}\n'
    )
    assert _offences(probe, "reports/_probe.py") == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_summary_key_spelt_outside_runrecord(path):
    assert _offences(path.read_text(), path.relative_to(ROOT).as_posix()) == []
