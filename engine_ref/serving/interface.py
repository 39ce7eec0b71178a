"""The engine as the serving layer sees it: the one module of `engine_ref.serving` that imports
the engine.

`EngineInterface` declares exactly what the server and its engine loop call on an engine:
`LLMEngine` satisfies it, and so does any test double (checked by
`tests/engine_ref/test_engine_interface.py`, signatures included; an implementation may add
parameters with defaults, which the server never passes). Engine errors and the types
that cross the boundary are re-exported from here so the rest of `serving/` names them once;
so is the prefix cache's block-hash function (`prefix_block_hash(parent_key, tokens)`), which
a cluster router hashes prompts with to send shared prefixes to the same worker, and the KV
handoff's prefill and decode sides (`core.kv_handoff`), which P/D workers drive.
`describe_engine` (engine_loop.py) also records `engine.device`, `config.torch_dtype()` and the
config's dataclass fields when an engine has them, and request parsing tokenizes with
`tokenizer.encode_batch` when the tokenizer has one (Hugging Face's releases the GIL, `encode`
does not); those are optional and not declared here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import engine_ref
from engine_ref import (
    CompletionOutput,
    EngineConfig,
    EngineConfigError,
    EngineError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from engine_ref.core.admission import MAX_DEADLINE_MS, MAX_TENANT_CHARS
from engine_ref.core.block_manager import default_hash as prefix_block_hash
from engine_ref.core.engine_config import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from engine_ref.core.grammar import GrammarError, GuidedDecoding, check_guided
from engine_ref.core.kernels import describe as kernel_level
from engine_ref.core.kernels import isa_env_problem
from engine_ref.core.kv_dtype import KV_CACHE_DTYPES
from engine_ref.core.kv_eviction import KV_EVICTION_MODES
from engine_ref.core.kv_handoff import (
    HandoffExporter,
    KVHandoff,
    KVHandoffError,
    NoFreeBlocks,
)
from engine_ref.core.kv_handoff import free as free_handoff
from engine_ref.core.kv_handoff import install as install_handoff
from engine_ref.core.kv_landing import Landing
from engine_ref.core.kv_landing import reserve as reserve_landing
from engine_ref.core.overload import SHED_REASONS, DeadlineInfeasibleError
from engine_ref.core.policy import SCHEDULING_POLICIES
from engine_ref.core.pooling import embed
from engine_ref.core.quant import QUANTIZATION_MODES

# The values an EngineConfig field takes, where it takes few: `bench serve --help` lists them.
ENGINE_CHOICES = {
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "kv_eviction": KV_EVICTION_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "quantization": QUANTIZATION_MODES,
}

__all__ = [
    "ENGINE_CHOICES",
    "CompletionOutput",
    "DeadlineInfeasibleError",
    "EngineConfig",
    "EngineConfigError",
    "EngineError",
    "EngineInterface",
    "GrammarError",
    "GuidedDecoding",
    "HandoffExporter",
    "KVHandoff",
    "KVHandoffError",
    "Landing",
    "MAX_DEADLINE_MS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TENANT_CHARS",
    "NoFreeBlocks",
    "QueueFullError",
    "RequestOutput",
    "SHED_REASONS",
    "SamplingParams",
    "ServedConfig",
    "ServedStats",
    "ServedTokenizer",
    "build_engine",
    "check_guided",
    "free_handoff",
    "install_handoff",
    "isa_env_problem",
    "kernel_level",
    "pooled_embeddings",
    "prefix_block_hash",
    "reserve_landing",
]


@runtime_checkable
class ServedTokenizer(Protocol):
    """What request parsing and logprob rendering use: chat templates, encoding prompts,
    decoding single tokens, and the vocabulary bound for prompts given as token ids."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Raises a ValueError (the tokenizer's ChatTemplateError) when it cannot render."""
        ...


@runtime_checkable
class ServedConfig(Protocol):
    """The engine config's one field the server needs: the model name it serves by default."""

    model: str


@runtime_checkable
class ServedStats(Protocol):
    """The fields of a `stats()` snapshot that /metrics, /v1/models and the engine loop read."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use, 0..1
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    max_model_len: int
    num_steps: int  # unchanged across a step: the step did nothing (the engine loop then waits)
    # Optional, read where present: `requests_shed_by_reason` (reason -> count, SHED_REASONS).


@runtime_checkable
class EngineInterface(Protocol):
    """An engine the server can front. Called from one thread only (the engine loop's)."""

    tokenizer: ServedTokenizer
    config: ServedConfig

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        deadline_ms: int | None = None,
    ) -> None:
        """Queue a request; raises `QueueFullError` when it is refused for overload (the
        queue is full, or `DeadlineInfeasibleError`: its deadline cannot be met), and
        `EngineError` / `EngineConfigError` (ValueErrors) for a request it cannot serve.
        Requests share prefix-cache blocks only when their `cache_salt`s are equal; `tenant`
        is whose share a fair scheduling policy charges; `deadline_ms` the time it has from
        now (past it, it ends with finish_reason "deadline")."""
        ...

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: the outputs of the requests that progressed."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; unknown or finished ids are ignored."""
        ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> ServedStats: ...


def pooled_embeddings(engine: EngineInterface, prompts: list[list[int]]) -> list:
    """One unit-length float32 vector per prompt (token ids), mean-pooled over its last
    hidden state (`engine_ref.core.pooling`). Optional for an engine: one without the
    reference engine's `model` raises `EngineError` (the server answers 501)."""
    model = getattr(engine, "model", None)
    if model is None:
        raise EngineError("this engine does not serve embeddings.")
    return embed(model, prompts)


def build_engine(config: EngineConfig) -> EngineInterface:
    """The reference engine for `config`, its model loaded (`engine_ref.build_engine`); raises
    `EngineError` when it cannot be built."""
    return engine_ref.build_engine(config)
