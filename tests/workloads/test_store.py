"""Manifests, parquet round trips, byte-identical builds, the cache, YAML spec errors and the CLI."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from bench_common.cache import cache_root
from workloads import WorkloadError, WorkloadOptions, read_parquet, resolve_workload, write_parquet
from workloads.cli import workload as workload_cli
from workloads.registry import builtin_names
from workloads.schema import table_sha256

OPTS = WorkloadOptions(num_requests=12, input_len=30, output_len=5, request_rate=2.0, seed=3)


def test_parquet_round_trip_and_byte_identical_builds(tmp_path, tiny_tokenizer):
    a = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer, use_cache=False)
    b = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer, use_cache=False)
    write_parquet(a, tmp_path / "a.parquet")
    write_parquet(b, tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    meta = pq.read_schema(tmp_path / "a.parquet").metadata
    assert json.loads(meta[b"workload_manifest"])["sha256"] == a.manifest["sha256"]
    replay = resolve_workload(
        str(tmp_path / "a.parquet"), options=WorkloadOptions(), tokenizer=tiny_tokenizer
    )
    assert replay.table.equals(a.table) and replay.manifest == a.manifest
    with pytest.raises(WorkloadError, match="replays exactly; drop num_requests"):
        resolve_workload(
            str(tmp_path / "a.parquet"),
            options=WorkloadOptions(num_requests=3),
            tokenizer=tiny_tokenizer,
        )
    # the harness always passes a seed and an endpoint: a replay ignores them
    same = resolve_workload(
        str(tmp_path / "a.parquet"),
        options=WorkloadOptions(seed=0, endpoint="completions"),
        tokenizer=tiny_tokenizer,
    )
    assert same.manifest == a.manifest
    closed = resolve_workload(
        str(tmp_path / "a.parquet"),
        options=WorkloadOptions(concurrency=4),
        tokenizer=tiny_tokenizer,
    )
    assert closed.closed_loop_concurrency == 4 and closed.table.column("arrival_s").null_count == 12
    assert closed.manifest["replayed_from_sha256"] == a.manifest["sha256"]
    assert closed.manifest["sha256"] == table_sha256(closed.table) != a.manifest["sha256"]
    assert closed.table.drop_columns(["arrival_s"]).equals(a.table.drop_columns(["arrival_s"]))


def test_manifest_contents(tiny_tokenizer):
    w = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer, use_cache=False)
    m = w.manifest
    assert m["generator"] == "workloads.synthetic" and m["seed"] == 3
    assert m["tokenizer"] == "tiny-random" and m["sha256"] == table_sha256(w.table)
    assert m["parameters"]["overrides"] == {
        "num_requests": 12,
        "input_len": 30,
        "output_len": 5,
        "request_rate": 2.0,
        "seed": 3,
    }
    assert m["parameters"]["effective"]["arrivals"] == {
        "process": "poisson",
        "rate": 2.0,
        "normalize_total": True,
    }
    json.dumps(m)  # JSON-serialisable


def test_sha256_detects_a_changed_table(tmp_path, tiny_tokenizer):
    w = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer, use_cache=False)
    path = tmp_path / "w.parquet"
    write_parquet(w, path)
    table = pq.read_table(path)
    changed = table.set_column(
        4, "input_tokens", table.column("input_tokens").cast("int64").cast("int32")
    )
    assert table_sha256(changed) == w.manifest["sha256"]  # same values, same hash
    edited = table.set_column(5, "max_output_tokens", pq.read_table(path).column("input_tokens"))
    pq.write_table(edited, path)
    with pytest.raises(WorkloadError, match="does not match the sha256"):
        read_parquet(path)


def test_cache(tmp_path, monkeypatch, tiny_tokenizer):
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"
    first = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer)
    entries = list((tmp_path / "cache" / "workloads").glob("*.parquet"))
    assert len(entries) == 1
    again = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer)
    assert again.manifest == first.manifest and again.table.equals(first.table)
    resolve_workload("random", options=WorkloadOptions(num_requests=13), tokenizer=tiny_tokenizer)
    assert len(list((tmp_path / "cache" / "workloads").glob("*.parquet"))) == 2
    entries[0].write_bytes(b"garbage")  # a damaged entry is rebuilt
    rebuilt = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer)
    assert rebuilt.manifest == first.manifest


@pytest.mark.parametrize(
    "text, match",
    [
        ("name: x\nrate: 3\n", r"bad\.yaml:2: unknown key 'rate'; known keys: name, "),
        ("[1, 2]\n", r"bad\.yaml:1: got a list; expected a mapping"),
        (
            "name: x\nsource: {kind: synthetic, input: 5}\n",
            r"bad\.yaml:2: source: missing key 'output'; required keys: kind, input, output",
        ),
        (
            "name: x\nsource: {kind: magic}\n",
            r"bad\.yaml:2: source\.kind: got 'magic'; expected one of synthetic, mix, sharegpt",
        ),
        ("name: x\nnum_requests: -2\n", r"bad\.yaml:2: num_requests: got -2; expected an integer"),
        (
            "name: x\nsource: {kind: synthetic, input: 5, output: 5}\narrivals: {process: trace}\n",
            r"bad\.yaml:3: arrivals\.process: trace arrivals need a trace source",
        ),
        (
            "name: x\nsource: {kind: synthetic, input: {dist: normal, mean: 5}, output: 5}\n",
            r"bad\.yaml:2: source\.input: dist 'normal' needs the field 'std'",
        ),
        (
            "name: x\nsource: {kind: synthetic, input: 5, output: 5}\narrivals: {process: poisson}\n",
            r"bad\.yaml:3: arrivals: process 'poisson' needs the field 'rate'",
        ),
        ("name: x: y\n", "not valid YAML"),
    ],
)
def test_spec_errors_name_the_file(tmp_path, tiny_tokenizer, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=match) as info:
        resolve_workload(
            str(path), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
        )
    assert "bad.yaml" in str(info.value)


def test_yaml_spec_file(tmp_path, tiny_tokenizer):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "name: mine\nnum_requests: 10\nseed: 4\nendpoint: chat\ntemperature: 0.5\n"
        "source: {kind: synthetic, input: {dist: normal, mean: 40, std: 5}, output: 7}\n"
        "arrivals: {process: constant, rate: 5}\n"
    )
    w = resolve_workload(
        str(path), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
    )
    t = w.table.to_pydict()
    assert t["arrival_s"] == pytest.approx([0.2 * (i + 1) for i in range(10)])
    assert t["max_output_tokens"] == [7] * 10 and t["temperature"] == [0.5] * 10
    assert w.manifest["endpoint"] == "chat" and "chat template" in w.manifest["prompt_format"]


def _tokenizer_file(tmp_path, tiny_tokenizer):
    path = tmp_path / "tokenizer.json"
    tiny_tokenizer.backend.save(str(path))
    return path


def test_cli_list_show_build(tmp_path, tiny_tokenizer):
    runner = CliRunner()
    listed = runner.invoke(workload_cli, ["list"])
    assert listed.exit_code == 0
    assert [line.split()[0] for line in listed.output.splitlines()] == builtin_names()
    shown = runner.invoke(workload_cli, ["show", "mixed"])
    assert shown.exit_code == 0 and "prefill_heavy" in shown.output
    out = tmp_path / "w.parquet"
    tok = _tokenizer_file(tmp_path, tiny_tokenizer)
    args = [
        "build",
        "random",
        "-o",
        str(out),
        "--tokenizer",
        str(tok),
        "--num-requests",
        "7",
        "--input-len",
        "20",
        "--request-rate",
        "inf",
    ]
    built = runner.invoke(workload_cli, args, env={"BENCH_CACHE_DIR": str(tmp_path / "c")})
    assert built.exit_code == 0, built.output
    w = read_parquet(out)
    assert w.num_requests == 7 and w.manifest["sha256"] in built.output
    assert w.table.column("input_tokens").to_pylist() == [20] * 7
    manifest = runner.invoke(workload_cli, ["show", str(out)])
    assert json.loads(manifest.output)["sha256"] == w.manifest["sha256"]


def test_cli_errors_exit_2(tmp_path, tiny_tokenizer):
    runner = CliRunner()
    unknown = runner.invoke(workload_cli, ["show", "nope"])
    assert unknown.exit_code == 2 and "built-in workloads are" in unknown.output
    tok = _tokenizer_file(tmp_path, tiny_tokenizer)
    bad = runner.invoke(
        workload_cli,
        [
            "build",
            "random",
            "-o",
            str(tmp_path / "x.parquet"),
            "--tokenizer",
            str(tok),
            "--range-ratio",
            "2",
        ],
    )
    assert bad.exit_code == 2 and "range_ratio" in bad.output
    no_tok = runner.invoke(
        workload_cli,
        ["build", "random", "-o", str(tmp_path / "x.parquet"), "--tokenizer", "some-model"],
    )
    assert no_tok.exit_code == 2 and "tokenizer.json" in no_tok.output
    via_bench = runner.invoke(
        workload_cli,
        [
            "build",
            "random",
            "-o",
            str(tmp_path / "y.parquet"),
            "--tokenizer",
            "tiny-random",
            "--num-requests",
            "2",
        ],
        obj={"load_tokenizer": lambda name: tiny_tokenizer},
        env={"BENCH_CACHE_DIR": str(tmp_path / "c")},
    )
    assert via_bench.exit_code == 0, via_bench.output


def test_cli_tokenizer_loader_errors_are_one_sentence(tmp_path):
    def failing(name):
        raise ValueError(f"unknown model {name!r}.")

    result = CliRunner().invoke(
        workload_cli,
        ["build", "random", "-o", str(tmp_path / "z.parquet"), "--tokenizer", "nope"],
        obj={"load_tokenizer": failing},
    )
    assert result.exit_code == 2 and "unknown model 'nope'" in result.output


def test_a_file_built_before_sessions_asks_for_a_rebuild(tmp_path, tiny_tokenizer):
    w = resolve_workload("random", options=OPTS, tokenizer=tiny_tokenizer, use_cache=False)
    old = w.table.drop_columns(["turn_index", "think_s"])
    manifest = dict(w.manifest, format_version=1)
    meta = {b"workload_manifest": json.dumps(manifest).encode()}
    pq.write_table(old.replace_schema_metadata(meta), tmp_path / "old.parquet")
    with pytest.raises(
        WorkloadError, match="built by an older bench .*turn_index, think_s.*rebuild"
    ):
        read_parquet(tmp_path / "old.parquet")
