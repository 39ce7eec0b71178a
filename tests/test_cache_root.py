"""One cache root: with `BENCH_CACHE_DIR` set, every artefact the project keeps between runs (built
workloads, oracle answers, float32 exports, the compiled SSE scanner, model files) is found under
it, and nothing lands in the user cache directory. The compiled C++ kernels are built under it by
`tests/engine_ref/test_lowbit_kernels.py::test_a_float32_engine_builds_the_kernels_in_the_background`
(a 20 s build, not repeated here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_common.cache import CacheArea, cache_area, cache_root

pytestmark = pytest.mark.slow  # builds the scanner and runs the engine in a child

# Each artefact made through the public path a run takes, in a fresh interpreter (the scanner's
# library is loaded once per process).
SCRIPT = """
from engine_ref.loading import load_tokenizer
from engine_ref.loading.model_files import models_dir
from harness.http import sse_native
from harness.run.oracle import reference_texts
from harness.targets.engines import exported_dir
from slo.runrecord import Endpoint
from workloads import WorkloadOptions, resolve_workload

tokenizer = load_tokenizer("tiny-random")
options = WorkloadOptions(num_requests=2, input_len=8, output_len=3, seed=1)
workload = resolve_workload("random", options=options, tokenizer=tokenizer)
rows = [dict(row, temperature=0.0) for row in workload.table.to_pylist()]
sha = workload.manifest["sha256"]
assert reference_texts(rows, model="tiny-random", endpoint=Endpoint.COMPLETIONS,
                       workload_sha256=sha)
assert sse_native.library() is not None, "the SSE scanner did not build"
exported_dir("tiny-random")
print(models_dir())
"""


def test_every_artefact_lands_under_bench_cache_dir(tmp_path):
    root, user_cache = tmp_path / "root", tmp_path / "xdg"
    env = dict(os.environ, BENCH_CACHE_DIR=str(root), XDG_CACHE_HOME=str(user_cache),
               BENCH_REF_KERNELS="0")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()) == root / CacheArea.MODELS
    made = {path.relative_to(root).parts[0] for path in root.rglob("*") if path.is_file()}
    assert made == {CacheArea.WORKLOADS, CacheArea.ORACLE, CacheArea.EXPORTS, CacheArea.NATIVE}
    assert (root / CacheArea.EXPORTS / "tiny-random-float32" / "config.json").is_file()
    assert not user_cache.exists(), sorted(user_cache.rglob("*"))


def test_the_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert cache_area(CacheArea.KERNELS) == tmp_path / "kernels"
    monkeypatch.setenv("BENCH_CACHE_DIR", "")  # empty is unset
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "llm-bench"
