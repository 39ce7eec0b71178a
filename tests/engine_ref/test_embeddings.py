"""The reference server's `/v1/embeddings` and `/v1/rerank` on tiny-random: the pooled vector
against Hugging Face's own forward of the same weights, rerank scores as the cosine of those
vectors, the bounds (texts a request, tokens a text) just below, at and above, and `bench run`
driving both routes with every request ok."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from server_fixtures import running_server

from engine_ref.core.engine_config import EngineConfig
from engine_ref.serving.embeddings import MAX_DENSE_TEXTS
from engine_ref.serving.interface import EngineError, pooled_embeddings
from engine_ref.serving.server import ServerConfig
from faults.probe import ProbeConfig, run_probe
from faults.probe_cases.case import Category
from faults.probe_report import Verdict
from harness.run.config import RunConfig
from harness.run.orchestrator import run_benchmark

CONTEXT = 64  # max_model_len: small, so the context bound is cheap to reach
TEXTS = ["the quick brown fox", "jumps over", "a lazy dog and more words here"]


@pytest.fixture(scope="module")
def server_url():
    engine = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_threads=1,
                          kv_cache_memory_bytes=512 * 16 * 1024, max_model_len=CONTEXT)  # fmt: skip
    with running_server(ServerConfig(engine=engine, port=0)) as url:
        yield url


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def hf_vectors(tiny_model, tiny_tokenizer):
    """Each of TEXTS pooled by Hugging Face's LlamaModel on tiny-random's weights: the final
    norm's output (its `last_hidden_state`), mean over tokens, unit length."""
    transformers = pytest.importorskip("transformers")
    from engine_ref.loading.export import hf_config_dict

    config = transformers.LlamaConfig(**hf_config_dict(tiny_model, torch.float32))
    model = transformers.LlamaModel(config).eval()
    state = {k.removeprefix("model."): t for k, t in tiny_model.state_dict.items()}
    model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=True)
    out = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tiny_tokenizer.encode(text)])
            out.append(F.normalize(model(ids).last_hidden_state[0].mean(dim=0), dim=0))
    return out


def test_embeddings_match_hugging_face_mean_pooling(server_url, hf_vectors, tiny_tokenizer):
    status, body = _post(server_url, "/v1/embeddings", {"model": "tiny-random", "input": TEXTS})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for item, expected in zip(body["data"], hf_vectors, strict=True):
        got = torch.tensor(item["embedding"])
        assert got.shape == (64,)  # tiny-random's hidden size
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
    tokens = sum(len(tiny_tokenizer.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_scores_are_cosines_best_first(server_url, hf_vectors):
    query, *documents = TEXTS
    status, body = _post(server_url, "/v1/rerank", {"query": query, "documents": documents,
                                                     "return_documents": True})  # fmt: skip
    assert status == 200, body
    expected = [float(hf_vectors[0] @ hf_vectors[i + 1]) for i in range(len(documents))]
    order = sorted(range(len(documents)), key=lambda i: -expected[i])
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": documents[result["index"]]}
    status, top = _post(server_url, "/v1/rerank", {"query": query, "documents": documents, "top_n": 1})  # fmt: skip
    assert status == 200 and [r["index"] for r in top["results"]] == order[:1]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": [" a"]}, 200, None),  # batch 1
        ({"input": [" a"] * MAX_DENSE_TEXTS}, 200, None),  # batch at the bound
        (
            {"input": [" a"] * (MAX_DENSE_TEXTS + 1)},
            400,
            f"input has {MAX_DENSE_TEXTS + 1} texts; at most {MAX_DENSE_TEXTS}",
        ),  # fmt: skip
        ({"input": []}, 400, "input must be a string or a non-empty list of strings."),
        ({"input": [""]}, 400, "input[0] is empty: there is no token to pool."),
        ({"input": ["a", 7]}, 400, "input[1] must be a string, got int."),
        ({"input": " a" * CONTEXT}, 200, None),  # exactly the context length
        (
            {"input": " a" * (CONTEXT + 1)},
            400,
            f"input[0] has {CONTEXT + 1} tokens, more than this model's context length of {CONTEXT}",
        ),  # fmt: skip
        (
            {"input": "x", "encoding_format": "hex"},
            400,
            "encoding_format must be one of float, base64.",
        ),  # fmt: skip
        ({"input": "x", "model": "other"}, 404, "does not exist"),
    ],
)
def test_embeddings_bounds(server_url, body, status, message):
    got_status, answer = _post(server_url, "/v1/embeddings", body)
    assert got_status == status, answer
    if message is None:
        assert len(answer["data"]) == len(body["input"]) if isinstance(body["input"], list) else 1
    else:
        assert message in answer["error"]["message"]
        assert answer["error"]["message"].count(".") >= 1 and "Traceback" not in json.dumps(answer)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"documents": ["a"]}, "query must be a string."),
        ({"query": "q", "documents": []}, "documents must be a non-empty list of strings."),
        ({"query": "q", "documents": "a"}, "documents must be a non-empty list of strings."),
        (
            {"query": "q", "documents": ["a"], "top_n": 0},
            "top_n must be a whole number of at least 1.",
        ),  # fmt: skip
        ({"query": " a" * (CONTEXT + 1), "documents": ["a"]}, "query has 65 tokens"),
    ],
)
def test_rerank_bad_input_is_a_400_sentence(server_url, body, message):
    status, answer = _post(server_url, "/v1/rerank", body)
    assert status == 400 and message in answer["error"]["message"]


def test_an_engine_without_a_model_does_not_serve_embeddings():
    with pytest.raises(EngineError, match="does not serve embeddings"):
        pooled_embeddings(object(), [[1, 2]])


@pytest.mark.parametrize("endpoint", ["embeddings", "rerank"])
def test_bench_run_against_the_reference_server_all_ok(server_url, tmp_path, endpoint):
    config = RunConfig(url=server_url + "/v1", endpoint=endpoint, workload="random", input_len=12,
                       num_requests=12, request_rate=float("inf"), batch_size=3,
                       tokenizer="tiny-random", out=tmp_path / "run")  # fmt: skip
    outcome = run_benchmark(config)
    req = pq.read_table(outcome.run_dir / "requests.parquet").to_pydict()
    assert req["status"] == ["ok"] * 12 and req["num_texts"] == [3] * 12
    # the server's count and the run's agree: the same tokenizer counted the same texts
    assert req["usage_prompt_tokens"] == req["input_tokens"]
    assert outcome.summary.dense.api == endpoint


def test_the_bad_input_probe_of_the_dense_routes_passes(server_url):
    config = ProbeConfig(url=server_url, only=frozenset({Category.DENSE_APIS}), timeout_s=30)
    report = asyncio.run(run_probe(config))
    assert len(report.results) == 19
    assert {r.name: r.reason for r in report.failed} == {}
    assert all(r.verdict is Verdict.PASS for r in report.results)
    assert report.streams.passed


def test_queued_pool_commands_run_one_an_iteration_each_answered_in_its_own_batch():
    """Embedding requests that queue while a pooled forward runs are answered one batch each,
    not all in one iteration: `bench run --endpoint embeddings` on SmolLM2 once had 49 of 50
    answers released together, 70 s after they were sent, behind one long iteration."""
    from engine_ref.serving.engine_loop import EngineDriver, Pool
    from engine_ref.serving.interface import build_engine

    engine = build_engine(EngineConfig(model="tiny-random", dtype="float32", device="cpu",
                                       num_threads=1, kv_cache_memory_bytes=64 * 16 * 1024))  # fmt: skip
    driver = EngineDriver(engine)
    batches = [driver.run_iteration([Pool(f"g{i}", ((1, 2, 3 + i),)) for i in range(3)])]
    while driver.has_work() and len(batches) < 10:
        batches.append(driver.run_iteration([]))
    assert [list(batch.pooled) for batch in batches] == [["g0"], ["g1"], ["g2"]]
    assert not driver.has_work()
    vectors = [batch.pooled[f"g{i}"] for i, batch in enumerate(batches)]
    assert all(len(v) == 1 and abs(sum(x * x for x in v[0]) - 1) < 1e-5 for v in vectors)
