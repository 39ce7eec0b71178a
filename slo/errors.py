"""The one exception type that `slo` raises for problems a user can cause."""

from __future__ import annotations


class SLOError(Exception):
    """A bad SLO spec, an unknown built-in name or an unreadable run directory.

    The message is one sentence that names the fix; the CLI turns it into exit code 2.
    """
