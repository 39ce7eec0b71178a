"""Mooncake trace builds: distinct hash ids give distinct token blocks by construction (the block
reuse from token ids equals the one from hash ids), streamed in row groups through
`bench workload build`, and identical to the in-memory build."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from workloads import WorkloadOptions, read_parquet, resolve_workload, store
from workloads.blocks import block_reuse_from_ids, block_reuse_from_tokens
from workloads.build import build_workload
from workloads.cli import workload as workload_cli
from workloads.registry import find_spec
from workloads.sources import trace as trace_source

BLOCK = 512


def _trace(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "mc.yaml"
    spec.write_text(
        "name: mc\nnum_requests: null\n"
        f"source: {{kind: trace, format: mooncake, path: {path.name}}}\narrivals: {{process: trace}}\n"
    )
    return spec


def _row(t: int, n_in: int, ids: list[int]) -> dict:
    return {"timestamp": t, "input_length": n_in, "output_length": 4, "hash_ids": ids}


def test_block_reuse_from_ids_hand_worked():
    # full blocks only, chained keys: [1,2] of the 2nd request and [1] of the 3rd are hits;
    # [1,2,3]'s third block is partial (1100 tokens), [5]'s key differs from [1]'s
    ids = [[1, 2, 3], [1, 2, 4], [1], [5, 6], [2]]
    lengths = [1100, 1030, 512, 700, 512]
    assert block_reuse_from_ids(ids, lengths) == 3
    # the token form, on hand-made token rows: row 1 repeats row 0's first block only
    a, b = np.arange(1024), np.concatenate([np.arange(512), np.arange(512) + 5000])
    assert block_reuse_from_tokens([a, b, a[:700]]) == 2  # b's block 0, then row 2's block 0


def test_distinct_ids_distinct_blocks(tmp_path, tiny_tokenizer):
    """400 one-block prompts with 400 different ids: windows of the small corpus alone would
    repeat (the old builder gave such blocks identical tokens); the tags keep them apart. A
    second part shares prefixes, so the reuse is not trivially 0."""
    rows = [_row(i, BLOCK, [10_000 + i]) for i in range(400)]
    rng = np.random.default_rng(1)
    for i in range(60):  # conversations: a shared head of 1-3 ids, then a fresh tail
        head = [int(h) for h in rng.integers(0, 4, size=int(rng.integers(1, 4)))]
        head = [h + 100 * k for k, h in enumerate(head)]
        rows.append(_row(400 + i, BLOCK * (len(head) + 1) + 7, [*head, 20_000 + i, 30_000 + i]))
    spec = _trace(tmp_path, rows)
    w = resolve_workload(str(spec), options=WorkloadOptions(), tokenizer=tiny_tokenizer)
    ids = w.table.column("prompt_token_ids").to_pylist()
    from_ids = block_reuse_from_ids(
        [r["hash_ids"] for r in rows], [r["input_length"] for r in rows]
    )
    assert from_ids > 20
    assert block_reuse_from_tokens(ids) == from_ids
    first_blocks = {tuple(row[:BLOCK]) for row in ids[:400]}
    assert len(first_blocks) == 400
    assert w.manifest["prompt_check"]["mismatched"] == 0
    blocks = w.manifest["parameters"]["effective"]["blocks"]
    assert blocks["infinite_cache_block_hits"] == from_ids
    for text, row in zip(w.table.column("prompt").to_pylist()[::37], ids[::37], strict=True):
        assert tiny_tokenizer.encode(text) == row


def test_streamed_build_in_row_groups_equals_in_memory(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(store, "ROW_GROUP_ROWS", 16)
    monkeypatch.setattr(trace_source, "BLOCK_CHUNK_ROWS", 24)
    rows = [_row(i * 10, 600 + 13 * (i % 7), [i % 5, 1000 + i]) for i in range(70)]
    spec = _trace(tmp_path, rows)
    out = tmp_path / "built.parquet"
    result = CliRunner().invoke(
        workload_cli,
        ["build", str(spec), "-o", str(out), "--tokenizer", "x"],
        obj={"load_tokenizer": lambda name: tiny_tokenizer},
    )
    assert result.exit_code == 0, result.output
    assert "70 requests" in result.output
    assert pq.ParquetFile(out).metadata.num_row_groups == 5  # 70 rows, 16 a group
    streamed = read_parquet(out)  # checks the sha256 against the manifest
    in_memory = build_workload(find_spec(str(spec)), WorkloadOptions(), tiny_tokenizer)
    assert streamed.table.equals(in_memory.table)
    assert streamed.manifest == in_memory.manifest
    assert streamed.manifest["prompt_check"]["checked"] == 70
    # a second build is byte-identical
    again = tmp_path / "again.parquet"
    CliRunner().invoke(
        workload_cli,
        ["build", str(spec), "-o", str(again), "--tokenizer", "x"],
        obj={"load_tokenizer": lambda name: tiny_tokenizer},
    )
    assert again.read_bytes() == out.read_bytes()


def test_large_build_samples_prompt_check(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(trace_source, "FULL_CHECK_TOKENS", 4 * BLOCK)
    rows = [_row(i, 2 * BLOCK, [i % 3, 100 + i]) for i in range(40)]
    w = resolve_workload(
        str(_trace(tmp_path, rows)), options=WorkloadOptions(), tokenizer=tiny_tokenizer
    )
    check = w.manifest["prompt_check"]
    # 40 prompts of 1,024 tokens, a budget of 2,048 tokens: ceil(40 * 2048 / 40960) = 2 checked
    assert check["mode"] == "sample" and check["checked"] == 2 and check["mismatched"] == 0


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
