"""Dataset and trace loaders: ShareGPT (vLLM rules), Azure (real files), BurstGPT, Mooncake."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from workloads import WorkloadOptions, resolve_workload
from workloads.loaders import (
    ShareGPTRules,
    _azure_rows,
    _burstgpt_rows,
    load_azure,
    load_burstgpt,
    load_mooncake,
    load_sharegpt,
    load_trace,
)
from workloads.quantiles import QUANTILE_PROBS, bundled_quantiles, derive_azure
from workloads.schema import WorkloadError

AZURE_DIR = Path(__file__).parents[2] / ".." / "shared" / "data" / "azure-llm-inference-2023"
needs_azure = pytest.mark.skipif(not AZURE_DIR.is_dir(), reason="shared/data not beside the clone")


def _words(n: int) -> str:
    return " ".join(["river", "bridge", "garden", "lamp"][i % 4] for i in range(n))


# -- ShareGPT -------------------------------------------------------------------------------


def _sharegpt_file(tmp_path: Path, malformed: bool = False) -> tuple[Path, list[tuple[str, str]]]:
    pairs = [
        ("Hi", _words(30)),  # prompt too short (< 4 tokens)
        (_words(20), _words(30)),
        (_words(20), "ok"),  # output too short
        (_words(1100), _words(10)),  # prompt too long (> 1024)
        (_words(900), _words(1200)),  # prompt + output > 2048
        (_words(40), _words(5)),
        (_words(7), _words(300)),
        (_words(12), _words(60)),
    ]
    data: list = [{"id": "single", "conversations": [{"from": "human", "value": "alone"}]}]
    data += [
        {
            "id": f"c{i}",
            "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": c}],
        }
        for i, (p, c) in enumerate(pairs)
    ]
    if malformed:
        data.insert(3, "not a conversation")
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path, pairs


def test_sharegpt_follows_vllm_rules(tmp_path, tiny_tokenizer):
    path, pairs = _sharegpt_file(tmp_path)
    # independent re-statement of vLLM's rules and shuffle
    entries = [(p, c) for p, c in pairs]  # the single-turn conversation is dropped first
    random.seed(0)
    random.shuffle(entries)
    kept = []
    for p, c in entries:
        n_p, n_c = len(tiny_tokenizer.encode(p)), len(tiny_tokenizer.encode(c))
        if 4 <= n_p <= 1024 and n_c >= 4 and n_p + n_c <= 2048:
            kept.append((p, n_c))
    assert len(kept) == 4
    sample = load_sharegpt(path, tokenizer=tiny_tokenizer, num_requests=4, seed=0)
    assert sample.prompts == [p for p, _ in kept]
    assert sample.output_tokens == [n for _, n in kept]
    assert sample.oversampled == 0
    # a fixed output length skips the minimum-output rule, as in vLLM
    fixed = load_sharegpt(path, tokenizer=tiny_tokenizer, num_requests=5, seed=0, output_len=16)
    assert fixed.output_tokens == [16] * 5 and fixed.oversampled == 0
    rules = ShareGPTRules(min_prompt_tokens=1, max_prompt_tokens=5000, max_total_tokens=10000)
    loose = load_sharegpt(path, tokenizer=tiny_tokenizer, num_requests=8, seed=0, rules=rules)
    passing = sum(
        len(tiny_tokenizer.encode(c)) >= 4 for _, c in pairs
    )  # only the minimum-output rule still bites
    assert passing == 7
    assert len(loose.prompts) == 8 and loose.oversampled == 8 - passing


def test_sharegpt_malformed_entry(tmp_path, tiny_tokenizer):
    path, _ = _sharegpt_file(tmp_path, malformed=True)
    with pytest.raises(WorkloadError, match=r"sharegpt.json:3: entry 3"):
        load_sharegpt(path, tokenizer=tiny_tokenizer, num_requests=2, seed=0)
    sample = load_sharegpt(
        path, tokenizer=tiny_tokenizer, num_requests=2, seed=0, skip_malformed=True
    )
    assert sample.skipped_rows == 1


def test_sharegpt_workload_with_file_is_real(tmp_path, tiny_tokenizer):
    path, _ = _sharegpt_file(tmp_path)
    w = resolve_workload(
        "sharegpt",
        options=WorkloadOptions(dataset_path=str(path), num_requests=6, seed=0),
        tokenizer=tiny_tokenizer,
        use_cache=False,
    )
    assert w.manifest["synthetic"] is False and str(path) in w.manifest["source"]
    t = w.table.to_pydict()
    for text, ids, n in zip(t["prompt"], t["prompt_token_ids"], t["input_tokens"], strict=True):
        assert tiny_tokenizer.encode(text) == ids and len(ids) == n
    assert w.manifest["parameters"]["effective"]["sharegpt_file"]["oversampled"] == 2


def test_sharegpt_without_file_says_synthetic(tiny_tokenizer):
    w = resolve_workload(
        "sharegpt",
        options=WorkloadOptions(num_requests=10),
        tokenizer=tiny_tokenizer,
        use_cache=False,
    )
    assert w.manifest["synthetic"] is True
    assert "synthetic" in w.manifest["source"] and "vLLM paper" in w.manifest["source"]


# -- Azure ----------------------------------------------------------------------------------


@needs_azure
@pytest.mark.parametrize(
    "name, rows, prompt_q, output_q, rate, cv",
    [
        ("conv", 19366, (1020, 2734, 4142), (129, 424, 601), 5.53, 1.09),
        ("code", 8819, (1469, 5188, 7436), (13, 55, 251), 2.57, 13.0),
    ],
)
def test_azure_real_files(name, rows, prompt_q, output_q, rate, cv):
    rec = load_azure(AZURE_DIR / f"AzureLLMInferenceTrace_{name}.csv")
    assert len(rec) == rows and rec.skipped_rows == 0
    # the figures in the data README, recomputed independently there
    for got, want in zip(np.quantile(rec.input_tokens, [0.5, 0.9, 0.99]), prompt_q, strict=True):
        assert got == pytest.approx(want, abs=1.5)
    for got, want in zip(np.quantile(rec.output_tokens, [0.5, 0.9, 0.99]), output_q, strict=True):
        assert got == pytest.approx(want, abs=1.5)
    span = rec.timestamps_s.max() - rec.timestamps_s.min()
    assert rows / span == pytest.approx(rate, rel=0.02)
    gaps = np.diff(np.sort(rec.timestamps_s))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


@needs_azure
def test_bundled_quantiles_match_real_files():
    bundled = bundled_quantiles()
    for key, file in (("azure-2023-conv", "conv"), ("azure-2023-code", "code")):
        derived = derive_azure(AZURE_DIR / f"AzureLLMInferenceTrace_{file}.csv")
        assert bundled[key]["rows"] == derived["rows"]
        for which in ("input", "output"):
            assert [p for p, _ in bundled[key][which]] == list(QUANTILE_PROBS)
            assert bundled[key][which] == derived[which]


@needs_azure
def test_azure_trace_replay_with_speedup(tmp_path, tiny_tokenizer):
    src = AZURE_DIR / "AzureLLMInferenceTrace_conv.csv"
    spec = tmp_path / "azure.yaml"
    spec.write_text(
        f"name: azure-replay\nnum_requests: 20\nsource: {{kind: trace, format: azure, path: '{src}'}}\n"
        "arrivals: {process: trace, speedup: 4.0}\n"
    )
    w = resolve_workload(
        str(spec), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
    )
    rec = load_azure(src)
    t = w.table.to_pydict()
    assert t["input_tokens"] == rec.input_tokens[:20].tolist()
    assert t["max_output_tokens"] == rec.output_tokens[:20].tolist()
    expected = (rec.timestamps_s[:20] - rec.timestamps_s[0]) / 4.0
    assert np.allclose(t["arrival_s"], expected)
    assert w.manifest["synthetic"] is False


def test_azure_malformed_row(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,lots,109\n"
        "2023-11-16 18:15:51.5000000,20,5\n"
    )
    with pytest.raises(WorkloadError, match=r"azure.csv:3"):
        load_azure(path)
    rec = load_azure(path, skip_malformed=True)
    assert rec.skipped_rows == 1 and rec.input_tokens.tolist() == [374, 20]
    assert rec.timestamps_s[1] - rec.timestamps_s[0] == pytest.approx(4.81941, abs=1e-5)


# -- BurstGPT -------------------------------------------------------------------------------


def test_burstgpt(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n"
        "130,GPT-4,x,276,693,API log\n"
        "131,GPT-4,20,0,20,API log\n"
    )
    with pytest.raises(WorkloadError, match=r"burst.csv:5"):
        load_burstgpt(path)
    rec = load_burstgpt(path, skip_malformed=True)
    assert rec.input_tokens.tolist() == [472, 417]
    assert rec.output_tokens.tolist() == [18, 276]
    assert rec.timestamps_s.tolist() == [5.0, 118.0]
    assert rec.dropped_failed == 2 and rec.skipped_rows == 1
    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("Timestamp,Model\n1,x\n")
    with pytest.raises(WorkloadError, match="missing column"):
        load_burstgpt(bad_header)


# -- Mooncake -------------------------------------------------------------------------------


def _mooncake(tmp_path: Path, extra: str = "") -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1030, "output_length": 12, "hash_ids": [1, 2, 4]},
        {"timestamp": 1000, "input_length": 512, "output_length": 8, "hash_ids": [1]},
        {"timestamp": 2000, "input_length": 700, "output_length": 9, "hash_ids": [5, 6]},
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra)
    return path


def test_mooncake_loader_errors(tmp_path):
    path = _mooncake(
        tmp_path,
        '{"timestamp": 3000, "input_length": 600, "output_length": 4, "hash_ids": [7]}\n{bad json\n',
    )
    with pytest.raises(WorkloadError, match=r"mooncake.jsonl:5: 1 hash_ids for input_length 600"):
        load_mooncake(path)
    rec = load_mooncake(path, skip_malformed=True)
    assert len(rec) == 4 and rec.skipped_rows == 2
    assert rec.timestamps_s.tolist() == [0.0, 0.5, 1.0, 2.0]


def test_mooncake_blocks_share_tokens(tmp_path, tiny_tokenizer):
    path = _mooncake(tmp_path)
    spec = tmp_path / "mc.yaml"
    spec.write_text(
        f"name: mc\nnum_requests: null\nsource: {{kind: trace, format: mooncake, path: {path.name}}}\narrivals: {{process: trace}}\n"
    )
    w = resolve_workload(
        str(spec), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
    )
    t = w.table.to_pydict()
    assert t["input_tokens"] == [1100, 1030, 512, 700]
    assert t["arrival_s"] == [0.0, 0.5, 1.0, 2.0]
    ids = t["prompt_token_ids"]
    for text, row in zip(t["prompt"], ids, strict=True):
        assert tiny_tokenizer.encode(text) == row
    assert ids[0][:1024] == ids[1][:1024]  # hash ids 1, 2 shared
    assert ids[0][1024:1030] != ids[1][1024:1030]  # 3 vs 4
    assert ids[2] == ids[0][:512]
    assert ids[3][:512] != ids[0][:512]
    assert w.manifest["prompt_check"]["mismatched"] == 0


def test_trace_lengths_with_own_arrivals(tmp_path, tiny_tokenizer):
    path = tmp_path / "burst.csv"
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows += [f"{i * 3},ChatGPT,{10 + i},{5 + i},{15 + 2 * i},Conversation log" for i in range(20)]
    path.write_text("\n".join(rows) + "\n")
    spec = tmp_path / "b.yaml"
    spec.write_text(
        f"name: b\nnum_requests: 30\nsource: {{kind: trace, format: burstgpt, path: {path.name}}}\n"
        "arrivals: {process: trace, speedup: 3}\n"
    )
    # recorded timestamps: the 20 rows, 3 s apart, sped up 3x
    w = resolve_workload(
        str(spec), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
    )
    assert w.table.column("arrival_s").to_pylist() == [float(i) for i in range(20)]
    # a request rate replaces the timestamps; rows are reused in order
    w = resolve_workload(
        str(spec),
        options=WorkloadOptions(request_rate=10.0),
        tokenizer=tiny_tokenizer,
        use_cache=False,
    )
    assert w.table.num_rows == 30
    assert w.table.column("input_tokens").to_pylist() == [10 + i % 20 for i in range(30)]
    assert w.table.column("arrival_s").to_pylist()[-1] == pytest.approx(3.0)
    with pytest.raises(WorkloadError, match="drop input_len"):
        resolve_workload(
            str(spec),
            options=WorkloadOptions(input_len=5),
            tokenizer=tiny_tokenizer,
            use_cache=False,
        )
    fixed = resolve_workload(
        str(spec), options=WorkloadOptions(output_len=9), tokenizer=tiny_tokenizer, use_cache=False
    )
    assert set(fixed.table.column("max_output_tokens").to_pylist()) == {9}


def test_fast_csv_readers_agree_with_row_readers(tmp_path):
    burst = tmp_path / "ok.csv"
    burst.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5.5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n"
    )
    fast, rows = load_burstgpt(burst), _burstgpt_rows(burst, False)
    assert fast.timestamps_s.tolist() == rows.timestamps_s.tolist() == [5.5, 118.0]
    assert fast.input_tokens.tolist() == rows.input_tokens.tolist() == [472, 417]
    assert fast.dropped_failed == rows.dropped_failed == 1
    azure = tmp_path / "az.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    fast, rows = load_azure(azure), _azure_rows(azure, False)
    assert fast.input_tokens.tolist() == rows.input_tokens.tolist() == [374, 396]
    assert np.allclose(fast.timestamps_s, rows.timestamps_s, atol=1e-6)


def test_burstgpt_model_filter_like_vllm(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "1,ChatGPT,10,5,15,Conversation log\n"
        "2,GPT-4,20,6,26,Conversation log\n"
        "3,GPT-4,30,0,30,API log\n"
        "4,GPT-4,40,8,48,API log\n"
    )
    rec = load_burstgpt(path, model="GPT-4")
    assert rec.input_tokens.tolist() == [20, 40]
    assert rec.filtered_rows == 1 and rec.dropped_failed == 1
    rows = _burstgpt_rows(path, False, "GPT-4", None)
    assert rows.input_tokens.tolist() == [20, 40] and rows.filtered_rows == 1
    assert load_burstgpt(path, log_type="API log").input_tokens.tolist() == [40]
    with pytest.raises(WorkloadError, match="takes no model filter"):
        load_trace("azure", path, model="GPT-4")


def test_trace_bootstrap_and_jitter(tmp_path, tiny_tokenizer):
    path = tmp_path / "burst.csv"
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows += [f"{i},GPT-4,{10 + i},{100 + i},{110 + 2 * i},API log" for i in range(50)]
    path.write_text("\n".join(rows) + "\n")
    spec = tmp_path / "b.yaml"
    spec.write_text(
        f"name: b\nnum_requests: 40\nsource: {{kind: trace, format: burstgpt, path: {path.name}, sample: bootstrap}}\n"
        "arrivals: {process: poisson, rate: 5}\n"
    )
    w = resolve_workload(
        str(spec), options=WorkloadOptions(seed=1), tokenizer=tiny_tokenizer, use_cache=False
    )
    ins = w.table.column("input_tokens").to_pylist()
    outs = w.table.column("max_output_tokens").to_pylist()
    assert all(o - i == 90 for i, o in zip(ins, outs, strict=True))  # rows sampled jointly
    assert len(set(ins)) < 40  # with replacement
    jit = tmp_path / "j.yaml"
    jit.write_text(
        f"name: j\nsource: {{kind: trace, format: burstgpt, path: {path.name}}}\n"
        "arrivals: {process: trace, jitter_s: 2.0}\n"
    )
    w = resolve_workload(
        str(jit), options=WorkloadOptions(), tokenizer=tiny_tokenizer, use_cache=False
    )
    times = w.table.column("arrival_s").to_pylist()
    ins = w.table.column("input_tokens").to_pylist()
    outs = w.table.column("max_output_tokens").to_pylist()
    assert times == sorted(times) and len(times) == 50
    assert ins != sorted(ins)  # re-ordered by the jittered times ...
    assert all(o - i == 90 for i, o in zip(ins, outs, strict=True))  # ... keeping each row whole
