"""README's `bench probe bad-input` row states how many cases the probe sends, how many also
pass with a 200 and how many pass with a closed connection; `faults/probe_cases` defines them.
The row is read here so the two cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from faults.probe_cases import build_cases

README = Path(__file__).parents[2] / "README.md"
ROW_START = "| `bench probe bad-input"
CLAIMS = {
    "cases": re.compile(r"\b(\d+) bad requests\b"),
    "ok_allowed": re.compile(r"\b(\d+) cases also pass with a 200\b"),
    "close_allowed": re.compile(r"\bthe (\d+) HTTP-limit cases\b"),
}


def _probe_row(text: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith(ROW_START)]
    return row


def claimed_counts(row: str) -> dict[str, int | None]:
    """The counts the row states, None for one it does not state."""
    found = {name: pattern.search(row) for name, pattern in CLAIMS.items()}
    return {name: int(match.group(1)) if match else None for name, match in found.items()}


def defined_counts() -> dict[str, int]:
    cases = build_cases("probe-model")
    return {
        "cases": len(cases),
        "ok_allowed": sum(case.expect.ok_allowed for case in cases),
        "close_allowed": sum(case.expect.close_allowed for case in cases),
    }


def test_readme_probe_row_counts_match_the_case_table():
    assert claimed_counts(_probe_row(README.read_text())) == defined_counts()


@pytest.mark.parametrize(
    "row",
    [
        # the row as it was: every case "must get a 4xx", no count of those a 200 passes
        "| `bench probe bad-input --url URL` | 170 bad requests while well-formed streams run; "
        "each must get a 4xx JSON error and leave the server healthy |",
        "| `bench probe bad-input` | 171 bad requests; 69 cases also pass with a 200; "
        "the 4 HTTP-limit cases pass with a closed connection |",
        "| `bench probe bad-input` | 170 bad requests; 68 cases also pass with a 200; "
        "the 4 HTTP-limit cases pass with a closed connection |",
    ],
)
def test_a_row_with_a_missing_or_wrong_count_fails(row):
    """Negative control: the comparison above fails for rows that misstate the table."""
    assert claimed_counts(row) != defined_counts()
