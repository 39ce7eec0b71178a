"""A fault window's recovery in words, the same on the console and in the HTML card."""

from __future__ import annotations

from slo.recovery import Recovery
from slo.runrecord import FaultWindow

RECOVERY_WORDS = {
    Recovery.NEVER.value: "never",
    Recovery.RUN_ENDED_IN_WINDOW.value: "run ended in window",
    Recovery.NO_LEVEL_BEFORE.value: "no goodput before",
}


def recovery_text(window: FaultWindow) -> str:
    """The "recovered after s" cell of one `slo.recovery` window: the seconds to recover (two
    decimals), or why there is no figure: the goodput never came back ("never"), the run ended
    in the window or too soon after it to tell ("run ended in window"), or there was no goodput
    before the window to get back to ("no goodput before"). A summary written before the
    `recovery` field could not tell these apart and reads "never", as it always did."""
    seconds = window.recovery_s
    if seconds is not None:
        return f"{seconds:,.2f}"
    judged = window.recovery or Recovery.NEVER.value
    return RECOVERY_WORDS.get(judged, str(judged))
