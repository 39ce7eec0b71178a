"""Decode step time of the engine's paths against the bf16 weight-streaming floor, side by side.

Paths (one engine each, built from the same loaded file, `LLMEngine.step` on `--model`):
- `float32`: float32 weights, the fused `refkern::decode_layer` and `refkern::f32_gemm` head;
- `bfloat16`: bfloat16 weights and KV pool, the fused layer with `refkern::bf16_gemm`;
- `bfloat16-torch`: the same engine with the fused layer and the engine's head GEMM off (the
  Python layers on torch's bf16 kernels: what a bf16 engine ran before `bf16_gemm`);
- `w4a16`, `w4a8`, `w8a8`: float32 engines with `--quantization` of that name (int4 weights
  from the GGUF's Q4_1 blocks for the 4-bit ones; W4A16 fused into `decode_layer`, W4A8 and
  W8A8 on the int8 kernels);
- `floor`: the model's weight matmuls alone in torch bfloat16 (q, k, v, o, gate, up, down per
  layer and the output projection, no attention, no framework), measured in this process
  (`/work/shared/tools/gemm_floor.py`'s step). At one row it streams every bf16 weight once.

For each `--rows` value (concurrent single-token streams), each repeat runs every path once
in an order rotated per repeat: `--rows` requests are prefilled, `--warmup` decode steps run
untimed, then `--steps` decode steps are timed one by one. The table gives the median step
over all repeats (at least 30 steps: `--repeats` x `--steps`), its ratio to the floor, the
instruction-set level of the engine kernels (`kernels.active_isa()`) and the CPU; then the
process's resident set size. `--isa` runs the whole measurement once per listed level in a
subprocess with `BENCH_REF_ISA` set (the kernels load one level per process).

    nice -n 0 python benchmarks/decode_paths.py                      # rows 1 and 16, 2 threads
    nice -n 0 python benchmarks/decode_paths.py --isa avx2,avx512-bf16 --rows 1
    nice -n 0 python benchmarks/decode_paths.py --paths bfloat16,floor --repeats 5 --json out.json
    nice -n 0 python benchmarks/decode_paths.py --isa avx2,avx512,avx512-bf16 --rows 1 \
        --paths bfloat16,float32,w4a16,w4a8,w8a8,floor        # the single-stream table per level
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core import kernels  # noqa: E402
from engine_ref.core.quant import INT4_MODES  # noqa: E402
from engine_ref.loading.weights import load_model  # noqa: E402
from harness.run.environment import hardware_info  # noqa: E402

PATHS = ("float32", "bfloat16", "bfloat16-torch", "w4a16", "w4a8", "w8a8", "floor")
DEFAULT_PATHS = ("float32", "bfloat16", "bfloat16-torch", "floor")
QUANTIZED = {"w4a16": "w4a16", "w4a8": "w4a8", "w8a8": "w8a8"}
PROMPT_TOKENS = 32


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    current = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            current = int(line.split()[1]) / 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Floor:
    """The model's weight matmuls in torch bf16 at a given number of rows (random weights of
    the model's shapes: each projection as its own matmul, as an unfused model runs them)."""

    def __init__(self, config, generator: torch.Generator) -> None:
        c = config
        d, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
        q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
        shapes = [(q, d), (kv, d), (kv, d), (d, q), (inter, d), (inter, d), (d, inter)]

        def weight(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, generator=generator, dtype=torch.bfloat16)

        self.layers = [[weight(n, k) for n, k in shapes] for _ in range(c.num_hidden_layers)]
        self.head = weight(c.vocab_size, d)
        self.hidden, self.generator = d, generator

    def step(self, rows: int) -> None:
        x = torch.randn(rows, self.hidden, generator=self.generator, dtype=torch.bfloat16)
        for wq, wk, wv, wo, wg, wu, wd in self.layers:
            q = x @ wq.T
            x @ wk.T, x @ wv.T, q @ wo.T
            (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
        x @ self.head.T


def engine_steps(engine: LLMEngine, rows: int, warmup: int, steps: int) -> list[float]:
    """ms of each of `steps` decode steps of `rows` concurrent greedy streams."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0, ignore_eos=True)
    for r in range(rows):
        ids = [(101 * r + 7 * j) % (vocab - 200) + 100 for j in range(PROMPT_TOKENS)]
        engine.add_request(f"r{r}", ids, params)
    engine.step()  # every prefill at once (rows x 32 tokens fit one step's budget)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    while engine.has_unfinished():
        engine.step()
    return times


def floor_steps(floor: Floor, rows: int, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        floor.step(rows)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        floor.step(rows)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def build_engines(args, paths: list[str]) -> dict[str, LLMEngine]:
    dtypes = {"float32": "float32", "bfloat16": "bfloat16", "bfloat16-torch": "bfloat16"}
    dtypes |= dict.fromkeys(QUANTIZED, "float32")
    keep_int4 = any(QUANTIZED.get(p) in INT4_MODES for p in paths)
    loaded = {
        dt: load_model(args.model, dtype=dt, keep_int4=keep_int4 and dt == "float32")
        for dt in {dtypes[p] for p in paths if p in dtypes}
    }
    tokens = PROMPT_TOKENS + args.warmup + args.steps + 4
    num_blocks = max(args.rows) * -(-tokens // 16) + 8
    engines = {}
    for path in paths:
        if path == "floor":
            continue
        config = EngineConfig(model=args.model, dtype=dtypes[path], device="cpu",
                              num_threads=args.threads, num_blocks=num_blocks,
                              quantization=QUANTIZED.get(path),
                              enable_prefix_caching=False)  # fmt: skip
        engine = LLMEngine(config, loaded=loaded[dtypes[path]])
        if path == "bfloat16-torch":
            engine.model.fused_decode = None
            engine.model.small_head = False
        elif path in ("float32", "bfloat16", "w4a16") and engine.model.fused_decode is None:
            raise SystemExit(
                f"The {path} engine did not take the fused path ({kernels.describe()})."
            )
        engines[path] = engine
    return engines


def measure(args) -> dict:
    """This process's measurement: per rows value and path, the step times (ms)."""
    torch.set_num_threads(args.threads)
    kernels.available()  # a float32 or bf16 engine does not wait for the first build; build now
    paths = args.paths.split(",")
    engines = build_engines(args, paths)
    rss_engines = rss_mib()[0]
    floor = None
    if "floor" in paths:
        config = (
            next(iter(engines.values())).model_config if engines else load_model(args.model).config
        )
        floor = Floor(config, torch.Generator().manual_seed(0))
    runs: dict[int, dict[str, list[float]]] = {rows: {p: [] for p in paths} for rows in args.rows}
    for repeat in range(args.repeats):
        order = paths[repeat % len(paths) :] + paths[: repeat % len(paths)]
        for rows in args.rows:
            for path in order:
                if path == "floor":
                    times = floor_steps(floor, rows, args.warmup, args.steps)
                else:
                    times = engine_steps(engines[path], rows, args.warmup, args.steps)
                runs[rows][path] += times
                print(f"repeat {repeat + 1} rows {rows:>2} {path:<15} median "
                      f"{statistics.median(times):7.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
    current, peak = rss_mib()
    return {
        "isa": kernels.active_isa() or kernels.describe(),
        "cpu": hardware_info()["cpu"],
        "threads": args.threads,
        "rss_mib": {"after_engines": rss_engines, "end": current, "peak": peak},
        "runs": {str(rows): r for rows, r in runs.items()},
    }


def print_table(results: list[dict]) -> None:
    print(f"CPU: {results[0]['cpu']}, {results[0]['threads']} threads; median ms per decode step")
    print(f"{'isa':<12} {'rows':>4} {'path':<15} {'ms/step':>8} {'x floor':>8} {'steps':>6}")
    for result in results:
        for rows, by_path in result["runs"].items():
            medians = {p: statistics.median(t) for p, t in by_path.items() if t}
            floor = medians.get("floor")
            for path, ms in medians.items():
                ratio = f"{ms / floor:7.2f}x" if floor else "       -"
                print(f"{result['isa']:<12} {rows:>4} {path:<15} {ms:8.2f} {ratio} "
                      f"{len(by_path[path]):>6}")  # fmt: skip
        rss = result["rss_mib"]
        print(f"{result['isa']:<12} RSS: {rss['after_engines']:.0f} MiB with the engines built, "
              f"{rss['end']:.0f} MiB at the end (floor weights too), peak {rss['peak']:.0f} MiB")  # fmt: skip


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv less the options `names` and their values (`--name value` or `--name=value`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in names)):
            kept.append(arg)
    return kept


def run_isa_levels(args, argv: list[str]) -> list[dict]:
    """This script once per level, each in its own process with BENCH_REF_ISA set."""
    results = []
    own = without_options(argv, ("--isa", "--json"))
    for level in args.isa.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            env = dict(os.environ, **{kernels.ISA_ENV: level})
            # The child's table is printed here with the others; its progress goes to stderr.
            subprocess.run([sys.executable, __file__, *own, "--json", str(out)], env=env,
                           stdout=subprocess.DEVNULL, check=True)  # fmt: skip
            results.append(json.loads(out.read_text()))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"of {', '.join(PATHS)}")
    parser.add_argument("--rows", default="1,16", help="concurrent streams, comma-separated")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="levels to run, each in a subprocess")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = [p for p in args.paths.split(",") if p not in PATHS]
    if unknown:
        parser.error(f"--paths takes {', '.join(PATHS)}; got {', '.join(unknown)}.")
    bad_levels = [v for v in (args.isa or "").split(",") if v and v not in kernels.ISA_NAMES]
    if bad_levels:
        parser.error(f"--isa takes {', '.join(kernels.ISA_NAMES)}; got {', '.join(bad_levels)}.")
    args.rows = [int(r) for r in args.rows.split(",")]
    if args.repeats * args.steps < 30:
        parser.error("--repeats x --steps must be at least 30 (the median's sample).")
    results = run_isa_levels(args, argv) if args.isa else [measure(args)]
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results if args.isa else results[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
