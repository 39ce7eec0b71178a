"""Finding the units of a batch that make it fail, by bisection.

`LLMEngine.step` runs its whole batch once; only when that raises does it call
`isolate_failures`, so a step that succeeds pays nothing for isolation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Unit = TypeVar("Unit")
Result = TypeVar("Result")


def isolate_failures(
    units: list[Unit], run: Callable[[list[Unit]], Result], error: Exception
) -> tuple[list[Result], list[tuple[Unit, Exception]]]:
    """`run(units)` raised `error`: run each half of `units` on its own, and recursively each
    half of a half that raises, until every unit either ran in a part that succeeded or raised
    alone. Returns the results of the parts that succeeded (in unit order) and (unit, what it
    raised) for each unit that fails alone.

    f failing units among n cost at most about 2 f log2(n) extra runs. A failure that needs
    several units together (or one that does not repeat) fails none of them, since the parts
    that then run succeed; a failure of every run fails every unit.
    """
    if len(units) == 1:
        return [], [(units[0], error)]
    results: list[Result] = []
    failures: list[tuple[Unit, Exception]] = []
    middle = len(units) // 2
    for part in (units[:middle], units[middle:]):
        try:
            results.append(run(part))
        except Exception as exc:
            part_results, part_failures = isolate_failures(part, run, exc)
            results += part_results
            failures += part_failures
    return results, failures
