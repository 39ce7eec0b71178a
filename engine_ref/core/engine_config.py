"""Engine and per-request sampling configuration (frozen, validated dataclasses)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

import torch

from engine_ref.core import beam_search
from engine_ref.core.cpu import available_cpus, cpu_has_fast_bf16
from engine_ref.core.grammar import GuidedDecoding
from engine_ref.core.kv_dtype import kv_cache_dtype_problem
from engine_ref.core.kv_eviction import check_kv_eviction
from engine_ref.core.policy import check_policy, tenant_weights
from engine_ref.core.quant import QUANTIZATION_MODES


class EngineConfigError(ValueError):
    """An engine or sampling option has an invalid value; the message names the fix."""


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


SPECULATIVE_METHODS = ("ngram", "self_draft", "draft_model")


class DtypeSource(StrEnum):
    """Who decided an engine's dtype."""

    EXPLICIT = "explicit"  # the config names it
    STATIC = "static"  # `auto`, by the hardware rule of `EngineConfig.torch_dtype`
    MEASURED = "measured"  # `auto`, measured at this start (engine_ref.loading.auto_dtype)
    CACHED = "cached"  # `auto`, an earlier start's measurement reused


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype an engine runs in ("float32", "bfloat16" or "float16"), why (one sentence,
    for `/info` and manifests), and who decided it."""

    dtype: str
    reason: str
    source: DtypeSource

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(
                f"A dtype choice must be float32, bfloat16 or float16, got {self.dtype!r}."
            )
        object.__setattr__(self, "source", DtypeSource(self.source))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, named as in vLLM's `--speculative-config` JSON.

    `method` "ngram" drafts by prompt lookup: the longest suffix of the sequence, between
    `prompt_lookup_min` and `prompt_lookup_max` tokens, found earlier in it proposes the up to
    `num_speculative_tokens` tokens that followed it. `method` "self_draft" (an engine_ref
    extension) drafts with the target's own first `num_draft_layers` layers, its final norm
    and head, greedily, one token at a time; its KV for those layers is the target's, so it
    needs no memory of its own. `method` "draft_model" drafts greedily with the smaller
    model named by `model` (vLLM's key), which must share the target's tokenizer; it keeps
    its own KV pools (as many blocks as the target's, beyond `kv_cache_memory_bytes`) under
    the same block tables, and runs on every step's rows so its KV stays in step. The
    target verifies a draft in one forward; outputs are distributed exactly as without
    speculation (see spec_decode/).
    Off-switches: no sequence drafts in a step that starts with more than
    `disable_by_batch_size` running sequences (vLLM's name and rule; None: never), and a sequence
    whose recent acceptance rate (accepted / drafted tokens, a moving average over its verify
    steps) falls below `disable_below_acceptance_rate` pauses drafting for
    `pause_steps` steps (engine_ref extensions). `num_tree_branches` > 1 (n-gram only, an
    engine_ref extension) drafts a token tree of that many continuations within the same
    `num_speculative_tokens` budget, verified in one forward under a tree attention mask.
    A drafted token costs about
    `disable_below_acceptance_rate` of a decode step here, so a lower rate loses time.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = 8
    disable_below_acceptance_rate: float = 0.1
    pause_steps: int = 16
    num_draft_layers: int | None = None
    model: str | None = None
    num_tree_branches: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise EngineConfigError(
                f"Unknown speculative method {self.method!r}; use one of "
                f"{', '.join(SPECULATIVE_METHODS)}."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            object.__setattr__(self, name, _integer(name, getattr(self, name), low=1))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise EngineConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )
        if self.disable_by_batch_size is not None:
            value = _integer("disable_by_batch_size", self.disable_by_batch_size, low=1)
            object.__setattr__(self, "disable_by_batch_size", value)
        rate = _number("disable_below_acceptance_rate", self.disable_below_acceptance_rate)
        if not 0.0 <= rate <= 1.0:
            raise EngineConfigError(f"disable_below_acceptance_rate must be in [0, 1], got {rate}.")
        object.__setattr__(self, "disable_below_acceptance_rate", rate)
        object.__setattr__(self, "pause_steps", _integer("pause_steps", self.pause_steps, low=0))
        if self.method == "self_draft":
            if self.num_draft_layers is None:
                raise EngineConfigError("method self_draft needs num_draft_layers (1 or more).")
            layers = _integer("num_draft_layers", self.num_draft_layers, low=1)
            object.__setattr__(self, "num_draft_layers", layers)
        elif self.num_draft_layers is not None:
            raise EngineConfigError("num_draft_layers applies to method self_draft only.")
        branches = _integer("num_tree_branches", self.num_tree_branches, low=1)
        object.__setattr__(self, "num_tree_branches", branches)
        if branches > 1 and self.method != "ngram":
            raise EngineConfigError("num_tree_branches above 1 applies to method ngram only.")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise EngineConfigError("method draft_model needs model (the draft model's name).")
        elif self.model is not None:
            raise EngineConfigError("model applies to method draft_model only.")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config` JSON (an object of this class's fields)."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineConfigError(f"--speculative-config is not valid JSON: {exc.msg}.") from None
        if not isinstance(fields, dict):
            raise EngineConfigError("--speculative-config must be a JSON object.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise EngineConfigError(
                f"Unknown speculative-config key {unknown[0]!r}; known keys: "
                f"{', '.join(sorted(known))}."
            )
        return cls(**fields)


@dataclass(frozen=True)
class EngineConfig:
    """How the reference engine runs one model.

    `dtype` "auto" lets the engine choose: `engine_ref.build_engine` measures on a CPU which of
    float32 and bfloat16 decodes faster while agreeing with float32 at least as well as bfloat16
    does (`engine_ref.loading.auto_dtype`, cached; `BENCH_REF_AUTO_DTYPE=static` skips it), and
    without a measurement (CUDA, or a config not built by `build_engine`) it means bfloat16 on
    CUDA and on CPUs with bf16 units, float32 on other CPUs (see `torch_dtype`). `dtype_choice`
    says what it resolved to and why. "float32" is also for exact tests.
    `device` "auto" picks CUDA when available. The KV pool holds `num_blocks` blocks of
    `block_size` tokens; when `num_blocks` is None it is derived from `kv_cache_memory_bytes`.
    `kv_cache_dtype` "auto" stores K/V in `dtype`; bf16, fp16, int8, fp8_e4m3: `core.kv_dtype`.
    `kv_eviction` "none" keeps all KV; sliding-window or sinks evict: `core.kv_eviction`.
    `max_waiting_requests` bounds the waiting queue: beyond it `add_request` raises
    `QueueFullError` or sheds a waiting request, by policy (`engine_ref.core.overload`). `max_model_len` None means the model's `max_position_embeddings`.
    `num_threads` None means the CPUs this process may run on (CPU only). `prefix_cache_salt` is mixed into
    every prefix-cache key, so caches of different model versions never match.
    `quantization` None runs the weights in `dtype`; "w4a16", "w4a8", "w8a8" or "w8a16" runs
    the projections as low-bit GEMMs (see `engine_ref.core.quant`; all but w4a16 on CPU only).
    `speculative_config` None serves without speculative decoding. `scheduling_policy`,
    `tenant_weights` (a JSON object, tenant to weight), `priority_aging_steps` (steps a
    request waits per priority level it gains; 0: no aging) and `affinity_max_bypass` (later
    arrivals that may overtake a waiting request): `engine_ref.core.policy`.
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    kv_eviction: str = "none"
    kv_window_tokens: int = 1024
    kv_sink_tokens: int = 4
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 4096
    scheduling_policy: str = "fcfs"
    tenant_weights: str | None = None
    priority_aging_steps: int = 32
    affinity_max_bypass: int = 8
    max_model_len: int | None = None
    num_threads: int | None = None
    seed: int = 0
    prefix_cache_salt: str = "engine_ref-v1"
    quantization: str | None = None
    speculative_config: SpeculativeConfig | None = None
    # What `auto` resolved to, set by `with_dtype_choice`; not a field (no CLI option, not in
    # equality), so `dataclasses.replace` drops it and the copy is resolved again.
    _dtype_choice: ClassVar[DtypeChoice | None] = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise EngineConfigError(
                f"Unknown quantization {self.quantization!r}; use one of "
                f"{', '.join(QUANTIZATION_MODES)}, or leave it unset for {self.dtype} weights."
            )
        spec = self.speculative_config
        if isinstance(spec, str):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_json(spec))
        elif isinstance(spec, dict):
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.from_json(json.dumps(spec))
            )
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise EngineConfigError(
                f"speculative_config must be a SpeculativeConfig or JSON object, got {spec!r}."
            )
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise EngineConfigError(
                f"Unknown dtype {self.dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}."
            )
        if problem := kv_cache_dtype_problem(self.kv_cache_dtype) or check_kv_eviction(self):
            raise EngineConfigError(problem)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise EngineConfigError(f"Unknown device {self.device!r}; use auto, cpu or cuda.")
        weights = tenant_weights(self.tenant_weights)
        for name in ("priority_aging_steps", "affinity_max_bypass"):
            object.__setattr__(self, name, _integer(name, getattr(self, name), low=0))
        if problem := check_policy(self.scheduling_policy, weights):
            raise EngineConfigError(problem)
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
        }
        for name, value in positive.items():
            if value < 1:
                raise EngineConfigError(f"{name} must be at least 1, got {value}.")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise EngineConfigError(f"num_blocks must be at least 2, got {self.num_blocks}.")
        if self.max_waiting_requests < 0:
            raise EngineConfigError("max_waiting_requests must be non-negative.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise EngineConfigError("max_model_len must be at least 1.")
        if self.num_threads is not None and self.num_threads < 1:
            raise EngineConfigError("num_threads must be at least 1.")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The dtype the engine runs in: the named one, or what `auto` resolved to
        (`dtype_choice`). An unresolved `auto` follows the static rule: bfloat16 on CUDA and on
        CPUs with bf16 units (AMX, AVX-512 BF16); float32 elsewhere, where bf16 matmuls are
        emulated (on an AVX2 EPYC, 9.6 against 57 GFLOP/s for float32 at the model's shapes,
        so a 2,048-token prefill took 51 s in bf16)."""
        if self.dtype == "auto":
            if self._dtype_choice is not None:
                return _DTYPES[self._dtype_choice.dtype]
            if self.torch_device().type == "cuda" or cpu_has_fast_bf16():
                return torch.bfloat16
            return torch.float32
        return _DTYPES[self.dtype]

    @property
    def dtype_choice(self) -> DtypeChoice:
        """What the engine runs in and why (for `/info`): the measured or cached choice set by
        `with_dtype_choice`, else the named dtype or the static rule."""
        if self._dtype_choice is not None:
            return self._dtype_choice
        name = str(self.torch_dtype()).removeprefix("torch.")
        if self.dtype != "auto":
            return DtypeChoice(name, f"dtype={self.dtype} was set explicitly", DtypeSource.EXPLICIT)
        if self.torch_device().type == "cuda":
            why = "bfloat16 on CUDA (not measured there)"
        elif name == "bfloat16":
            why = "bfloat16: this CPU has bf16 units (the static rule, not measured)"
        else:
            why = "float32: this CPU lacks bf16 units (the static rule, not measured)"
        return DtypeChoice(name, why, DtypeSource.STATIC)

    def with_dtype_choice(self, choice: DtypeChoice) -> EngineConfig:
        """This config with `dtype` "auto" resolved to `choice`: `dtype` stays "auto" (what was
        asked), `torch_dtype()` and `dtype_choice` follow `choice`. Raises EngineConfigError
        when `dtype` is not "auto"."""
        if self.dtype != "auto":
            raise EngineConfigError(
                f"Only dtype auto is resolved by a choice; this config has {self.dtype}."
            )
        resolved = dataclasses.replace(self)
        object.__setattr__(resolved, "_dtype_choice", choice)
        return resolved

    def threads(self) -> int:
        return self.num_threads or available_cpus()


# Temperatures below this sample greedily, as in vLLM: they are greedy in effect, and dividing
# logits by a tiny one overflows float32 (5e-324 is 0.0 there), so softmax would yield NaN.
GREEDY_TEMPERATURE_EPS = 1e-5
# Bounds on what one request may ask of every step: each output token scans every stop
# string over the held-back text, and checks the stop token ids (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
# Seeds are int64, as in vLLM's OpenAI server.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Every field is validated and normalised to a plain Python
    value at construction; what depends on the model (vocabulary, `n` against `max_num_seqs`)
    is checked by `LLMEngine.add_request`.

    `temperature` 0 means greedy (then top_k/top_p/seed are irrelevant); so does any
    temperature below `GREEDY_TEMPERATURE_EPS` (1e-5), which would overflow the scaled logits.
    It must be finite; a huge one samples (nearly) uniformly. `top_k` 0 or -1 means off, and a
    top_k at or beyond the vocabulary keeps every token; `top_p` 1.0 means off (the most likely
    token is always kept). `seed` is an int64. `stop` strings end the output (the stop string
    itself is not emitted): at most `MAX_STOP_STRINGS` of at most `MAX_STOP_STRING_CHARS`
    characters. `stop_token_ids` (at most `MAX_STOP_TOKEN_IDS`) end it (the token is counted,
    its text is not emitted). `ignore_eos` keeps going past end-of-sequence ids. `logprobs`
    None returns no logprobs; an int k (0 to `MAX_LOGPROBS`) returns the sampled token's
    logprob plus the top-k alternatives. `max_tokens` has no upper bound: generation also ends
    ("length") at the engine's max_model_len. `n` parallel samples share the prompt's KV blocks
    (copy-on-write on divergence). `speculative` False opts the request out of the engine's
    speculative decoding (True uses it when the engine has it; outputs are the same either
    way, only their speed differs). `guided` constrains the output to a grammar (see
    `engine_ref.core.grammar`): each step samples only tokens the grammar allows, and the
    output ends ("stop") when the grammar is complete and an end-of-sequence token is
    sampled; the grammar, not `min_tokens`, then decides where the output may end.

    `use_beam_search` replaces sampling by beam search of width `best_of` (default `n`) with
    `length_penalty` (`engine_ref.core.beam_search`); `best_of` above 1 needs it.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    speculative: bool = True
    guided: GuidedDecoding | None = None
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def set_(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        set_("n", _integer("n", self.n, low=1))
        set_("max_tokens", _integer("max_tokens", self.max_tokens, low=1))
        set_("temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise EngineConfigError(f"temperature must be non-negative, got {self.temperature}.")
        set_("top_p", _number("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise EngineConfigError(f"top_p must be in (0, 1], got {self.top_p}.")
        set_("top_k", _integer("top_k", self.top_k))
        if self.top_k < -1:
            raise EngineConfigError(f"top_k must be -1, 0 or positive, got {self.top_k}.")
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed, low=SEED_MIN, high=SEED_MAX))
        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if self.ignore_eos not in (True, False):
            raise EngineConfigError(f"ignore_eos must be true or false, got {self.ignore_eos!r}.")
        set_("ignore_eos", bool(self.ignore_eos))
        if self.logprobs is not None:
            set_("logprobs", _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS))
        set_("min_tokens", _integer("min_tokens", self.min_tokens, low=0))
        if self.speculative not in (True, False):
            raise EngineConfigError(f"speculative must be true or false, got {self.speculative!r}.")
        set_("speculative", bool(self.speculative))
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise EngineConfigError(f"guided must be a GuidedDecoding, got {self.guided!r}.")
        if self.min_tokens > self.max_tokens:
            raise EngineConfigError("min_tokens must be between 0 and max_tokens.")
        self._check_beam_search(set_)

    def _check_beam_search(self, set_) -> None:
        if self.use_beam_search not in (True, False):
            raise EngineConfigError(
                f"use_beam_search must be true or false, got {self.use_beam_search!r}."
            )
        set_("use_beam_search", bool(self.use_beam_search))
        set_("length_penalty", _number("length_penalty", self.length_penalty))
        if self.best_of is not None:
            set_("best_of", _integer("best_of", self.best_of, low=1))
        try:
            beam_search.check_params(self)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None
        if self.use_beam_search:
            set_("speculative", False)

    @property
    def beam_width(self) -> int:
        """Beams kept per step under beam search (`best_of`, else `n`); 0 without it."""
        return (self.best_of or self.n) if self.use_beam_search else 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _integer(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """`value` as a plain int (numpy integers too; not bools or floats) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EngineConfigError(f"{name} must be an integer, got {value!r}.")
    value = int(value)
    if low is not None and value < low:
        raise EngineConfigError(f"{name} must be at least {low}, got {value}.")
    if high is not None and value > high:
        raise EngineConfigError(f"{name} must be at most {high}, got {value}.")
    return value


def _number(name: str, value: object) -> float:
    """`value` as a finite plain float (ints and numpy numbers too; not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EngineConfigError(f"{name} must be a number, got {value!r}.")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float range
        raise EngineConfigError(f"{name} must be a finite number, got {value}.") from None
    if not math.isfinite(value):
        raise EngineConfigError(f"{name} must be a finite number, got {value}.")
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Iterable):
        raise EngineConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
    strings = tuple(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise EngineConfigError(
            f"stop has {len(strings)} strings; at most {MAX_STOP_STRINGS} are allowed."
        )
    for s in strings:
        if not isinstance(s, str):
            raise EngineConfigError(f"stop strings must be strings, got {s!r}.")
        if not s:
            raise EngineConfigError("stop strings must be non-empty.")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise EngineConfigError(
                f"a stop string has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} "
                "are allowed."
            )
    return strings


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise EngineConfigError(f"stop_token_ids must be a list of integers, got {ids!r}.")
    ids = tuple(ids)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise EngineConfigError(
            f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed."
        )
    return tuple(_integer("stop_token_ids", t, low=0) for t in ids)
