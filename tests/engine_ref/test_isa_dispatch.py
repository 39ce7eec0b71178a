"""The kernels' instruction-set dispatch (`engine_ref.core.kernels`): the level each CPU gets,
`BENCH_REF_ISA` forcing a lower one (and refusing a higher one or a typo in one sentence),
avx2 and the CPU's best level built and run through `LLMEngine.step` in their own processes with the
same float32 greedy tokens. (The level in summary.json and the card: tests/reports.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_ref.core import kernels

# /proc/cpuinfo flags of the machines this project has met (trimmed to what the ladder reads).
AVX2 = {"avx2", "fma", "f16c", "sse4_2"}
SKYLAKE_X = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN4 = SKYLAKE_X | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (set(), None),
        ({"avx2", "fma"}, None),  # F16C missing: below the lowest level
        (AVX2, "avx2"),
        (SKYLAKE_X - {"avx512dq"}, "avx2"),  # one AVX-512 flag short
        (SKYLAKE_X, "avx512"),
        (ZEN4 - {"avx512_vnni"}, "avx512"),
        (ZEN4, "avx512-bf16"),
        (SAPPHIRE_RAPIDS - {"amx_int8"}, "avx512-bf16"),
        (SAPPHIRE_RAPIDS, "amx"),
    ],
)
def test_each_cpu_gets_the_highest_level_it_offers(flags, expected):
    level = kernels.best_isa(flags)
    assert (level.name if level else None) == expected


def test_levels_are_a_ladder_each_adding_flags_and_compiler_options():
    for lower, higher in zip(kernels.ISA_LEVELS, kernels.ISA_LEVELS[1:], strict=False):
        assert lower.cpu_flags < higher.cpu_flags
        assert higher.cflags[: len(lower.cflags)] == lower.cflags
    assert kernels.ISA_NAMES == ("avx2", "avx512", "avx512-bf16", "amx")


@pytest.mark.parametrize(
    ("env", "flags", "level", "reason"),
    [
        (None, ZEN4, "avx512-bf16", None),
        ("avx2", ZEN4, "avx2", None),
        ("avx512", ZEN4, "avx512", None),
        ("avx512-bf16", ZEN4, "avx512-bf16", None),
        ("amx", ZEN4, None, "BENCH_REF_ISA=amx needs amx_bf16, amx_int8, amx_tile, which this CPU lacks"),
        ("avx512", AVX2, None, "BENCH_REF_ISA=avx512 needs avx512bw, avx512dq, avx512f, avx512vl, which this CPU lacks"),
        ("AVX2", ZEN4, None, "BENCH_REF_ISA='AVX2' is not an instruction-set level; use one of avx2, avx512, avx512-bf16, amx"),
        ("", ZEN4, "avx512-bf16", None),  # empty: unset
        (None, {"avx2"}, None, "this CPU lacks f16c, fma"),
    ],
)  # fmt: skip
def test_bench_ref_isa_is_a_ceiling_checked_against_the_cpu(monkeypatch, env, flags, level, reason):
    if env is None:
        monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.ISA_ENV, env)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: set(flags))
    chosen, why = kernels.select_isa()
    assert (chosen.name if chosen else None, why) == (level, reason)


# One process per level: a process loads one library. It prints the level that ran, the
# float32 and w4a16 greedy tokens of tiny-random (one and five rows: under the fused bound),
# and how many fused decoder-layer calls the profiler saw.
LEVEL_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from torch.profiler import ProfilerActivity, profile
from engine_ref import EngineConfig, build_engine
from engine_ref.core import kernels
from greedy_util import greedy_tokens
out = {"available": kernels.available(), "isa": kernels.active_isa(), "describe": kernels.describe()}
prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(5)]
for quantization in (None, "w4a16"):
    engine = build_engine(EngineConfig(model="tiny-random", dtype="float32", num_blocks=64,
                                       num_threads=2, quantization=quantization))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens = [greedy_tokens(engine, prompts[:1], 12), greedy_tokens(engine, prompts, 12)]
    names = [e.name for e in prof.events()]
    out[str(quantization)] = {"tokens": tokens, "fused": names.count("refkern::decode_layer")}
print(json.dumps(out))
"""


def _run_level(level: str | None, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != kernels.ISA_ENV}
    if level is not None:
        environ[kernels.ISA_ENV] = level
    environ.update(env)
    here = os.path.dirname(__file__)
    result = subprocess.run([sys.executable, "-c", LEVEL_RUN, here], env=environ,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _offered_levels() -> list[str]:
    best = kernels.best_isa()
    return [] if best is None else list(kernels.ISA_NAMES[: kernels.ISA_NAMES.index(best.name) + 1])


def test_the_lowest_and_the_best_level_run_the_engine_with_the_same_float32_tokens():
    """avx2 and this CPU's best level (each level's build of every kernel source costs CI
    about a minute on two cores, so the levels between are left to `BENCH_REF_ISA` runs of
    the benchmarks; test_int8_kernels builds avx2 too, the same library)."""
    if kernels.missing_prerequisite() is not None:
        pytest.skip(f"engine kernels off: {kernels.missing_prerequisite()}")
    offered = _offered_levels()
    levels = sorted({offered[0], offered[-1]}, key=kernels.ISA_NAMES.index)
    # The best level runs as the default (no BENCH_REF_ISA): that it is the CPU's best is
    # checked on the way, without a third engine process.
    runs = {level: _run_level(None if level == offered[-1] else level) for level in levels}
    for level, run in runs.items():
        assert run["available"] and run["isa"] == level and run["describe"] == level, run
        # The fused layer ran in every level (else the comparison would be torch against torch).
        assert run["None"]["fused"] > 0 and run["w4a16"]["fused"] > 0
    reference = runs[levels[0]]
    for level in levels[1:]:
        assert runs[level]["None"]["tokens"] == reference["None"]["tokens"], level
        assert runs[level]["w4a16"]["tokens"] == reference["w4a16"]["tokens"], level


def test_a_level_above_the_cpu_or_no_compiler_leaves_torchs_kernels_running():
    if kernels.missing_prerequisite() is not None:
        pytest.skip(f"engine kernels off: {kernels.missing_prerequisite()}")
    too_high = next((name for name in kernels.ISA_NAMES if name not in _offered_levels()), None)
    cases = [({"CXX": "/nonexistent/c++"}, "off: no C++ compiler on PATH", None)]
    if too_high is not None:
        cases.append(({}, f"off: {kernels.ISA_ENV}={too_high} needs", too_high))
    baseline = _run_level(_offered_levels()[0])
    for env, said, level in cases:
        run = _run_level(level, **env)
        assert not run["available"] and run["isa"] is None and run["describe"].startswith(said)
        assert run["None"]["fused"] == 0 and run["w4a16"]["fused"] == 0
        # torch's kernels give the same greedy tokens here (tiny-random, float32).
        assert run["None"]["tokens"] == baseline["None"]["tokens"]


def test_a_typo_in_bench_ref_isa_stops_the_server_with_one_sentence():
    env = dict(os.environ, BENCH_REF_ISA="avx-512")
    result = subprocess.run(
        [sys.executable, "-m", "engine_ref.serving", "--model", "tiny-random", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "BENCH_REF_ISA='avx-512' is not an instruction-set level; use one of avx2, avx512, "
        "avx512-bf16, amx." in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_a_built_library_is_loaded_as_it_is_without_asking_ninja(monkeypatch):
    """The cache directory's name hashes the sources, headers and flags, so a library found
    there is loaded directly. torch's `load` (ninja) would rebuild it whenever the checkout
    moved (its build file names the sources by absolute path): about 30 s in the middle of a
    server's start. Negative control: with `_load` going through `load` again, this fails."""
    if kernels.missing_prerequisite() is not None or not kernels.available():
        pytest.skip(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    import torch.utils.cpp_extension

    def no_build(*args, **kwargs):
        raise AssertionError("torch's load (a ninja build) was called for a built library")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setattr(kernels, "_state", {})  # as a fresh process finds it
    kernels._load()
    assert (
        kernels._state["reason"] is None and kernels._state["isa"] == kernels.select_isa()[0].name
    )


def test_a_compile_error_in_a_source_names_the_compilers_error_and_keeps_torchs_kernels(
    monkeypatch, tmp_path
):
    """Every source is built as one translation unit (`_unity_source`); a source that does not
    compile must leave the kernels off with the compiler's own first error as the reason (what
    `/info`, the manifest and the card print), not a traceback nor ninja's command line.
    Negative control: `test_a_built_library_is_loaded_as_it_is_without_asking_ninja` loads the
    real sources with reason None."""
    if kernels.missing_prerequisite() is not None:
        pytest.skip(f"the kernels cannot run here: {kernels.missing_prerequisite()}")
    broken = tmp_path / "broken.cpp"
    broken.write_text("int refkern_broken() { return undeclared_name; }\n")
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "SOURCES", (broken,))
    monkeypatch.setattr(kernels, "HEADERS", ())
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.available() is False
    reason = kernels.unavailable_reason()
    assert reason.startswith(f"the {kernels.select_isa()[0].name} kernel build failed: ")
    assert "broken.cpp" in reason and "error:" in reason and "undeclared_name" in reason
    assert "\n" not in reason and "ninja" not in reason
    assert kernels.describe() == f"off: {reason}"
