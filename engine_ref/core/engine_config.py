"""Engine and per-request sampling configuration (frozen, validated dataclasses)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


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


@dataclass(frozen=True)
class EngineConfig:
    """How the reference engine runs one model.

    `dtype` "auto" means bfloat16 (CPU with AMX and CUDA alike); "float32" is for exact tests.
    `device` "auto" picks CUDA when available. The KV pool holds `num_blocks` blocks of
    `block_size` tokens; when `num_blocks` is None it is derived from `kv_cache_memory_bytes`.
    `max_waiting_requests` bounds the waiting queue: `add_request` beyond it raises
    `QueueFullError`. `max_model_len` None means the model's `max_position_embeddings`.
    `num_threads` None means `os.cpu_count()` (CPU only). `prefix_cache_salt` is mixed into
    every prefix-cache key, so caches of different model versions never match.
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 4096
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None
    num_threads: int | None = None
    seed: int = 0
    prefix_cache_salt: str = "engine_ref-v1"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise EngineConfigError(
                f"Unknown dtype {self.dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}."
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise EngineConfigError(f"Unknown device {self.device!r}; use auto, cpu or cuda.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise EngineConfigError(
                f"Unknown scheduling_policy {self.scheduling_policy!r}; use fcfs or priority."
            )
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
        if self.dtype == "auto":
            return torch.bfloat16
        return _DTYPES[self.dtype]

    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    `temperature` 0 means greedy (then top_k/top_p/seed are irrelevant). `top_k` 0 or -1 means
    off; `top_p` 1.0 means off. `stop` strings end the output (the stop string itself is not
    emitted); `stop_token_ids` end it (the token is counted, its text is not emitted).
    `ignore_eos` keeps going past end-of-sequence ids. `logprobs` None returns no logprobs;
    an int k returns the sampled token's logprob plus the top-k alternatives. `n` parallel
    samples share the prompt's KV blocks (copy-on-write on divergence).
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise EngineConfigError(f"n must be at least 1, got {self.n}.")
        if self.max_tokens < 1:
            raise EngineConfigError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise EngineConfigError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineConfigError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise EngineConfigError(f"top_k must be -1, 0 or positive, got {self.top_k}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise EngineConfigError(f"logprobs must be between 0 and 20, got {self.logprobs}.")
        if any(not s for s in self.stop):
            raise EngineConfigError("stop strings must be non-empty.")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise EngineConfigError("min_tokens must be between 0 and max_tokens.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
