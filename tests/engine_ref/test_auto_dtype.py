"""`dtype="auto"` chosen by measurement (engine_ref/loading/auto_dtype.py): the choice on
hand-worked measurements, the agreement measure, the cached decision (hit, miss, what changes
its key), the modes that skip measuring, and one real measurement on tiny-random through
`build_engine`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine_ref import EngineConfig, build_engine
from engine_ref.core import kernels
from engine_ref.core.engine_config import DtypeChoice, DtypeSource, EngineConfigError
from engine_ref.loading import auto_dtype
from engine_ref.loading.auto_dtype import Measurement, agreement, choose
from engine_ref.loading.tiny_random import (
    build_tiny_tokenizer,
    tiny_random_config,
    tiny_random_state_dict,
)


def m(dtype: str, agree: float, b1: float, b16: float) -> Measurement:
    return Measurement(dtype, agree, {1: b1, 16: b16})


@pytest.mark.parametrize(
    ("measurements", "chosen", "why"),
    [
        # bf16 faster at both sizes, equal agreement: the fastest wins.
        ([m("float32", 1.0, 30, 60), m("bfloat16", 1.0, 18, 40)], "bfloat16", "the fastest"),
        # float32 faster by the geometric mean (31.6 against 42.4 ms): float32.
        ([m("float32", 1.0, 20, 50), m("bfloat16", 0.9, 40, 45)], "float32", "the fastest"),
        # float16 fastest but agrees less than bf16 (0.5 < 0.75): it does not qualify.
        (
            [m("float32", 1.0, 30, 60), m("bfloat16", 0.75, 18, 40), m("float16", 0.5, 10, 20)],
            "bfloat16",
            "float16 faster but agreeing less than bfloat16",
        ),
        # float16 fastest and agreeing as well as bf16: it wins.
        (
            [m("float32", 1.0, 30, 60), m("bfloat16", 0.75, 18, 40), m("float16", 0.75, 10, 20)],
            "float16",
            "the fastest",
        ),
        # Exactly equal speed and agreement: the first (float32).
        ([m("float32", 1.0, 20, 40), m("bfloat16", 1.0, 20, 40)], "float32", "the fastest"),
        # bf16 3.3% faster by the geometric mean (38.73 against 40 ms): within the 5% margin,
        # the better agreement (float32's) wins.
        ([m("float32", 1.0, 20, 80), m("bfloat16", 0.9, 30, 50)], "float32", "within 5%"),
        # bf16 8.9% faster (36.74 against 40 ms): beyond the margin, bf16.
        ([m("float32", 1.0, 20, 80), m("bfloat16", 0.9, 30, 45)], "bfloat16", "the fastest"),
    ],
)
def test_choose(measurements, chosen, why):
    dtype, reason = choose(measurements)
    assert dtype == chosen
    assert reason.startswith(f"{chosen}, ") and why in reason
    assert "per decode step at batch 1" in reason and "greedy agreement with float32" in reason


def test_reason_carries_the_figures():
    _, reason = choose([m("float32", 1.0, 29.4, 60.0), m("bfloat16", 0.92, 17.9, 40.0)])
    assert "29.4 ms float32, 17.9 ms bfloat16 per decode step at batch 1" in reason
    assert "60.0 ms float32, 40.0 ms bfloat16 per decode step at batch 16" in reason
    assert "100% float32, 92% bfloat16" in reason


@pytest.mark.parametrize(
    ("tokens", "reference", "expected"),
    [
        ([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], 1.0),
        ([[1, 2, 9], [4, 5]], [[1, 2, 3], [4, 5]], 4 / 5),
        ([[1, 9, 3]], [[1, 2, 3]], 1 / 3),  # a match after the first difference does not count
        ([[7, 2, 3]], [[1, 2, 3]], 0.0),
        ([[1, 2]], [[1, 2, 3]], 2 / 3),
    ],
)
def test_agreement(tokens, reference, expected):
    assert agreement(tokens, reference) == pytest.approx(expected)


# -- resolution and the cache ---------------------------------------------------------------------
@pytest.fixture
def dtype_cache(tmp_path, monkeypatch):
    """Kernels loaded (built in the shared cache if needed), then an empty cache root of this
    test's own, measuring switched on whatever the environment says, and the machine seen as
    idle (a busy one is not measured)."""
    kernels.available()
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(auto_dtype.ENV_VAR, "measure")
    monkeypatch.setattr(auto_dtype.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    return tmp_path / "cache" / "dtype"


class FakeMeasure:
    """Counts calls and returns fixed measurements (bf16 faster)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, config, loaded, names):
        self.calls += 1
        return [m("float32", 1.0, 30, 60), m("bfloat16", 1.0, 18, 40)]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    config = tiny_random_config(tokenizer.vocab_size)
    return SimpleNamespace(
        config=config, state_dict=tiny_random_state_dict(config), tokenizer=tokenizer, source={}
    )


CPU = dict(model="tiny-random", device="cpu", num_threads=1)


def test_miss_measures_then_hit_reuses(dtype_cache, tiny):
    fake = FakeMeasure()
    config, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    assert fake.calls == 1 and config.dtype == "auto"
    assert config.torch_dtype() == torch.bfloat16
    assert config.dtype_choice.source is DtypeSource.MEASURED
    assert config.dtype_choice.reason.startswith(
        "bfloat16, the fastest: 30.0 ms float32, 18.0 ms bfloat16"
    )
    [path] = list(dtype_cache.iterdir())
    stored = json.loads(path.read_text())
    assert stored["dtype"] == "bfloat16" and stored["key"]["threads"] == 1
    again, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    assert fake.calls == 1 and again.torch_dtype() == torch.bfloat16
    assert (
        again.dtype_choice.source is DtypeSource.CACHED
        and "cached from" in again.dtype_choice.reason
    )


def perturbed(tiny):
    sd = dict(tiny.state_dict)
    sd["model.norm.weight"] = sd["model.norm.weight"] + 1e-3
    return SimpleNamespace(**{**vars(tiny), "state_dict": sd})


@pytest.mark.parametrize(
    "change",
    [
        lambda tiny, mp: (EngineConfig(**{**CPU, "num_threads": 2}), tiny),
        lambda tiny, mp: (EngineConfig(**CPU), perturbed(tiny)),
        lambda tiny, mp: (EngineConfig(**CPU, quantization="w8a16"), tiny),
        lambda tiny, mp: (
            mp.setattr(kernels, "describe", lambda: "avx2"),
            (EngineConfig(**CPU), tiny),
        )[1],
        lambda tiny, mp: (
            mp.setattr(torch, "__version__", "0.0-other"),
            (EngineConfig(**CPU), tiny),
        )[1],
    ],
    ids=["threads", "weights", "quantization", "kernels", "torch"],
)
def test_key_changes_measure_again(dtype_cache, tiny, monkeypatch, change):
    fake = FakeMeasure()
    auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    config, loaded = change(tiny, monkeypatch)
    resolved, _ = auto_dtype.resolve_auto_dtype(config, loaded, measure_fn=fake)
    assert fake.calls == 2 and resolved.dtype_choice.source is DtypeSource.MEASURED
    assert len(list(dtype_cache.iterdir())) == 2


def test_damaged_cache_file_measures_again(dtype_cache, tiny):
    fake = FakeMeasure()
    auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    [path] = list(dtype_cache.iterdir())
    path.write_text("{not json")
    config, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    assert fake.calls == 2 and config.dtype_choice.source is DtypeSource.MEASURED


def test_static_mode_and_explicit_dtype_do_not_measure(dtype_cache, tiny, monkeypatch):
    fake = FakeMeasure()
    explicit, _ = auto_dtype.resolve_auto_dtype(
        EngineConfig(**CPU, dtype="float32"), tiny, measure_fn=fake
    )
    assert explicit.dtype_choice == DtypeChoice(
        "float32", "dtype=float32 was set explicitly", DtypeSource.EXPLICIT
    )
    monkeypatch.setenv(auto_dtype.ENV_VAR, "static")
    static, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    assert fake.calls == 0 and not dtype_cache.exists()
    assert static.torch_dtype() == EngineConfig(**CPU).torch_dtype()  # today's rule
    assert static.dtype_choice.source is DtypeSource.STATIC
    assert static.dtype_choice.reason.startswith("BENCH_REF_AUTO_DTYPE=static: ")


def test_bad_mode_is_one_sentence(dtype_cache, tiny, monkeypatch):
    monkeypatch.setenv(auto_dtype.ENV_VAR, "fastest")
    with pytest.raises(
        EngineConfigError,
        match=r"^BENCH_REF_AUTO_DTYPE='fastest' is not a mode; use measure or static\.$",
    ):
        auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=FakeMeasure())


def test_kernels_still_building_keep_the_static_rule(dtype_cache, tiny, monkeypatch):
    """A float32 engine would run torch's kernels while its own build: no measurement then."""
    monkeypatch.setattr(kernels, "available", lambda build=True: False)
    monkeypatch.setattr(kernels, "describe", lambda: "building: torch's kernels run")
    fake = FakeMeasure()
    config, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    assert fake.calls == 0 and config.dtype_choice.source is DtypeSource.STATIC
    assert "kernels building in the background" in config.dtype_choice.reason


def test_failed_measurement_keeps_the_static_rule_uncached(dtype_cache, tiny):
    def broken(config, loaded, names):
        raise RuntimeError("no bf16 here")

    config, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=broken)
    assert config.dtype_choice.source is DtypeSource.STATIC
    assert "measuring failed: no bf16 here" in config.dtype_choice.reason
    assert not dtype_cache.exists()


# -- real measurements ------------------------------------------------------------------------------
def test_build_engine_measures_tiny_random_then_reuses(dtype_cache):
    engine = build_engine(EngineConfig(**CPU))
    choice = engine.config.dtype_choice
    assert choice.source is DtypeSource.MEASURED and engine.config.dtype == "auto"
    assert engine.dtype == engine.config.torch_dtype() == getattr(torch, choice.dtype)
    [path] = list(dtype_cache.iterdir())
    stored = json.loads(path.read_text())
    by_dtype = {x["dtype"]: x for x in stored["measurements"]}
    assert set(by_dtype) >= {"float32", "bfloat16"} and by_dtype["float32"]["agreement"] == 1.0
    assert all(ms > 0 for x in by_dtype.values() for ms in x["step_ms"].values())
    assert stored["key"]["weights"].startswith("random:tiny-random:")
    assert stored["dtype"] == choice.dtype
    again = build_engine(EngineConfig(**CPU))
    assert again.config.dtype_choice.source is DtypeSource.CACHED
    assert again.dtype == engine.dtype


def test_measured_agreement_sees_bf16_rounding():
    """Negative control for the agreement measure on real engines: on a tiny model whose
    greedy continuations change token often (embedding x0.1, o/down x3), bf16 flips tokens."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_random_config(tokenizer.vocab_size)
    sd = tiny_random_state_dict(config)
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 0.1
    sd = {k: v * 3 if "o_proj" in k or "down_proj" in k else v for k, v in sd.items()}
    varied = SimpleNamespace(config=config, state_dict=sd, tokenizer=tokenizer)
    measured = auto_dtype.measure(EngineConfig(**CPU), varied, ("float32", "bfloat16"))
    agreements = {x.dtype: x.agreement for x in measured}
    assert agreements["float32"] == 1.0 and agreements["bfloat16"] < 1.0


@pytest.mark.parametrize(("load", "busy"), [(5.9, True), (3.0, True), (2.9, False), (0.5, False)])
def test_a_busy_machine_is_not_measured(dtype_cache, tiny, monkeypatch, load, busy):
    """On 2 CPUs, a 1-minute load average of 3 (1.5 x the CPUs) or more: the static rule,
    nothing cached, measured at a later start."""
    monkeypatch.setattr(auto_dtype.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(auto_dtype.os, "getloadavg", lambda: (load, 0.0, 0.0))
    fake = FakeMeasure()
    config, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=fake)
    assert fake.calls == (0 if busy else 1) and dtype_cache.exists() is not busy
    note = f"not measured on a busy machine (load average {load:.1f} on 2 CPUs)"
    assert (note in config.dtype_choice.reason) is busy
    assert config.dtype_choice.source is (DtypeSource.STATIC if busy else DtypeSource.MEASURED)


def test_a_machine_busy_during_the_measurement_is_named(dtype_cache, tiny, monkeypatch):
    loads = iter([(0.5, 0.0, 0.0), (4.0, 0.0, 0.0)])  # before, then after measuring
    monkeypatch.setattr(auto_dtype.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(auto_dtype.os, "getloadavg", lambda: next(loads))
    config, _ = auto_dtype.resolve_auto_dtype(EngineConfig(**CPU), tiny, measure_fn=FakeMeasure())
    assert config.dtype_choice.source is DtypeSource.MEASURED
    assert "on a busy machine: load average 4.0 on 2 CPUs)" in config.dtype_choice.reason
