"""`bench probe bad-input` piped into a file or a CI log (no terminal, no COLUMNS): the tables
are printed whole, where rich's 80-column default cut the case names and wrapped the reasons."""

from __future__ import annotations

import pytest
from broken_servers import Fault, create_app, serving
from click.testing import CliRunner

from faults.probe_cli import bad_input

# The server dies mid-case; whether the health check after it finds the port closed or the
# listener still half there is a race, so the reason ends one of two ways, each whole.
CRASH_REASONS = tuple(
    "closed the connection without answering; afterwards GET /health " + after
    for after in ("could not connect (connection refused).", "got no HTTP answer (closed).")
)
NOT_RUN_REASON = "not run: the server stopped answering after case 'max-tokens-list'."


@pytest.mark.slow  # it starts a server
def test_the_failed_cases_table_is_whole_when_piped():
    with serving(create_app(Fault.CRASH_ON_LIST_MAX_TOKENS)) as url:
        result = CliRunner().invoke(
            bad_input,
            ["--url", url, "--only", "wrong-types", "--timeout", "2"],
            env={"COLUMNS": None},  # unset: rich decides the width
        )
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert not [line for line in lines if "…" in line]
    assert any(line.startswith(f"bad-input probe of {url}") for line in lines)
    assert any(
        "max-tokens-list" in line and any(reason in line for reason in CRASH_REASONS)
        for line in lines
    ), result.output
    assert any("message-content-number" in line and NOT_RUN_REASON in line for line in lines)
