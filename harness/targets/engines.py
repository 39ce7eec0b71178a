"""External engines the harness can launch: a command template per engine, registered by name.

`--target vllm` and `--target llamacpp` (`harness.targets.spec`) start them from these
templates. Every managed engine serves the same weights the reference engine runs: vLLM the
Hugging Face directory `bench model export` writes (float32, as the reference engine computes on
this CPU), llama.cpp the very GGUF file the reference engine loads.

A template is split like a shell line; leading `NAME=value` words set environment variables.
Fields: `{python}` (the engine's interpreter, `--engine-python NAME=PATH`), `{model_dir}`,
`{gguf}`, `{served_model}`, `{host}`, `{port}`. `--engine-command NAME=TEMPLATE` overrides one.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench_common.cache import CacheArea, cache_area
from harness.errors import HarnessError

DEFAULT_MODEL = "smollm2-135m"  # the reference engine's model when none is named


@dataclass(frozen=True)
class EngineSpec:
    """How to launch one engine and what to expect of it.

    `weights`: `hf` (an exported directory) or `gguf` (the reference model's GGUF file);
    `ready_path`: polled until it answers 200; `distributions`: package names whose version
    `{python}` reports for the manifest; `serialises_requests`: the engine serves one request
    at a time (the card says so)."""

    name: str
    command: str
    weights: str
    ready_path: str = "/health"
    distributions: tuple[str, ...] = ()
    serialises_requests: bool = False


ENGINES = {
    "vllm": EngineSpec(
        name="vllm",
        command=(
            "VLLM_CPU_KVCACHE_SPACE=4 {python} -m vllm.entrypoints.openai.api_server "
            "--model {model_dir} --served-model-name {served_model} --dtype float32 "
            "--host {host} --port {port} --max-model-len 8192 --enable-request-id-headers"
        ),  # request-id headers: each answer's x-request-id lands in the run records
        weights="hf",
        ready_path="/health",
        distributions=("vllm", "vllm-cpu"),
    ),
    "llamacpp": EngineSpec(
        name="llamacpp",
        # interrupt_requests=True (the default) cuts an in-flight stream when the next request
        # arrives; with False every request completes, one at a time.
        command=(
            "{python} -m llama_cpp.server --model {gguf} --model_alias {served_model} "
            "--host {host} --port {port} --n_ctx 8192 --n_threads 2 --interrupt_requests False"
        ),
        weights="gguf",
        ready_path="/v1/models",
        distributions=("llama_cpp_python",),
        serialises_requests=True,
    ),
}


def parse_assignments(values: tuple[str, ...], flag: str) -> dict[str, str]:
    """`NAME=VALUE` flags (`--engine-command`, `--engine-python`) as a dict keyed by engine."""
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or name not in ENGINES or not rest:
            raise HarnessError(
                f"{flag} {value!r} must be ENGINE=VALUE with ENGINE one of {', '.join(ENGINES)}."
            )
        out[name] = rest
    return out


@dataclass(frozen=True)
class LaunchPlan:
    """A resolved managed external engine: the command line, its environment, where its weights
    are and which tokenizer matches them."""

    spec: EngineSpec
    argv: tuple[str, ...]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    weights_path: str = ""
    tokenizer_source: str = ""
    template: str = ""


def exported_dir(model: str) -> Path:
    """The Hugging Face export of reference model `model` (float32), written once under
    `<cache>/exports/`, as `bench model export MODEL --format hf DIR --dtype float32` does."""
    from engine_ref.loading.export import export_hf
    from engine_ref.loading.model_files import ModelFileError

    out = cache_area(CacheArea.EXPORTS) / f"{Path(model).name}-float32"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():  # a previous export died half-way
        shutil.rmtree(tmp)
    try:
        export_hf(model, tmp, dtype="float32")
    except ModelFileError as exc:
        raise HarnessError(f"cannot export {model!r} for the managed engine: {exc}") from exc
    tmp.rename(out)
    return out


def gguf_file(model: str) -> Path:
    """The GGUF file the reference engine loads for `model` (a registered name or a path)."""
    from engine_ref.loading.model_files import ModelFileError, resolve_model

    try:
        resolved = resolve_model(model)
    except ModelFileError as exc:
        raise HarnessError(str(exc)) from exc
    if resolved.format != "gguf" or resolved.path is None:
        raise HarnessError(
            f"llama.cpp serves GGUF files, and {model!r} is not one; use a GGUF model "
            "(smollm2-135m, or a .gguf path) as --model."
        )
    return resolved.path


def plan_launch(
    name: str,
    model: str,
    *,
    served_model: str,
    command: str | None = None,
    python: str | None = None,
    port: int,
    host: str = "127.0.0.1",
) -> LaunchPlan:
    """The command line of engine `name` serving `model` on `host:port`; weights are prepared
    (exported, or the GGUF resolved) here. Raises HarnessError for a bad template."""
    spec = ENGINES[name]
    template = command or spec.command
    weights = str(exported_dir(model) if spec.weights == "hf" else gguf_file(model))
    fields_ = {
        "python": python or sys.executable,
        "model_dir": weights,
        "gguf": weights,
        "served_model": served_model,
        "host": host,
        "port": str(port),
    }
    try:
        words = [w.format(**fields_) for w in shlex.split(template)]
    except (KeyError, IndexError, ValueError) as exc:
        known = ", ".join("{" + k + "}" for k in fields_)
        raise HarnessError(
            f"the {name} command template {template!r} is not usable ({exc}); its fields are {known}."
        ) from exc
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words:
        raise HarnessError(f"the {name} command template {template!r} names no program.")
    return LaunchPlan(
        spec=spec,
        argv=tuple(words),
        port=port,
        env=env,
        python=fields_["python"] if "{python}" in template else None,
        weights_path=weights,
        tokenizer_source=weights,
        template=template,
    )
