"""Picking series out of the history: runs grouped by comparability key, narrowed by what a user
types (`--workload sharegpt --target engine_ref`), and the sentence that says which key to add
when more than one series is left."""

from __future__ import annotations

from dataclasses import dataclass

from reports.errors import ReportError
from reports.history.record import HistoryRun, SeriesKey


@dataclass(frozen=True)
class SeriesFilter:
    """Each field narrows the series (None: any). Matching is case-insensitive:
    `workload` the name or a prefix of the table hash; `target` the engine, its version, or
    "engine version"; `model` the name or a prefix of its hash; `hardware` any part of the CPU
    or GPU name; `series` a prefix of the series id."""

    workload: str | None = None
    target: str | None = None
    model: str | None = None
    hardware: str | None = None
    series: str | None = None

    def matches(self, key: SeriesKey) -> bool:
        def norm(value) -> str:
            return (value or "").lower()

        checks = {
            "workload": lambda w: (
                w in (norm(key.workload_name),) or norm(key.workload_sha256).startswith(w)
            ),
            "target": lambda t: (
                t
                in (
                    norm(key.engine),
                    norm(key.engine_version),
                    f"{norm(key.engine)} {norm(key.engine_version)}",
                )
            ),  # fmt: skip
            "model": lambda m: m == norm(key.model) or norm(key.model_sha256).startswith(m),
            "hardware": lambda h: h in norm(key.hardware),
            "series": lambda s: key.series_id.startswith(s),
        }
        return all(
            check(value.strip().lower())
            for name, check in checks.items()
            if (value := getattr(self, name)) is not None
        )

    @property
    def given(self) -> bool:
        return any(getattr(self, f) is not None for f in self.__dataclass_fields__)


# What tells series apart -> the option that picks among them.
_DISTINGUISHING = (
    (("workload_name", "workload_sha256"), "--workload"),
    (("engine", "engine_version"), "--target"),
    (("model", "model_sha256", "dtype"), "--model"),
    (("hardware",), "--hardware"),
)


def group_series(runs: list[HistoryRun]) -> dict[str, list[HistoryRun]]:
    """series id -> its runs, in the order given (oldest first from `HistoryStore.runs`)."""
    groups: dict[str, list[HistoryRun]] = {}
    for run in runs:
        groups.setdefault(run.key.series_id, []).append(run)
    return groups


def select_series(runs: list[HistoryRun], wanted: SeriesFilter) -> dict[str, list[HistoryRun]]:
    """The series whose key matches `wanted`; ReportError when none does."""
    groups = {s: rs for s, rs in group_series(runs).items() if wanted.matches(rs[0].key)}
    if not groups:
        if not runs:
            raise ReportError(
                "the history holds no runs yet; add some with `bench history add RUN`."
            )
        raise ReportError(
            "no series in the history matches those keys; `bench history list` shows the series."
        )
    return groups


def one_series(runs: list[HistoryRun], wanted: SeriesFilter) -> list[HistoryRun]:
    """The one series matching `wanted`; ReportError listing the candidates and the options
    that tell them apart when several match."""
    groups = select_series(runs, wanted)
    if len(groups) == 1:
        return next(iter(groups.values()))
    keys = [rs[0].key for rs in groups.values()]
    options = [
        option
        for fields, option in _DISTINGUISHING
        if len({tuple(getattr(k, f) for f in fields) for k in keys}) > 1
    ]
    listing = "; ".join(f"{sid} ({rs[0].key.label}, {len(rs)} runs)" for sid, rs in groups.items())
    raise ReportError(
        f"{len(groups)} series match: {listing}; add {' or '.join(options or ['--series'])} "
        "(or --series ID) to pick one."
    )
