"""The one exception type that `reports` raises for problems a user can cause."""

from __future__ import annotations


class ReportError(Exception):
    """Runs that cannot be reported or compared as asked (missing files, mismatched workloads
    or SLOs, a bad thresholds file). The message is one sentence that names the fix; the CLI
    turns it into exit code 2."""
