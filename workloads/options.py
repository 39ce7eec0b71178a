"""CLI overrides applied on top of a workload spec."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from workloads.schema import WorkloadError

ENDPOINTS = ("completions", "chat", "responses", "messages", "embeddings", "rerank")  # slo Endpoint


@dataclass(frozen=True)
class WorkloadOptions:
    """Overrides from the command line; every None means "use the workload's own default".

    - `num_requests`: number of requests (ignored when `duration_s` bounds an open-loop run).
    - `input_len`, `output_len`: tokens; replace the length distribution with a fixed length, or
      a vLLM-style uniform one when `range_ratio` is also given.
    - `range_ratio`: in [0, 1); lengths uniform over [floor(L*(1-r)), ceil(L*(1+r))].
    - `request_rate`: requests per second; `math.inf` sends everything at once.
    - `burstiness`: gamma shape of inter-arrival gaps (1 = Poisson; CV = 1/sqrt(shape)).
    - `seed`: seeds lengths, arrivals, dataset shuffle and prompt sampling.
    - `ignore_eos`: whether requests ask the server to ignore end-of-sequence.
    - `dataset_path`: dataset or trace file for workloads that read one (e.g. ShareGPT JSON).
    - `endpoint`: one of `ENDPOINTS` (chat, responses and messages prompts are single user
      messages).
    - `duration_s`: generate open-loop arrivals until this many seconds.
    - `concurrency`: run closed-loop with this many requests in flight (no arrival times).
    """

    num_requests: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    request_rate: float | None = None
    burstiness: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    dataset_path: str | None = None
    endpoint: str | None = None
    duration_s: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len", "concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise WorkloadError(f"{name} must be a positive integer, got {value!r}.")
        if self.range_ratio is not None and not 0.0 <= self.range_ratio < 1.0:
            raise WorkloadError(f"range_ratio must be in [0, 1), got {self.range_ratio!r}.")
        if self.request_rate is not None and not (
            self.request_rate > 0 and not math.isnan(self.request_rate)
        ):
            raise WorkloadError(
                f"request_rate must be positive (inf = all at once), got {self.request_rate!r}."
            )
        if self.burstiness is not None and not (
            0 < self.burstiness and math.isfinite(self.burstiness)
        ):
            raise WorkloadError(f"burstiness must be a positive number, got {self.burstiness!r}.")
        if self.duration_s is not None and not (0 < self.duration_s < math.inf):
            raise WorkloadError(f"duration_s must be positive and finite, got {self.duration_s!r}.")
        if self.endpoint is not None and self.endpoint not in ENDPOINTS:
            raise WorkloadError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}."
            )

    def overrides(self) -> dict[str, Any]:
        """The options that are set (not None), JSON-friendly (`inf` as the string "inf")."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if value is None:
                continue
            out[key] = "inf" if isinstance(value, float) and math.isinf(value) else value
        return out
