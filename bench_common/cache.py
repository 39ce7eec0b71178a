"""The one cache root: `$BENCH_CACHE_DIR` if set, else the user cache directory of llm-bench.

Every artefact the project keeps between runs lives in one named area under it:

    models/     model files fetched and checked by hash (engine_ref.loading.model_files)
    exports/    float32 exports of a model for engines that cannot read GGUF
    workloads/  built workload tables (workloads.registry)
    oracle/     the reference engine's answers to a workload's prompts (harness oracle)
    kernels/    the compiled C++ kernels, one folder per source and torch version
    native/     the compiled SSE scanner, one file per source
    dtype/      the reference engine's measured `dtype=auto` choices (engine_ref.loading.auto_dtype)
    history/    the run history database (reports.history; `bench history`)

Deleting the root, or an area of it, costs a rebuild or a fetch, never a result, except
history/: the only area that holds results (point `bench history --history` elsewhere to keep
it apart).
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

import platformdirs

ENV_VAR = "BENCH_CACHE_DIR"
APP_NAME = "llm-bench"


class CacheArea(StrEnum):
    MODELS = "models"
    EXPORTS = "exports"
    WORKLOADS = "workloads"
    ORACLE = "oracle"
    KERNELS = "kernels"
    NATIVE = "native"
    DTYPE = "dtype"
    HISTORY = "history"


def cache_root() -> Path:
    """`$BENCH_CACHE_DIR` if set and not empty, else `platformdirs.user_cache_dir("llm-bench")`;
    read at each call, so a test or a user can move it for one run."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path(platformdirs.user_cache_dir(APP_NAME))


def cache_area(area: CacheArea) -> Path:
    """The folder of `area` under the cache root (not created here)."""
    return cache_root() / area.value
