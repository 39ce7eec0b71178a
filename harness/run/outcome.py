"""How a run ended, in words and as the exit code of `bench run`.

Exit codes: 0 the run completed (and met its SLO when `--slo` was given); 1 it completed but
missed its SLO, or with `--check-outputs` some output was `wrong output`; 2 usage error (bad
flags, files or target, before anything ran); 3 the run was stopped by its error limits
(`--max-error-rate`, `--max-consecutive-errors`), by `--stop-on-saturation`, by a first
request answered 404 or by the death of the server it manages, or most of its requests failed
(requests the client cancelled itself count for neither), or its SLO verdict is inconclusive
(as `bench compare --gate`); 4 its ledger does not balance (a scheduled request without a
row, or a row for no scheduled request: a harness defect, whatever else happened); 130
interrupted (Ctrl-C, SIGTERM). A missed SLO or a wrong output (1) outranks an inconclusive
verdict (3), as a regression does in the gate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from harness.targets.process import exit_description
from slo.runrecord import Ledger, RequestStatus, RunSummary, SLOEvaluation
from slo.stats import FAIL, INCONCLUSIVE

EXIT_OK = 0
EXIT_SLO_FAILED = 1
EXIT_USAGE = 2
EXIT_ERRORS = 3
EXIT_INCONCLUSIVE = 3  # the SLO could not be judged (too few samples): as the CI gate's 3
EXIT_LEDGER = 4  # lost or unexpected rows: the records themselves cannot be trusted
EXIT_INTERRUPTED = 130
UNHEALTHY_ERROR_RATE = 0.5  # more than this fraction failed: the run measured a broken target


@dataclass(frozen=True)
class Verdict:
    exit_code: int
    sentence: str | None  # what the console says, None when all went well

    def to_dict(self) -> dict:
        return asdict(self)  # the manifest's `outcome`: exit_code, sentence


@dataclass(frozen=True)
class RunOutcome:
    """Where the run went and what it found; `summary` is `slo.summarize`'s, typed."""

    run_dir: Path
    summary: RunSummary
    complete: bool
    interrupted_reason: str | None
    verdict: Verdict = Verdict(EXIT_OK, None)
    stopped_by_errors: bool = False


@dataclass(frozen=True)
class OutputTally:
    """`--check-outputs`: the requests that ended ok, how many of them are `wrong output`
    (`output_valid` false), and those by the flag that made them wrong."""

    n_ok: int
    n_wrong: int
    by_flag: dict[str, int]

    def sentence(self) -> str:
        flags = ", ".join(f"{name} {n}" for name, n in sorted(self.by_flag.items()))
        detail = f" ({flags})" if flags else ""
        return f"{self.n_wrong} of {self.n_ok} outputs checked are wrong output{detail}."


def dominant_error(summary: RunSummary) -> tuple[str | None, int, str | None]:
    """(error class, count, its first message) of the most frequent error class."""
    counts = summary.counts
    by_class = counts.by_error_class or {}
    if not by_class:
        return None, 0, None
    name, n = max(by_class.items(), key=lambda item: (item[1], item[0]))
    first = (counts.first_message_by_error_class or {}).get(name)
    return name, n, first


def served_counts(summary: RunSummary) -> tuple[int, int]:
    """(failed, judged): the requests that reached a verdict on the target, i.e. all but those
    the client cancelled itself (a fault plan's cancel or disconnect storm, or Ctrl-C), and how
    many of them did not end ok."""
    counts = summary.counts
    by_status = counts.by_status or {}
    judged = int(counts.total or 0) - int(by_status.get(RequestStatus.CANCELLED, 0))
    return judged - int(by_status.get(RequestStatus.OK, 0)), judged


def failure_sentence(summary: RunSummary) -> str:
    failed, judged = served_counts(summary)
    cancelled = judged != int(summary.counts.total or 0)
    name, n, first = dominant_error(summary)
    detail = f"; most failed with {name} ({n})" if name else ""
    if first:
        detail += f": {first}"
    scope = " not cancelled by the client" if cancelled else ""
    return f"{failed} of {judged} requests{scope} failed{detail}."


def inconclusive_sentence(slo: SLOEvaluation) -> str | None:
    """Which SLO objectives could not be judged, and why the first of them could not; None
    when none could not (a spec of per-request limits only, such as vLLM's `--goodput`, has
    no objective: it defines goodput and judges nothing)."""
    objectives = slo.objectives or []
    open_ = [o for o in objectives if o.verdict == INCONCLUSIVE]
    if not open_:
        return None
    return (
        f"The SLO verdict is inconclusive ({len(open_)} of {len(objectives)} objectives could "
        f"not be judged: {open_[0].name}: {open_[0].reason}); more requests "
        "may decide it."
    )


def ledger_sentence(summary: RunSummary) -> str | None:
    """What is wrong with the run's ledger when it lost or invented rows; None when it
    balances (or could not be checked: a run without a schedule)."""
    ledger = summary.ledger or Ledger.empty()
    lost, unexpected = int(ledger.lost or 0), int(ledger.unexpected or 0)
    if not lost and not unexpected:
        return None
    ids = list(ledger.lost_ids or [])[:5]
    named = f" ({', '.join(ids)}{', ...' if lost > len(ids) else ''})" if ids else ""
    return (
        f"The ledger does not balance: {lost} scheduled requests have no row{named} and "
        f"{unexpected} rows are unexpected (for no scheduled request, or a second for one), "
        "so the run's figures cannot be trusted; this is a harness defect, please report it."
    )


def judge(
    summary: RunSummary,
    *,
    stopped_reason: str | None,
    stopped_by_errors: bool,
    slo_given: bool,
    outputs: OutputTally | None = None,
    not_found: str | None = None,
) -> Verdict:
    """The run's verdict from its summary and how it stopped; `outputs` is the output tally
    of a `--check-outputs` run (None: outputs were not checked against the reference);
    `not_found` is `not_found_sentence` for the run (a first request answered 404: exit 3
    at least). A ledger that does not balance is exit 4 whatever else happened, except an
    interruption (130), whose sentence then says so."""
    verdict = _judge_run(
        summary,
        stopped_reason=stopped_reason,
        stopped_by_errors=stopped_by_errors,
        slo_given=slo_given,
        outputs=outputs,
    )
    if not_found is not None:
        verdict = Verdict(max(verdict.exit_code, EXIT_ERRORS), not_found)
    broken = ledger_sentence(summary)
    if broken is None:
        return verdict
    code = EXIT_INTERRUPTED if verdict.exit_code == EXIT_INTERRUPTED else EXIT_LEDGER
    return Verdict(code, " ".join(filter(None, [broken, verdict.sentence])))


def _judge_run(
    summary: RunSummary,
    *,
    stopped_reason: str | None,
    stopped_by_errors: bool,
    slo_given: bool,
    outputs: OutputTally | None,
) -> Verdict:
    if stopped_by_errors:
        return Verdict(EXIT_ERRORS, f"The run was stopped early: {stopped_reason}")
    if stopped_reason is not None:
        return Verdict(EXIT_INTERRUPTED, None)
    failed, judged = served_counts(summary)
    if judged and failed / judged > UNHEALTHY_ERROR_RATE:
        return Verdict(
            EXIT_ERRORS, f"The target did not serve this run: {failure_sentence(summary)}"
        )
    saturation = summary.saturation
    saturated = saturation.sentence if saturation is not None and saturation.saturated else None
    slo = (summary.slo if slo_given else None) or SLOEvaluation.empty()
    missed = []
    if slo.verdict == FAIL:
        missed.append("The run missed its SLO.")
    if outputs is not None and outputs.n_wrong:
        missed.append(outputs.sentence())
    if missed:
        return Verdict(EXIT_SLO_FAILED, " ".join(filter(None, [*missed, saturated])))
    undecided = inconclusive_sentence(slo) if slo.verdict == INCONCLUSIVE else None
    if undecided is not None:
        return Verdict(EXIT_INCONCLUSIVE, " ".join(filter(None, [undecided, saturated])))
    return Verdict(EXIT_OK, saturated)


def not_found_sentence(
    base_url: str,
    url: str,
    first_status: int | None,
    n_not_found: int,
    total: int,
    *,
    not_sent: int = 0,
) -> str | None:
    """What to try when the target answered HTTP 404: None unless the first request got one.

    `url` is the request URL tried under `base_url`; a base URL without `/v1` is the usual
    cause (vLLM's `--base-url` form), an unknown model name the other (vLLM answers 404).
    `total` counts the requests sent; `not_sent` those the run's stop at the 404 kept back."""
    if first_status != 404:
        return None
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        hint = f"the OpenAI API usually lives under /v1: try --url {base}/v1"
    else:
        hint = f"check that {base} is the OpenAI base URL and that the target serves the model asked for (--model)"
    stopped = (
        f" The run stopped at the first 404; {not_sent} requests were not sent." if not_sent else ""
    )
    return f"{n_not_found} of {total} requests got HTTP 404 from POST {url}; {hint}.{stopped}"


def server_exit_sentence(
    name: str, returncode: int, elapsed_s: float | None, log_name: str, last_lines: list[str]
) -> str:
    """`the managed vllm exited with SIGSEGV 1.2 s into the run; last lines of server.log: ...`.

    `elapsed_s` is seconds from the measured phase's start to when the exit was seen (None:
    during warm-up); `last_lines` the end of the server's log."""
    when = "during warm-up" if elapsed_s is None else f"{elapsed_s:.1f} s into the run"
    tail = " | ".join(last_lines) if last_lines else "(empty)"
    return (
        f"the managed {name} exited with {exit_description(returncode)} {when}; "
        f"last lines of {log_name}: {tail}"
    )
