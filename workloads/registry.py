"""Finding workloads by name or path, and resolving them (with the materialisation cache)."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench_common.cache import CacheArea, cache_area
from workloads.build import build_workload, build_workload_file
from workloads.manifest import FORMAT_VERSION, tokenizer_fingerprint
from workloads.options import WorkloadOptions
from workloads.prompts import corpus_text
from workloads.schema import Workload, WorkloadError, table_sha256
from workloads.spec import WorkloadSpec, load_spec_file, parse_spec
from workloads.store import cache_key, file_identity, read_parquet


def builtin_names() -> list[str]:
    """Names of the built-in workloads (the YAML files shipped in `workloads/builtin/`)."""
    root = resources.files("workloads.builtin")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def builtin_spec(name: str) -> WorkloadSpec:
    """The built-in spec called `name` (a trailing `.yaml` is allowed)."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if stem not in builtin_names():
        raise WorkloadError(
            f"Unknown workload {name!r}: not a file, and the built-in workloads are {', '.join(builtin_names())}."
        )
    text = resources.files("workloads.builtin").joinpath(stem + ".yaml").read_text(encoding="utf-8")
    return parse_spec(text, f"builtin:{stem}")


def builtin_text(name: str) -> str:
    """The YAML source of a built-in (for `bench workload show`)."""
    spec = builtin_spec(name)
    return (
        resources.files("workloads.builtin")
        .joinpath(spec.origin.split(":", 1)[1] + ".yaml")
        .read_text(encoding="utf-8")
    )


def find_spec(name_or_path: str | Path) -> WorkloadSpec | Path:
    """A spec for a YAML file or built-in name, or the Path of a built `.parquet` file."""
    path = Path(name_or_path)
    if path.is_file():
        if path.suffix == ".parquet":
            return path
        return load_spec_file(path)
    return builtin_spec(str(name_or_path))


REPLAY_IGNORED = ("seed", "endpoint")


def _replay(path: Path, options: WorkloadOptions) -> Workload:
    """A built workload, exactly as stored. `seed` and `endpoint` are ignored (the manifest
    records the real ones); `concurrency` turns it into a closed-loop run of the same requests
    (arrival times dropped, manifest sha256 recomputed); other options are errors."""
    given = {k: v for k, v in options.overrides().items() if k not in REPLAY_IGNORED}
    concurrency = given.pop("concurrency", None)
    if given:
        raise WorkloadError(
            f"{path} is a built workload and replays exactly; drop {', '.join(sorted(given))} or build a new one."
        )
    workload = read_parquet(path)
    if concurrency is None:
        return workload
    table = workload.table.set_column(
        1, "arrival_s", pa.nulls(workload.table.num_rows, pa.float64())
    )
    manifest = dict(workload.manifest)
    manifest.update(
        closed_loop_concurrency=concurrency,
        replayed_from_sha256=workload.manifest.get("sha256"),
        sha256=table_sha256(table),
    )
    return Workload(table=table, manifest=manifest, closed_loop_concurrency=concurrency)


def _key(spec: WorkloadSpec, options: WorkloadOptions, tokenizer: Any) -> str:
    source = spec.data.get("source", {})
    dataset = options.dataset_path or source.get("path")
    if dataset is not None and spec.base_dir is not None and not Path(dataset).is_absolute():
        dataset = str(spec.base_dir / dataset) if not Path(dataset).exists() else dataset
    return cache_key(
        {
            "format_version": FORMAT_VERSION,
            "spec": spec.data,
            "origin": spec.origin,
            "options": options.overrides(),
            "tokenizer": getattr(tokenizer, "name", ""),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "dataset": file_identity(Path(dataset)) if dataset else None,
            "corpus": hashlib.sha256(corpus_text().encode()).hexdigest(),
        }
    )


def resolve_workload(
    name_or_path: str | Path,
    *,
    options: WorkloadOptions | None = None,
    tokenizer: Any,
    use_cache: bool = True,
) -> Workload:
    """The workload named by `name_or_path`: a built `.parquet` file (replayed exactly; options
    must be unset), a YAML spec file, or a built-in name. Specs are materialised for
    `tokenizer` and cached under `<cache>/workloads/<key>.parquet`, the key hashing the spec,
    options, tokenizer identity and dataset file identity. Raises `WorkloadError` for unknown
    names (listing the built-ins) and bad specs or files."""
    options = options or WorkloadOptions()
    found = find_spec(name_or_path)
    if isinstance(found, Path):
        return _replay(found, options)
    if not use_cache:
        return build_workload(found, options, tokenizer)
    path = cache_area(CacheArea.WORKLOADS) / f"{_key(found, options, tokenizer)}.parquet"
    if path.is_file():
        try:
            return read_parquet(path)
        except WorkloadError:
            path.unlink(missing_ok=True)  # a damaged cache entry is rebuilt
    try:
        build_workload_file(found, options, tokenizer, path)
    except OSError:  # an unwritable cache only costs a rebuild next time, in memory
        return build_workload(found, options, tokenizer)
    return read_parquet(path)
