"""No module outside `slo/runrecord` spells a run-record column name, status, error class or
token source: they name them through the run-record enums, so a value written one way can
never be read another way (the defect behind `client_count` versus `tokenizer`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slo.runrecord import (
    ChunkColumn,
    ErrorClass,
    RequestColumn,
    RequestStatus,
    TokenSource,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "slo", "reports", "faults")
EXEMPT_DIRS = (ROOT / "slo" / "runrecord",)

# Names that other contracts own too: the RequestSpec table (`workloads`), SLO slice keys and
# the OpenAI wire format use them with their own meaning, so they cannot be told apart here.
# `output_tokens_source` is also a field of summary.json (`RunSummary.output_tokens_source`).
SHARED_NAMES = {
    "request_id",
    "input_tokens",
    "output_tokens",
    "status",
    "finish_reason",
    "output_tokens_source",
    "session_id",  # RequestSpec columns too: the harness reads a workload's sessions by them
    "turn_index",
    "priority",  # RequestSpec columns too (`workloads.classes`), and the OpenAI body field
    "deadline_ms",
    "tenant",
    # also a field of summary.json (`RunSummary.served_by`: the engine and code path of the run)
    "served_by",
}
# The mock server's fault kinds are its command-line vocabulary (`--malformed-sse-rate`).
EXEMPT = {
    ("harness/targets/mock_server.py", "malformed_sse"),
    ("harness/targets/mock_server.py", "malformed_json"),
    ("harness/targets/mock_server.py", "error"),
    ("harness/targets/mock_dense.py", "malformed_json"),
    ("harness/targets/mock_dense.py", "error"),
    ("harness/targets/mock_pace.py", "malformed_sse"),
    ("harness/targets/mock_pace.py", "malformed_json"),
    # The Responses and Messages APIs name an event type "error" (`event: error`).
    ("harness/http/events.py", "error"),
}

DISTINCTIVE = (
    (
        {c.value for c in RequestColumn}
        | {c.value for c in ChunkColumn}
        | {e.value for e in ErrorClass}
        | {TokenSource.CHUNK_COUNT.value, "client_count"}
    )
    - SHARED_NAMES
    - {RequestStatus.TIMEOUT.value}
)
# Short words that mean a status or token source only when a value is compared with them.
COMPARED = {s.value for s in RequestStatus} | {t.value for t in TokenSource}


def _modules() -> list[Path]:
    files = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not any(path.is_relative_to(d) for d in EXEMPT_DIRS):
                files.append(path)
    return files


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    found = []

    def flag(node: ast.AST, value: str, why: str) -> None:
        if (rel, value) not in EXEMPT:
            found.append(f"{rel}:{node.lineno}: {value!r} ({why})")

    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in DISTINCTIVE:
                flag(node, node.value, "a run-record name")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for index, operand in enumerate(operands):
                # `"error" in obj` tests a wire key; `x in ("ok", ...)` and `x == "ok"` compare
                # a value with a status.
                is_key_lookup = index == 0 and isinstance(node.ops[0], ast.In | ast.NotIn)
                candidates = (
                    operand.elts
                    if isinstance(operand, ast.Tuple | ast.Set | ast.List)
                    else [operand]
                )
                for c in candidates:
                    if isinstance(c, ast.Constant) and c.value in COMPARED and not is_key_lookup:
                        flag(c, c.value, "compared as a status or token source")
        elif isinstance(node, ast.keyword) and node.arg in ("status", "error_class"):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                flag(node.value, node.value.value, f"passed as {node.arg}=")
    return sorted(set(found))


def test_the_scan_sees_the_project():
    files = _modules()
    assert len(files) > 40 and any(p.name == "records.py" for p in files)


def test_the_scan_catches_a_spelt_status(tmp_path):
    bad = ROOT / "harness" / "_literal_probe.py"
    try:
        bad.write_text(
            'def f(row):\n    return row.status == "ok" or row.source == "chunk_count"\n'
        )
        offences = _offences(bad)
    finally:
        bad.unlink()
    assert {o.split(": ", 1)[1].split(" ")[0] for o in offences} == {"'ok'", "'chunk_count'"}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_run_record_literal_outside_runrecord(path):
    assert _offences(path) == []
