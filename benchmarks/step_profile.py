"""Where a batched decode step's time goes: N decode steps of R rows through `LLMEngine.step`.

Builds the model (`smollm2-135m`, the engine's default dtype unless `--dtype`), adds R requests
of P random prompt tokens (max_tokens O, ignore_eos), runs the prefill, then times decode steps
with every request running and profiles a few with torch.profiler. Printed, per step:

- wall ms without the profiler (median), and with it;
- weight GEMMs: the self time of the ops that multiply by a weight matrix (aten::mm, addmm,
  linear, the engine kernels' GEMMs) outside attention;
- attention: everything inside `paged_attention` (its ops and its Python);
- other ops: the self time of every other op (norms, RoPE, embedding, sampling, copies);
- Python/engine: the step's time outside any op (the step minus the three above);
- the step's phases (inclusive): schedule, attention metadata, model, logits, sample, commit,
  and inside the model the RMSNorms and RoPE (its tables and its application);
- the GEMM floor: the model's weight shapes (those of /work/shared/tools/gemm_floor.py) for
  R rows in the same dtype, timed in the same process.

`--compare` also times the decode-attention kernel against the torch path it replaces in the
same engine, alternating blocks of steps (medians and their ratio), and profiles both.

    python benchmarks/step_profile.py                    # 64 x 128 x 128, default dtype
    python benchmarks/step_profile.py --dtype float32
    python benchmarks/step_profile.py --compare          # kernel vs torch path, alternating
    python benchmarks/step_profile.py --json out.json    # the figures as data too
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams, build_engine  # noqa: E402
from engine_ref.core import attention, kernels, model, model_runner  # noqa: E402

# Profiler names of the ops that multiply activations by a weight matrix.
WEIGHT_GEMMS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::linear",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int8pack_mm",
        "refkern::q4_gemm",
        "refkern::q8_gemm",
        "refkern::f32_gemm",
    }
)
LABEL = "step_profile::"
STEP, ATTENTION = LABEL + "step", LABEL + "attention"
PHASES = ("schedule", "metadata", "model", "logits", "sample", "commit")
MODEL_PARTS = ("norm", "rope")  # inside the model, beside attention


@dataclass
class Split:
    """One profiled run's per-step milliseconds."""

    steps: int
    step_ms: float = 0.0
    gemm_ms: float = 0.0
    attention_ms: float = 0.0
    attention_ops_ms: float = 0.0
    other_ops_ms: float = 0.0
    phases_ms: dict[str, float] = field(default_factory=dict)
    other_ops_by_name_ms: dict[str, float] = field(default_factory=dict)
    attention_ops_by_name_ms: dict[str, float] = field(default_factory=dict)

    @property
    def python_ms(self) -> float:
        return self.step_ms - self.gemm_ms - self.attention_ms - self.other_ops_ms


def labelled(name: str, fn: Callable) -> Callable:
    """`fn` inside a profiler range named LABEL + name."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(LABEL + name):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def instrumented(engine: LLMEngine) -> Iterator[None]:
    """Profiler ranges around the step's phases and around every `paged_attention` call."""
    runner, processor = engine.model_runner, engine.output_processor
    targets = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "metadata", "metadata"),
        (runner.model, "forward", "model"),
        (runner.model, "compute_logits", "logits"),
        (processor, "sample", "sample"),
        (processor, "commit", "commit"),
    ]
    norms = [m for m in runner.model.modules() if isinstance(m, model.RMSNorm)]
    targets += [(norm, "forward", "norm") for norm in norms]
    targets.append((runner.model, "_rope_for", "rope"))
    for obj, attr, name in targets:
        setattr(obj, attr, labelled(name, getattr(obj, attr)))
    functions = {"paged_attention": "attention", "apply_rope": "rope"}
    originals = {name: getattr(model, name) for name in functions}
    for name, label in functions.items():
        setattr(model, name, labelled(label, originals[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(model, name, original)
        for obj, attr, _ in targets:
            delattr(obj, attr)  # the instance attribute shadowed the method


def split_of(prof, steps: int) -> Split:
    """Classify the profiled events of the main thread (see the module docstring)."""
    events = [e for e in prof.events() if e.name == STEP]
    main_thread = events[0].thread
    split = Split(steps)
    per_step = 1000.0 * steps  # us over all steps -> ms per step
    for event in prof.events():
        if event.thread != main_thread:
            continue
        name = event.name
        if name == STEP:
            split.step_ms += event.cpu_time_total / per_step
            continue
        if name.startswith(LABEL):
            phase = name[len(LABEL) :]
            if phase == "attention":
                split.attention_ms += event.cpu_time_total / per_step
            else:
                split.phases_ms[phase] = split.phases_ms.get(phase, 0.0) + (
                    event.cpu_time_total / per_step
                )
            continue
        self_ms = event.self_cpu_time_total / per_step
        parent = event.cpu_parent
        while parent is not None and parent.name != ATTENTION:
            parent = parent.cpu_parent
        if parent is not None:
            split.attention_ops_ms += self_ms
            by_name = split.attention_ops_by_name_ms
        elif name in WEIGHT_GEMMS:
            split.gemm_ms += self_ms
            continue
        else:
            split.other_ops_ms += self_ms
            by_name = split.other_ops_by_name_ms
        by_name[name] = by_name.get(name, 0.0) + self_ms
    return split


def decode_steps(engine: LLMEngine, steps: int, rows: int) -> list[tuple[float, float]]:
    """(wall, main thread's CPU) seconds of `steps` engine steps, each checked to be a decode
    step of `rows` rows. At one thread the CPU time is what a step costs however busy the
    machine is (wall time there includes waiting for a core)."""
    times = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.profiler.record_function(STEP):
            outputs = engine.step()
        times.append((time.perf_counter() - t0, time.thread_time() - c0))
        if len(outputs) != rows or any(len(o.outputs[0].new_token_ids) != 1 for o in outputs):
            raise SystemExit(f"a profiled step was not a {rows}-row decode step; lower --steps")
    return times


def profile_steps(engine: LLMEngine, steps: int, rows: int) -> Split:
    from torch.profiler import ProfilerActivity, profile

    with instrumented(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_steps(engine, steps, rows)
    return split_of(prof, steps)


def gemm_floor_ms(rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Median ms of SmolLM2-135M's weight GEMMs (30 layers' q, k, v, o, gate, up, down and the
    head, as in gemm_floor.py) for `rows` activation rows in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    hidden, inter, vocab, layers = 576, 1536, 49152, 30
    shapes = ((576, hidden), (192, hidden), (192, hidden), (576, 576), (inter, hidden),
              (inter, hidden), (hidden, inter))  # fmt: skip
    weights = [torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes]
    head = torch.randn(vocab, hidden, generator=gen).to(dtype)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)

    def step() -> None:
        for _ in range(layers):
            q = x @ weights[0].T
            x @ weights[1].T, x @ weights[2].T, q @ weights[3].T
            (torch.nn.functional.silu(x @ weights[4].T) * (x @ weights[5].T)) @ weights[6].T
        x @ head.T

    times = []
    with torch.inference_mode():
        step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def use_decode_kernel(on: bool | None) -> None:
    """Have the engine's attention metadata ask for the decode-attention kernel (True), the
    torch path (False), or decide as shipped (None)."""
    build = attention.build_attention_metadata
    model_runner.build_attention_metadata = (
        build if on is None else functools.partial(build, decode_kernel=on)
    )


def print_split(title: str, split: Split, floor_ms: float, wall_ms: float, cpu_ms: float) -> None:
    print(f"\n{title}: {wall_ms:.1f} ms/step unprofiled (median wall; main thread CPU "
          f"{cpu_ms:.1f} ms); profiled {split.step_ms:.1f} ms/step over {split.steps} steps:")  # fmt: skip
    rows = [
        ("weight GEMMs", split.gemm_ms),
        ("attention (ops + its Python)", split.attention_ms),
        ("  of which ops", split.attention_ops_ms),
        ("other ops", split.other_ops_ms),
        ("Python/engine overhead", split.python_ms),
    ]
    for name, ms in rows:
        print(f"  {name:<30} {ms:7.1f} ms  {100 * ms / split.step_ms:5.1f}%")
    print(f"  GEMM floor (same shapes, torch) {floor_ms:6.1f} ms  "
          f"(the GEMMs above are {split.gemm_ms / floor_ms:.2f}x it)")  # fmt: skip
    print("  phases (inclusive): " + ", ".join(
        f"{p} {split.phases_ms.get(p, 0.0):.1f}" for p in PHASES))  # fmt: skip
    print("  in the model (inclusive): " + ", ".join(
        f"{p} {split.phases_ms.get(p, 0.0):.1f}" for p in MODEL_PARTS))  # fmt: skip
    for label, by_name in (("attention ops", split.attention_ops_by_name_ms),
                           ("other ops", split.other_ops_by_name_ms)):  # fmt: skip
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        print(f"  top {label}: " + ", ".join(f"{n} {ms:.2f}" for n, ms in top))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=12, help="unprofiled, per variant")
    parser.add_argument("--steps", type=int, default=6, help="profiled, per variant")
    parser.add_argument("--block", type=int, default=3, help="steps per block when alternating")
    parser.add_argument("--compare", action="store_true",
                        help="alternate the decode-attention kernel and the torch path")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    kernels.available()  # a float32 engine does not wait for the first build; build now
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        num_threads=args.threads,
        max_model_len=args.input_len + args.output_len + 1,
    )
    engine = build_engine(config)
    rows = args.num_requests
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(100, vocab, size=(rows, args.input_len)).tolist()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    t0 = time.perf_counter()
    while engine.stats().prompt_tokens_total < rows * args.input_len:
        engine.step()
    prefill_s = time.perf_counter() - t0
    variants = {"kernel": True, "torch": False} if args.compare else {"as shipped": None}
    needed = args.warmup_steps + len(variants) * (args.timed_steps + args.steps)
    if needed > args.output_len - 2:
        raise SystemExit(f"{needed} decode steps do not fit in --output-len {args.output_len}")
    print(f"{args.model} {engine.dtype}, {rows} rows x {args.input_len} prompt tokens, "
          f"{args.threads} threads, kernels {kernels.describe()}; prefill {prefill_s:.1f} s")  # fmt: skip
    decode_steps(engine, args.warmup_steps, rows)
    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    done = 0
    while done < args.timed_steps:  # alternate blocks, so drift hits every variant alike
        n = min(args.block, args.timed_steps - done)
        for name, on in variants.items():
            use_decode_kernel(on)
            times[name] += decode_steps(engine, n, rows)
        done += n
    splits = {}
    for name, on in variants.items():
        use_decode_kernel(on)
        splits[name] = profile_steps(engine, args.steps, rows)
    use_decode_kernel(None)
    floor = gemm_floor_ms(rows, engine.dtype)
    wall = {name: 1000 * statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: 1000 * statistics.median(c for _, c in t) for name, t in times.items()}
    for name, split in splits.items():
        print_split(name, split, floor, wall[name], cpu[name])
    if args.json:
        report = {
            "config": vars(args) | {"json": str(args.json), "dtype": str(engine.dtype)},
            "kernels": kernels.describe(),
            "gemm_floor_ms": floor,
            "variants": {
                name: {"wall_ms": wall[name], "cpu_ms": cpu[name], "python_ms": split.python_ms}
                | dataclasses.asdict(split)
                for name, split in splits.items()
            },
        }
        args.json.write_text(json.dumps(report, indent=2))
    if args.compare:
        for label, ms in (("wall", wall), ("main-thread CPU", cpu)):
            print(f"kernel / torch path, unprofiled median {label} ms/step: "
                  f"{ms['kernel']:.1f} / {ms['torch']:.1f} = {ms['kernel'] / ms['torch']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
