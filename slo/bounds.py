"""Lower bounds against the run: what the model's geometry says a run must at least hold or
take, beside what the engine reported, and the ratio measured / bound.

The bounds are the seed's starting points for orders of magnitude; a real run misses them, and
the ratio says by how much, each block with the reasons it can:

- M_KV per request = 2 · L · A_kv · d_h · s · T: L layers, A_kv KV heads, d_h head dim, s bytes
  per stored element (the target's `kv_geometry`, which the reference engine's `/info` gives),
  the 2 for K and V, T the tokens a request holds at its peak: prompt + output - 1 (the last
  output token is sampled and returned, never fed back, so its K and V are never written).
  Prompt and output are the server's usage counts (the workload's and the client's where the
  server gave none). Measured: the engine's `kv_peak_bytes` for the request (ok requests only:
  their usage is final).
- M_KV of the peak in-flight set: the same formula over the tokens held by every request in
  flight at the instant they held the most. The approximation: a request holds its prompt
  plus the output tokens the client has received so far, less one, from its first token to its
  done time (from `chunks.parquet`), and nothing before its first token. That undercounts
  (the engine is ahead of the client; a request prefilling or waiting holds KV before its first
  token), so it stays a lower bound; only between the engine freeing a request and the client
  seeing its end does it count tokens no longer held. Measured: the engine's KV gauge
  (`vllm:kv_cache_usage_perc`, the fraction of blocks held by requests) times the pool's bytes.
  The gauge is a scrape every second or so and rarely falls on the peak itself, so it is
  compared at the scrape that saw the most tokens held, with the bound at that same instant.
- Little's law per load phase: L = lambda · W (`slo.littles_law`, the one implementation);
  lambda · W stands where the bounds have their bound and L where they have the measured figure.
- T_transfer >= M_KV / B_effective: the KV moves of a prefill/decode cluster; absent, with
  the reason: no KV moved, or no independent measure of the link's bandwidth.

A target that reports no geometry (vLLM, llama.cpp) gets each KV block absent with that reason.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from functools import partial

import numpy as np
import pyarrow as pa

from slo.cost import cost_summary, energy_summary
from slo.frame import RequestMetrics, attempted_requests
from slo.littles_law import littles_law_by_phase
from slo.load_phases import load_phases
from slo.metrics import NS_PER_S, ChunkOrder, distribution
from slo.runrecord import RequestColumn, RunTables, float_column
from slo.runrecord.bounds_sections import (
    Bounds,
    KVPeakBound,
    KVRequestBound,
    LittleBounds,
    PhaseLittleBound,
    TransferBound,
)
from slo.runrecord.sections import Distribution
from slo.server_metrics import GAUGES, series_by_time
from slo.spec import SLOSpec

KV_FORMULA = "M_KV = 2 · L · A_kv · d_h · s · T"
KV_REQUEST_TOKENS = "T = prompt + output - 1 tokens (the last output token is never written)"
KV_PEAK_APPROXIMATION = (
    "each request in flight holds its prompt plus the output tokens received so far, less one, "
    "from its first token to its done time; nothing before its first token"
)
LITTLE_FORMULA = "L = lambda · W (bound: lambda · W; measured: L, the mean in flight)"
TRANSFER_FORMULA = "T_transfer >= M_KV / B_effective"
WHY_REQUEST = (
    "the engine holds whole blocks, so block rounding adds up to block_size - 1 slots a request "
    "(explained_ratio: rounding and the pool's bytes per token alone); a lossy KV dtype stores "
    "scales beside its values (the pool's bytes per token above 2 · L · A_kv · d_h · s); evicted "
    "tokens (a window with sinks) lower it, speculative drafts written and rolled back raise it"
)
WHY_PEAK = (
    "the engine runs ahead of the client and holds KV for requests prefilling or waiting before "
    "their first token (measured above the bound); it holds whole blocks, and lossy dtypes' "
    "scales; the gauge is sampled once a scrape, so the scraped instant may not be the peak"
)
NO_MEASURE = "no measured figure"
WHY_LITTLE = (
    "near 1 in a steady state over a phase long against W; a phase whose queue keeps growing "
    "counts time in W that L, cut at the phase's end, does not (below 1: far below for requests "
    "sent all at once), and the next phase inherits that backlog (above 1)"
)
WHY_TRANSFER = (
    "a transfer also pays connection set-up, per-block checksums and the install; B_effective "
    "is below the link's nominal bandwidth"
)
NO_GEOMETRY = (
    "the target reports no KV geometry (the reference engine's /info does; vLLM and llama.cpp "
    "do not), so there is no bound to compute"
)
NO_TRANSFER = "the target is not a prefill/decode cluster: the run moved no KV between workers"
NO_LINK_MEASURE = (
    "the run moved KV between workers (the cluster block gives the effective bandwidth of its "
    "transfers), but nothing measured the link's own bandwidth to bound them with"
)
KV_GAUGE_NAMES = dict(GAUGES)["kv_cache_usage"]


@dataclass(frozen=True)
class KVGeometry:
    """The target's `kv_geometry` (manifest `target`, from the reference engine's `/info`): the
    first four make the bound; the pool's bytes per token (scales included), its block size
    and its bytes explain and measure it (None: not reported)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int  # s: bytes of one stored element (4 float32, 2 bf16/fp16, 1 int8/fp8)
    kv_bytes_per_token: float | None = None
    block_size: float | None = None
    pool_bytes: float | None = None

    @classmethod
    def of(cls, target: dict | None) -> tuple[KVGeometry | None, str | None]:
        """(the geometry, None), or (None, why there is none): the target reports none, or a
        field of the bound is not a positive whole number. An optional field that is not a
        positive number reads as None."""
        raw = (target or {}).get("kv_geometry")
        if not isinstance(raw, dict):
            return None, NO_GEOMETRY
        values = {}
        for f in fields(cls):
            value = raw.get(f.name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if f.default is MISSING:
                if not (number and isinstance(value, int) and value >= 1):
                    return None, f"the target's kv_geometry has no usable {f.name} ({value!r})"
            elif not (number and value > 0):
                value = None
            values[f.name] = value
        return cls(**values), None

    @property
    def bytes_per_token(self) -> int:
        """2 · L · A_kv · d_h · s: the K and V bytes one token needs in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes


def tokens_at_peak(prompt_tokens: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
    """The tokens a finished request held at its peak: prompt + output - 1 (NaN where either
    count is missing or there was no output)."""
    prompt = np.asarray(prompt_tokens, float)
    output = np.asarray(output_tokens, float)
    with np.errstate(invalid="ignore"):
        return np.where(output >= 1, prompt + output - 1, np.nan)


def kv_request_bound(
    geometry: KVGeometry | None,
    absent: str | None,
    *,
    is_ok: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    kv_peak_bytes: np.ndarray,
    kv_evicted_tokens: np.ndarray,
) -> KVRequestBound:
    """M_KV per request (module docstring) over the requests of the aligned arrays; absent
    (with `absent`, or why) without geometry or without an ok request the engine reported
    KV bytes for."""
    if geometry is None:
        return KVRequestBound(formula=KV_FORMULA, absent=absent)
    per_token = geometry.bytes_per_token
    held = tokens_at_peak(prompt_tokens, output_tokens)
    measured = np.asarray(kv_peak_bytes, float)
    compared = np.asarray(is_ok, bool) & ~np.isnan(measured) & (held >= 1)
    if not compared.any():
        return KVRequestBound(
            formula=KV_FORMULA,
            bytes_per_token=per_token,
            absent="no ok request came back with the engine's kv_peak_bytes (the target does "
            "not report KV bytes per request)",
        )
    held, measured = held[compared], measured[compared]
    bound = per_token * held
    ratio = measured / bound
    block_size, pool_per_token = geometry.block_size, geometry.kv_bytes_per_token
    explained = Distribution.empty()
    if block_size is not None and pool_per_token is not None:
        rounded = np.ceil(held / block_size) * block_size
        explained = Distribution.from_dict(distribution(rounded * pool_per_token / bound))
    evicted = np.asarray(kv_evicted_tokens, float)[compared]
    return KVRequestBound(
        formula=f"{KV_FORMULA}; {KV_REQUEST_TOKENS}",
        bytes_per_token=per_token,
        pool_bytes_per_token=None if pool_per_token is None else int(pool_per_token),
        n=int(compared.sum()),
        bound_bytes=float(bound.sum()),
        measured_bytes=float(measured.sum()),
        ratio=float(measured.sum() / bound.sum()),
        ratio_per_request=Distribution.from_dict(distribution(ratio)),
        explained_ratio=explained,
        below_bound=int((measured < bound).sum()),
        evicted=int((evicted > 0).sum()),
        why_differs=WHY_REQUEST,
    )


@dataclass(frozen=True)
class TokensHeld:
    """The tokens held by the requests in flight over time, under the module docstring's
    approximation: after the k-th event (time order, at `t_ns[k]`), `tokens[k]` held by
    `requests[k]` requests."""

    t_ns: np.ndarray
    tokens: np.ndarray
    requests: np.ndarray

    @classmethod
    def of(
        cls,
        request_id: np.ndarray,
        prompt_tokens: np.ndarray,
        t_done_ns: np.ndarray,
        chunks: ChunkOrder,
    ) -> TokensHeld | None:
        """The timeline of the requests of the aligned arrays (a NaN done time: never done,
        held to the end) from their token-bearing chunks; None when none streamed a token.
        At equal times a departure comes before another request's tokens."""
        code_of = {name: k for k, name in enumerate(chunks.names)}
        prompt_of = np.full(len(chunks.names), np.nan)
        done_of = np.full(len(chunks.names), np.nan)
        for rid, prompt, done in zip(request_id, prompt_tokens, t_done_ns, strict=True):
            code = code_of.get(rid)
            if code is not None:
                prompt_of[code], done_of[code] = prompt, done
        keep = (chunks.n_tokens > 0) & ~np.isnan(prompt_of[chunks.codes])
        codes, t_ns = chunks.codes[keep], chunks.t_ns[keep].astype(float)
        if codes.size == 0:
            return None
        first = np.ones(codes.size, bool)
        first[1:] = codes[1:] != codes[:-1]  # the order groups a request's chunks in time order
        gained = chunks.n_tokens[keep].astype(float)
        gained[first] += prompt_of[codes[first]] - 1
        held_by = np.zeros(len(chunks.names))
        np.add.at(held_by, codes, gained)
        leaving = np.unique(codes)
        leaving = leaving[~np.isnan(done_of[leaving])]
        times = np.concatenate([t_ns, done_of[leaving]])
        tokens = np.concatenate([gained, -held_by[leaving]])
        requests = np.concatenate([first.astype(float), -np.ones(leaving.size)])
        order = np.lexsort((tokens > 0, times))  # departures (negative) first at equal times
        return cls(times[order], np.cumsum(tokens[order]), np.cumsum(requests[order]))

    def peak(self) -> tuple[float, int, int]:
        """(t_ns, requests, tokens) at the first instant the most tokens were held."""
        k = int(np.argmax(self.tokens))
        return float(self.t_ns[k]), int(self.requests[k]), int(round(self.tokens[k]))

    def tokens_at(self, t_ns: np.ndarray) -> np.ndarray:
        """The tokens held at each of the times `t_ns` (0 before the first event)."""
        k = np.searchsorted(self.t_ns, np.asarray(t_ns, float), side="right") - 1
        return np.where(k >= 0, self.tokens[np.maximum(k, 0)], 0.0)


def kv_peak_bound(
    geometry: KVGeometry | None,
    absent: str | None,
    *,
    rm: RequestMetrics,
    prompt_tokens: np.ndarray,
    chunks: ChunkOrder | None,
    server_metrics: pa.Table,
    streamed: bool,
) -> KVPeakBound:
    """M_KV of the peak in-flight set (module docstring) against the engine's KV gauge: the
    bound at the instant the most tokens were held, and the gauge at the scrape that saw the
    most tokens held (a scrape between events, so the bound there is exact under the
    approximation, and the ratio compares one instant)."""
    block = partial(KVPeakBound, formula=KV_FORMULA, approximation=KV_PEAK_APPROXIMATION)
    if geometry is None:
        return block(absent=absent)
    if not streamed:
        return block(
            absent="the run was not streamed, so when each request held its tokens is unknown"
        )
    if chunks is None:
        return block(
            absent="the run's token-bearing chunks are over its memory budget "
            "(--memory-budget-mb), so the in-flight timeline was not held"
        )
    held = TokensHeld.of(rm.request_id, prompt_tokens, rm.t_done_ns, chunks)
    if held is None:
        return block(absent="no request streamed a token")
    t_ns, in_flight, tokens = held.peak()
    per_token = geometry.bytes_per_token
    figures = dict(
        peak_s=t_ns / NS_PER_S,
        in_flight=in_flight,
        tokens_held=tokens,
        bound_bytes=float(per_token * tokens),
    )
    series = series_by_time(server_metrics, KV_GAUGE_NAMES)
    if series is None:
        return block(**figures, why_differs=f"{NO_MEASURE}: the run scraped no KV gauge")
    if geometry.pool_bytes is None:
        return block(**figures, why_differs=f"{NO_MEASURE}: the kv_geometry has no pool size")
    t_s, usage = series
    largest = float(usage.max() * geometry.pool_bytes)
    at_samples = held.tokens_at(t_s * NS_PER_S)
    if not (at_samples > 0).any():
        why = (
            f"{NO_MEASURE}: no scrape fell while requests held tokens (the load was shorter "
            "than the scrape interval)"
        )
        return block(**figures, measured_max_bytes=largest, why_differs=why)
    k = int(np.argmax(at_samples))
    sample_bound = float(per_token * at_samples[k])
    measured = float(usage[k] * geometry.pool_bytes)
    return block(
        **figures,
        sample_s=float(t_s[k]),
        sample_bound_bytes=sample_bound,
        measured_bytes=measured,
        ratio=measured / sample_bound,
        measured_max_bytes=largest,
        why_differs=WHY_PEAK,
    )


def little_bounds(rm: RequestMetrics, workload: dict | None) -> LittleBounds:
    """Little's law per load phase (`slo.load_phases`, `slo.littles_law`)."""
    phases = load_phases(workload, rm.t_sent_ns)
    if not phases:
        return LittleBounds(formula=LITTLE_FORMULA, absent="no request was sent")
    littles = littles_law_by_phase(rm.t_scheduled_ns, rm.t_sent_ns, rm.t_done_ns, phases)
    rows = [
        PhaseLittleBound(
            phase=p.index,
            start_s=p.start_ns / NS_PER_S,
            end_s=p.end_ns / NS_PER_S,
            little_law=little,
        )
        for p, little in zip(phases, littles, strict=True)
    ]
    return LittleBounds(formula=LITTLE_FORMULA, phases=rows, why_differs=WHY_LITTLE)


def transfer_bound(requests) -> TransferBound:
    """The P/D transfer bound: absent, with why. A run that moved no KV between workers has
    nothing to bound; one that did (the `disaggregation` block has its effective bandwidth,
    sum of bytes over sum of transfer times) has no independent measure of the link's
    bandwidth to bound it with yet."""
    moved = float_column(requests, RequestColumn.KV_TRANSFER_BYTES)
    absent = NO_LINK_MEASURE if np.nansum(moved) > 0 else NO_TRANSFER
    return TransferBound(formula=TRANSFER_FORMULA, why_differs=WHY_TRANSFER, absent=absent)


def usage_or(primary: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """`primary` (the server's usage count) where it has a value, else `fallback`."""
    return np.where(np.isnan(primary), fallback, primary)


def bounds_summary(
    tables: RunTables,
    rm: RequestMetrics,
    chunks: ChunkOrder | None,
    spec: SLOSpec | None,
    *,
    streamed: bool,
) -> dict:
    """The `bounds` block of the summary: the KV bounds per request and at the peak, Little's
    law per phase, the transfer bound, the cost per million output tokens at `spec` and the
    energy per output token (`slo.cost`). `rm` holds the sent requests of `tables.requests`
    in table order."""
    manifest = tables.manifest
    target = (manifest.target if manifest is not None else None) or {}
    config = (manifest.config if manifest is not None else None) or {}
    geometry, absent = KVGeometry.of(target)
    sent = attempted_requests(tables.requests)  # the rows of `rm`
    prompt = usage_or(float_column(sent, RequestColumn.USAGE_PROMPT_TOKENS), rm.input_tokens)
    output = usage_or(float_column(sent, RequestColumn.USAGE_COMPLETION_TOKENS), rm.output_tokens)
    return Bounds(
        kv_request=kv_request_bound(
            geometry,
            absent,
            is_ok=rm.is_ok,
            prompt_tokens=prompt,
            output_tokens=output,
            kv_peak_bytes=float_column(sent, RequestColumn.KV_PEAK_BYTES),
            kv_evicted_tokens=float_column(sent, RequestColumn.KV_EVICTED_TOKENS),
        ),
        kv_peak=kv_peak_bound(
            geometry,
            absent,
            rm=rm,
            prompt_tokens=prompt,
            chunks=chunks,
            server_metrics=tables.server_metrics,
            streamed=streamed,
        ),
        little_law=little_bounds(rm, manifest.workload if manifest is not None else None),
        transfer=transfer_bound(sent),
        cost=cost_summary(rm, spec, config.get("cost_per_hour")),
        energy=energy_summary(manifest.energy if manifest is not None else None, rm, target=target),
    ).to_dict()
