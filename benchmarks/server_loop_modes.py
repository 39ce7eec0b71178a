"""Thread vs process engine loop of the reference server, measured end to end over HTTP.

For each mode, starts `python -m engine_ref.serving --engine-loop MODE --port 0` as a
subprocess, sends N concurrent streaming completions (random prompt token ids, ignore_eos, so
every request makes exactly the asked number of tokens), and reports output tokens/s over the
whole batch plus TTFT and ITL percentiles measured by this client. Modes alternate for
`--repeats` rounds so drift on a shared machine hits both alike; medians are printed.

    python benchmarks/server_loop_modes.py --model tiny-random -n 64 --input-len 128 --output-len 128
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time

import aiohttp
import click


def _start_server(model: str, mode: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "engine_ref.serving",
        "--model",
        model,
        "--port",
        "0",
        "--engine-loop",
        mode,
        "--log-level",
        "warning",
        *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    assert process.stdout is not None
    for line in process.stdout:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return process, match.group(1)
        if time.monotonic() > deadline:
            break
    process.kill()
    raise SystemExit(f"server ({mode}) did not start: exit code {process.poll()}")


async def _one(session, url, prompt_ids, output_len, t0):
    body = {
        "prompt": prompt_ids,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    times = []
    completion_tokens = None
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["token_ids"]:
                times.append(now)
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], completion_tokens


async def _batch(url, prompts, output_len):
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, p, output_len, t0) for p in prompts))
        wall_s = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    ttfts = sorted(r[0] for r in results)
    itls = sorted(x for r in results for x in r[1])
    return {
        "output_tok_s": tokens / wall_s,
        "wall_s": wall_s,
        "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
        "ttft_max_ms": 1e3 * ttfts[-1],
        "itl_p50_ms": 1e3 * itls[len(itls) // 2] if itls else float("nan"),
        "itl_p99_ms": 1e3 * itls[int(0.99 * (len(itls) - 1))] if itls else float("nan"),
    }


@click.command()
@click.option("--model", default="tiny-random", show_default=True)
@click.option("-n", "--num-requests", default=64, show_default=True)
@click.option("--input-len", default=128, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--repeats", default=2, show_default=True)
@click.option("--modes", default="thread,process", show_default=True)
@click.option(
    "--server-arg", "server_args", multiple=True, help="Extra server option (repeatable)."
)
@click.option("--seed", default=0, show_default=True)
def main(model, num_requests, input_len, output_len, repeats, modes, server_args, seed):
    rng = random.Random(seed)
    results: dict[str, list[dict]] = {m: [] for m in modes.split(",")}
    extra = [a for arg in server_args for a in arg.split()]
    for round_index in range(repeats):
        for mode in results:
            process, url = _start_server(model, mode, extra)
            try:
                vocab = 400  # below every supported model's vocabulary; ids 0-2 are special
                warm = [[rng.randrange(3, vocab) for _ in range(8)]]
                asyncio.run(_batch(url, warm, 4))
                prompts = [
                    [rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(num_requests)
                ]
                result = asyncio.run(_batch(url, prompts, output_len))
            finally:
                process.terminate()
                process.wait(30)
            results[mode].append(result)
            click.echo(
                f"round {round_index} {mode:8s} "
                + " ".join(f"{k}={v:.1f}" for k, v in result.items())
            )
    click.echo(
        f"\n{model}: {num_requests} streams x {input_len} prompt x {output_len} output "
        f"tokens, medians of {repeats}"
    )
    click.echo(
        f"{'mode':8s} {'out tok/s':>10s} {'TTFT p50 ms':>12s} {'TTFT max ms':>12s} "
        f"{'ITL p50 ms':>11s} {'ITL p99 ms':>11s}"
    )
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        click.echo(
            f"{mode:8s} {med['output_tok_s']:10.1f} {med['ttft_p50_ms']:12.1f} "
            f"{med['ttft_max_ms']:12.1f} {med['itl_p50_ms']:11.1f} {med['itl_p99_ms']:11.1f}"
        )


if __name__ == "__main__":
    main()
