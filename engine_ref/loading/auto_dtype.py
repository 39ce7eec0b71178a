"""`dtype="auto"` on a CPU, chosen by measurement: the fastest dtype whose greedy tokens agree
with float32's on the check prompts at least as well as bfloat16's do.

Candidates are float32 and bfloat16, and float16 where the CPU has AVX-512 FP16 (elsewhere
torch emulates it). `measure` builds one engine per candidate from the same float32 weights
and, through `LLMEngine.step`:
- agreement: greedy tokens for `CHECK_PROMPTS` (`CHECK_TOKENS` each, one batch) against
  float32's; a sequence counts its tokens up to the first that differs (after it the two
  continue from different text). float32 agrees 100% by definition.
- speed: the median decode-step time at each of `BATCH_SIZES` rows, each candidate warmed
  up, then `ROUNDS` rounds of `STEPS_PER_ROUND` steps, the candidates taking turns (the order
  rotating), so a busy neighbour slows them alike.
`choose` keeps the candidates that agree at least as well as bfloat16, ranks them by the
geometric mean of their step times over the batch sizes, and takes the fastest; candidates
within `TIE_MARGIN` of it count as tied (timing noise), and the most accurate of those wins.

The decision is cached as JSON under `<cache>/dtype/`, keyed by the weights (file SHA-256),
the quantization, the CPU (model name and flags), the kernels that run (`kernels.describe()`
and their sources' digest), torch's version, the thread count and this procedure. A float32
engine runs torch's kernels while the engine's own are first built in the background; the
measurement would then compare the wrong float32, so until they are built `auto` keeps the
static rule and measures nothing (a later start measures); so it does on a busy machine
(`machine_load`), whose timings would be noise. `BENCH_REF_AUTO_DTYPE=static`
always keeps the static rule; `measure` (the default) measures. CUDA keeps the static rule.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench_common.cache import CacheArea, cache_area
from engine_ref.core import kernels
from engine_ref.core.engine import LLMEngine
from engine_ref.core.engine_config import (
    DtypeChoice,
    DtypeSource,
    EngineConfig,
    EngineConfigError,
    SamplingParams,
)
from engine_ref.core.quant import INT4_MODES
from engine_ref.loading.model_files import resolve_model, sha256_of
from engine_ref.loading.weights import load_model

__all__ = [
    "Measurement",
    "agreement",
    "choose",
    "decode_step_seconds",
    "greedy_tokens",
    "measure",
    "resolve_auto_dtype",
]

log = logging.getLogger(__name__)

ENV_VAR = "BENCH_REF_AUTO_DTYPE"
MODES = ("measure", "static")
# Four short prompts of different kinds (a fact, code, a number, chat), so a divergence in
# any of them shows; 16 tokens each is long enough for a rounding flip early on to change the
# text and keeps the check to one batch of 17 steps per candidate.
CHECK_PROMPTS = (
    "The capital of France is",
    "def main(): return sum(x * x for x in",
    "Water boils at 100 degrees Celsius and freezes at",
    "Hello, how are you today? I am",
)
CHECK_TOKENS = 16
BATCH_SIZES = (1, 16)
WARMUP_STEPS = 1
ROUNDS = 3
STEPS_PER_ROUND = 2
TIE_MARGIN = 0.05
# A busier machine is not measured: its step times would say more about the neighbours than
# about the dtypes, and the measurement would take several times as long.
BUSY_LOAD_PER_CPU = 1.5


@dataclass(frozen=True)
class Measurement:
    """One candidate: `agreement` with float32's greedy tokens (0 to 1) and `step_ms`, the
    median decode-step milliseconds by batch size."""

    dtype: str
    agreement: float
    step_ms: dict[int, float]

    @property
    def speed_score_ms(self) -> float:
        """The geometric mean of `step_ms` over its batch sizes (lower is faster)."""
        return math.exp(statistics.fmean(math.log(ms) for ms in self.step_ms.values()))


def agreement(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """The share of `reference`'s tokens that `tokens` matches before its first difference,
    sequence by sequence (1.0 for identical lists; 1.0 when `reference` is empty)."""
    matched = total = 0
    for ours, theirs in zip(tokens, reference, strict=True):
        total += len(theirs)
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                break
            matched += 1
    return matched / total if total else 1.0


def choose(
    measurements: Sequence[Measurement], *, tie_margin: float = TIE_MARGIN
) -> tuple[str, str]:
    """(dtype, reason) for `measurements` (in order of preference, most precise first; float32
    among them). A candidate qualifies when its agreement is at least bfloat16's (float32's
    when bfloat16 was not measured); of those, the fastest by `speed_score_ms` wins, except
    that candidates within `tie_margin` of it are tied and the one with the highest agreement
    (then the earliest) wins."""
    by_name = {m.dtype: m for m in measurements}
    bar = by_name.get("bfloat16", by_name["float32"]).agreement
    qualifying = [m for m in measurements if m.agreement >= bar]
    fastest = min(qualifying, key=lambda m: m.speed_score_ms)
    tied = [m for m in qualifying if m.speed_score_ms <= fastest.speed_score_ms * (1 + tie_margin)]
    best = max(tied, key=lambda m: m.agreement)  # max keeps the first of equals
    if best is fastest:
        why = "the fastest"
    else:
        why = f"within {tie_margin:.0%} of {fastest.dtype}'s speed and agreeing better"
    excluded = [
        m for m in measurements if m.agreement < bar and m.speed_score_ms < best.speed_score_ms
    ]
    if excluded:
        names = ", ".join(m.dtype for m in excluded)
        why += f" ({names} faster but agreeing less than bfloat16)"
    return best.dtype, f"{best.dtype}, {why}: {_figures(measurements)}"


def _figures(measurements: Sequence[Measurement]) -> str:
    """'28.1 ms float32, 17.9 ms bfloat16 per decode step at batch 1; ...; agreement ...'"""
    batch_sizes = sorted(measurements[0].step_ms)
    parts = []
    for b in batch_sizes:
        times = ", ".join(f"{m.step_ms[b]:.1f} ms {m.dtype}" for m in measurements)
        parts.append(f"{times} per decode step at batch {b}")
    agreements = ", ".join(f"{m.agreement:.0%} {m.dtype}" for m in measurements)
    return "; ".join(parts) + f"; greedy agreement with float32 {agreements}"


# -- driving engines ----------------------------------------------------------------------------
def greedy_tokens(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """Each prompt's `max_tokens` greedy tokens (end of sequence ignored), all in one batch
    through `engine.step`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"check-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, list(prompt), params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"check request {out.request_id} failed: {out.error}")
            tokens[out.request_id] += out.outputs[0].new_token_ids
    return [tokens[rid] for rid in ids]


def decode_step_seconds(
    engines: dict[str, LLMEngine],
    prompts: Sequence[Sequence[int]],
    batch_size: int,
    *,
    warmup: int = WARMUP_STEPS,
    rounds: int = ROUNDS,
    steps_per_round: int = STEPS_PER_ROUND,
) -> dict[str, list[float]]:
    """Seconds of each timed decode step of `batch_size` rows (prompts cycled), per engine:
    every engine prefills and runs `warmup` steps, then `rounds` rounds in which each runs
    `steps_per_round` timed steps, the order rotating by one each round. The requests are
    aborted afterwards."""
    params = SamplingParams(
        max_tokens=warmup + rounds * steps_per_round + 2, temperature=0.0, ignore_eos=True
    )
    ids = [f"speed-{batch_size}-{i}" for i in range(batch_size)]
    for engine in engines.values():
        for i, rid in enumerate(ids):
            engine.add_request(rid, list(prompts[i % len(prompts)]), params)
        started: set[str] = set()
        while len(started) < batch_size:  # prefill, maybe in chunks
            started.update(out.request_id for out in engine.step() if out.outputs[0].new_token_ids)
        for _ in range(warmup):
            engine.step()
    names = list(engines)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(steps_per_round):
                t0 = time.perf_counter()
                engines[name].step()
                seconds[name].append(time.perf_counter() - t0)
    for engine in engines.values():
        for rid in ids:
            engine.abort(rid)
        engine.step()
    return seconds


def candidates(cpu_flags: set[str]) -> tuple[str, ...]:
    """float32 and bfloat16, and float16 where the CPU multiplies it natively."""
    return ("float32", "bfloat16") + (("float16",) if "avx512_fp16" in cpu_flags else ())


def measure(config: EngineConfig, loaded: Any, names: Sequence[str]) -> list[Measurement]:
    """Agreement and decode-step times of the dtypes `names` (float32 first) for `config`'s
    engine over `loaded` (float32 weights), as the module docstring describes."""
    prompt_ids = [loaded.tokenizer.encode(text) or [0] for text in CHECK_PROMPTS]
    rows = max(*BATCH_SIZES, len(prompt_ids))
    longest = max(map(len, prompt_ids)) + max(
        CHECK_TOKENS, WARMUP_STEPS + ROUNDS * STEPS_PER_ROUND + 2
    )
    num_blocks = rows * (-(-longest // config.block_size) + 1) + 1
    probe = dataclasses.replace(
        config,
        num_blocks=num_blocks,
        max_num_seqs=rows,
        enable_prefix_caching=False,
        speculative_config=None,
    )
    engines = {
        name: LLMEngine(dataclasses.replace(probe, dtype=name), loaded=loaded) for name in names
    }
    reference = greedy_tokens(engines["float32"], prompt_ids, CHECK_TOKENS)
    agreements = {
        name: 1.0
        if name == "float32"
        else agreement(greedy_tokens(e, prompt_ids, CHECK_TOKENS), reference)
        for name, e in engines.items()
    }
    step_ms: dict[str, dict[int, float]] = {name: {} for name in names}
    for b in BATCH_SIZES:
        for name, seconds in decode_step_seconds(engines, prompt_ids, b).items():
            step_ms[name][b] = 1000 * statistics.median(seconds)
    return [Measurement(name, agreements[name], step_ms[name]) for name in names]


# -- the cached decision ------------------------------------------------------------------------
def auto_dtype_mode() -> str:
    """`BENCH_REF_AUTO_DTYPE` ("measure" when unset). Raises EngineConfigError otherwise."""
    mode = os.environ.get(ENV_VAR, "").strip() or "measure"
    if mode not in MODES:
        raise EngineConfigError(f"{ENV_VAR}={mode!r} is not a mode; use measure or static.")
    return mode


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """This CPU's model name and flags from /proc/cpuinfo (the platform's processor name and
    no flags where there is none)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return name, flags
    fields = dict(line.split(":", 1) for line in lines if ":" in line)  # the last CPU's
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", name), set(fields.get("flags", "").split())


def weights_identity(model: str, loaded: Any = None) -> str:
    """What identifies the weights: the GGUF file's SHA-256 (and the dtype `loaded` holds),
    the in-process model's name and the library that makes its tokenizer, else a digest of
    the tensors."""
    if loaded is not None:
        source = getattr(loaded, "source", None) or {}
        if source.get("sha256"):
            return f"gguf:{source['sha256']}:{source.get('dtype')}"
        return "tensors:" + state_dict_digest(loaded.state_dict)
    resolved = resolve_model(model)
    if resolved.format == "gguf":
        return "gguf:" + sha256_of(resolved.path) + ":float32"
    if resolved.format == "random":
        import tokenizers

        return f"random:{resolved.name}:tokenizers-{tokenizers.__version__}"
    files = sorted(p for p in resolved.path.iterdir() if p.is_file())
    return (
        "hf:" + hashlib.sha256("".join(p.name + sha256_of(p) for p in files).encode()).hexdigest()
    )


def state_dict_digest(state_dict: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def kernel_sources_digest() -> str:
    digest = hashlib.sha256()
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def decision_key(config: EngineConfig, weights: str, names: Sequence[str]) -> dict[str, Any]:
    """Everything the measured choice depends on (JSON-ready)."""
    cpu, flags = cpu_model_and_flags()
    return {
        "weights": weights,
        "quantization": config.quantization,
        "cpu": cpu,
        "cpu_flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
        "kernels": kernels.describe(),
        "kernel_sources": kernel_sources_digest(),
        "torch": torch.__version__,
        "threads": config.threads(),
        "candidates": list(names),
        "procedure": {
            "prompts": list(CHECK_PROMPTS),
            "tokens": CHECK_TOKENS,
            "batch_sizes": list(BATCH_SIZES),
            "timing": [WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND],
            "tie_margin": TIE_MARGIN,
        },
    }


def decision_path(key: dict[str, Any]) -> Path:
    """The cache file of the decision for `key`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_area(CacheArea.DTYPE) / f"{digest[:24]}.json"


def read_decision(key: dict[str, Any]) -> DtypeChoice | None:
    """The cached choice for `key`, None when absent or unreadable."""
    try:
        stored = json.loads(decision_path(key).read_text())
        if stored["key"] != json.loads(json.dumps(key)):
            return None
        when = stored["measured_at"][:10]
        return DtypeChoice(
            stored["dtype"], f"{stored['reason']} (cached from {when})", DtypeSource.CACHED
        )
    except (OSError, ValueError, KeyError, TypeError, EngineConfigError):
        return None


def write_decision(
    key: dict[str, Any], choice: DtypeChoice, measurements: list[Measurement], seconds: float
) -> None:
    path = decision_path(key)
    record = {
        "key": key,
        "dtype": choice.dtype,
        "reason": choice.reason,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "measure_s": round(seconds, 2),
        "measurements": [dataclasses.asdict(m) for m in measurements],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError:
        log.info("could not cache the dtype choice in %s; the next start measures again", path)


def machine_load() -> str | None:
    """'load average L on N CPUs' when other work would compete with a measurement (a 1-minute
    load average of `BUSY_LOAD_PER_CPU` times the CPUs or more), else None."""
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return f"load average {load:.1f} on {cpus} CPUs" if load >= BUSY_LOAD_PER_CPU * cpus else None


MeasureFn = Callable[[EngineConfig, Any, Sequence[str]], list[Measurement]]


def resolve_auto_dtype(
    config: EngineConfig, loaded: Any = None, *, measure_fn: MeasureFn = measure
) -> tuple[EngineConfig, Any]:
    """(`config` with its `auto` dtype resolved, the model loaded to measure it or `loaded`).
    Configs with a named dtype come back unchanged. On a CPU with `BENCH_REF_AUTO_DTYPE` not
    "static" and the kernels ready, the cached choice is used or, on a miss, `measure_fn` runs
    on float32 weights (`loaded`, else loaded here, and returned so the caller need not load
    again) and its choice is cached. A failed measurement keeps the static rule, logged.
    Raises EngineConfigError for a bad `BENCH_REF_AUTO_DTYPE`."""
    if config.dtype != "auto":
        return config, loaded
    static = config.dtype_choice
    if auto_dtype_mode() == "static":
        return config.with_dtype_choice(
            dataclasses.replace(static, reason=f"{ENV_VAR}=static: {static.reason}")
        ), loaded
    if config.torch_device().type != "cpu":
        return config.with_dtype_choice(static), loaded
    ready = kernels.available(build=config.quantization is not None)
    if not ready and kernels.describe().startswith("building"):
        why = f"{static.reason}; measured once the kernels building in the background are built"
        return config.with_dtype_choice(dataclasses.replace(static, reason=why)), loaded
    names = candidates(cpu_model_and_flags()[1])
    key = decision_key(config, weights_identity(config.model, loaded), names)
    cached = read_decision(key)
    if cached is not None:
        return config.with_dtype_choice(cached), loaded
    busy = machine_load()
    if busy is not None:
        why = f"{static.reason}; not measured on a busy machine ({busy}), a later start measures"
        return config.with_dtype_choice(dataclasses.replace(static, reason=why)), loaded
    t0 = time.perf_counter()
    if loaded is None:
        loaded = load_model(
            config.model, dtype=torch.float32, keep_int4=config.quantization in INT4_MODES
        )
    try:
        measurements = measure_fn(config, loaded, names)
        dtype, reason = choose(measurements)
    except Exception as exc:  # the engine must still start
        log.warning("measuring dtype=auto failed (%s); keeping the static rule", exc, exc_info=True)
        why = f"{static.reason}; measuring failed: {exc}"
        return config.with_dtype_choice(dataclasses.replace(static, reason=why)), loaded
    seconds = time.perf_counter() - t0
    busy = machine_load()
    reason += f" ({seconds:.1f} s to measure{f', on a busy machine: {busy}' if busy else ''})"
    choice = DtypeChoice(dtype, reason, DtypeSource.MEASURED)
    write_decision(key, choice, measurements, seconds)
    log.info("dtype=auto: %s", choice.reason)
    return config.with_dtype_choice(choice), loaded
