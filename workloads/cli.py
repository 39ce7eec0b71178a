"""`bench workload ...`: list, show and build workloads (a thin layer over the library).

Tokenizers: `--tokenizer` takes a `tokenizer.json` file (Hugging Face `tokenizers` format) or a
model name; names are resolved by the `load_tokenizer` callable that the `bench` group puts in
`ctx.obj["load_tokenizer"]` (this package does not import the engine).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from workloads.build import build_workload_file
from workloads.options import WorkloadOptions
from workloads.registry import (
    builtin_names,
    builtin_spec,
    builtin_text,
    find_spec,
    resolve_workload,
)
from workloads.schema import WorkloadError
from workloads.store import read_parquet, write_parquet


class WorkloadCliError(click.ClickException):
    exit_code = 2


class _FileTokenizer:
    """A `tokenizer.json` file seen through the tokenizer protocol."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(path))
        self.name = path.name if path.name != "tokenizer.json" else path.parent.name or path.name

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids))


def load_cli_tokenizer(ctx: click.Context, name_or_path: str) -> Any:
    path = Path(name_or_path)
    if path.is_file():
        try:
            return _FileTokenizer(path)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise WorkloadCliError(f"Cannot load tokenizer file {path} ({exc}).") from None
    loader = (ctx.obj or {}).get("load_tokenizer") if isinstance(ctx.obj, dict) else None
    if loader is None:
        raise WorkloadCliError(
            f"Tokenizer {name_or_path!r} is not a file and no model tokenizer loader is wired in; "
            "pass a tokenizer.json path."
        )
    try:
        return loader(name_or_path)
    except Exception as exc:  # the loader's errors are one sentence; keep them so
        raise WorkloadCliError(f"Cannot load the tokenizer {name_or_path!r}: {exc}") from None


@click.group(name="workload")
def workload() -> None:
    """List, show and build workloads."""


@workload.command(name="list")
def list_cmd() -> None:
    """List the built-in workloads."""
    for name in builtin_names():
        desc = " ".join(builtin_spec(name).description.split())
        short = desc if len(desc) <= 96 else desc[:95].rsplit(" ", 1)[0] + " ..."
        click.echo(f"{name:<14} {short}")


@workload.command(name="show")
@click.argument("name")
def show_cmd(name: str) -> None:
    """Show a built-in or YAML spec, or the manifest of a built .parquet workload."""
    try:
        found = find_spec(name)
        if isinstance(found, Path):
            click.echo(json.dumps(read_parquet(found).manifest, indent=2, sort_keys=True))
        elif found.origin.startswith("builtin:"):
            click.echo(builtin_text(name).rstrip())
        else:
            click.echo(Path(found.origin).read_text(encoding="utf-8").rstrip())
    except WorkloadError as exc:
        raise WorkloadCliError(str(exc)) from None


def _rate(value: str | None) -> float | None:
    if value is None:
        return None
    if value.lower() in ("inf", "infinity"):
        return math.inf
    try:
        return float(value)
    except ValueError:
        raise WorkloadCliError(f"--request-rate must be a number or inf, got {value!r}.") from None


@workload.command(name="build")
@click.argument("name")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the .parquet file.",
)
@click.option(
    "--tokenizer",
    default="smollm2-135m",
    show_default=True,
    help="Model name or tokenizer.json file.",
)
@click.option("--num-requests", type=int)
@click.option("--input-len", type=int, help="Prompt tokens (fixed, or uniform with --range-ratio).")
@click.option(
    "--output-len", type=int, help="Output tokens (fixed, or uniform with --range-ratio)."
)
@click.option(
    "--range-ratio", type=float, help="Uniform lengths in [L*(1-r), L*(1+r)], r in [0, 1)."
)
@click.option("--request-rate", type=str, help="Requests per second, or inf for all at once.")
@click.option("--burstiness", type=float, help="Gamma shape of inter-arrival gaps (1 = Poisson).")
@click.option("--seed", type=int)
@click.option("--ignore-eos/--no-ignore-eos", default=None)
@click.option(
    "--dataset-path", type=str, help="Dataset or trace file (ShareGPT JSON, trace CSV/JSONL)."
)
@click.option("--endpoint", type=click.Choice(["completions", "chat"]))
@click.option(
    "--duration-s", type=float, help="Generate open-loop arrivals until this many seconds."
)
@click.option("--concurrency", type=int, help="Closed loop with this many requests in flight.")
@click.pass_context
def build_cmd(
    ctx: click.Context,
    name: str,
    output: Path,
    tokenizer: str,
    request_rate: str | None,
    **opts: Any,
) -> None:
    """Materialise workload NAME into a parquet file (manifest in its metadata)."""
    try:
        options = WorkloadOptions(request_rate=_rate(request_rate), **opts)
        tok = load_cli_tokenizer(ctx, tokenizer)
        found = find_spec(name)
        if isinstance(found, Path):  # a built workload: replayed (and re-written) exactly
            built = resolve_workload(name, options=options, tokenizer=tok)
            write_parquet(built, output)
            m = built.manifest
        else:  # straight into the file, a chunk of rows at a time
            m = build_workload_file(found, options, tok, output)
    except WorkloadError as exc:
        raise WorkloadCliError(str(exc)) from None
    kind = "synthetic" if m.get("synthetic") else "recorded"
    click.echo(
        f"Wrote {output}: {m['num_requests']} requests ({kind}), tokenizer {m['tokenizer']}, sha256 {m['sha256']}"
    )
