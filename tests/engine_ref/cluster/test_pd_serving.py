"""The router in P/D mode (--prefill-workers 1 --decode-workers 1), through HTTP and `bench run`:
greedy outputs equal a single engine's (completions and chat, streamed and not, prompts just
below, at and above a block, max_tokens 1 and 2), the stream is one well-formed response with
the `kv_transfer` usage extension, a flipped bit on the KV link is caught by its checksum and
the request recomputed with the same output, and no worker holds a KV block afterwards.
A stream asking for usage in every chunk (`bench run`'s default) is handed off too, each chunk's
usage the single engine's; every answer names its worker (`x-bench-worker`, and the decode
worker and its install time in `kv_transfer`).

One P/D cluster (fault injection on) and one single server serve the whole module."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from cluster_util import bench_run_mixed_checked, post_json, request, sse_events
from pd_cluster import assert_no_block_held, running_pd_cluster, samples, transfers
from server_fixtures import running_server

from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.server import ServerConfig

pytestmark = pytest.mark.slow  # starts worker processes

ENGINE = EngineConfig(model="tiny-random", dtype="float32", num_blocks=128, max_num_seqs=8)
BLOCK = ENGINE.block_size  # 16


@pytest.fixture(scope="module")
def cluster():
    config = ServerConfig(engine=ENGINE, port=0, enable_fault_injection=True)
    with running_pd_cluster(config, prefill=1, decode=1) as url:
        yield url


@pytest.fixture(scope="module")
def single():
    with running_server(ServerConfig(engine=ENGINE, port=0)) as url:
        yield url


@pytest.fixture(autouse=True)
def no_leaked_block(cluster):
    yield
    assert_no_block_held(cluster)


def _body(kind: str, length: int, max_tokens: int) -> tuple[str, dict]:
    common = {"model": "tiny-random", "max_tokens": max_tokens, "temperature": 0,
              "ignore_eos": True, "logprobs": 2 if kind == "completions" else None}  # fmt: skip
    if kind == "chat":
        words = " ".join(f"w{i}" for i in range(length))
        return "/v1/chat/completions", {
            **common, "messages": [{"role": "user", "content": words}], "logprobs": True,
            "top_logprobs": 2,
        }  # fmt: skip
    prompt = [(7 * i + 3) % 500 + 3 for i in range(length)]  # token ids: exactly `length`
    return "/v1/completions", {**common, "prompt": prompt, "return_token_ids": True}


def _answer(url: str, path: str, body: dict) -> tuple:
    """(text, token ids, logprobs, finish_reason, usage) of a non-streamed answer."""
    status, answer = post_json(url, path, body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice.get("token_ids"), choice["logprobs"], choice["finish_reason"], answer


def _streamed(url: str, path: str, body: dict) -> tuple:
    body = {**body, "stream_options": {"include_usage": True}}
    events = sse_events(url, path, body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    usage_chunks = [e for e in events[:-1] if not e["choices"]]
    assert len(usage_chunks) == 1 and all(c["usage"] is None for c in chunks)
    assert len({e["id"] for e in events[:-1]}) == 1  # one response, whoever served the part
    choices = [c["choices"][0] for c in chunks]
    roles = [c["delta"]["role"] for c in choices if "role" in c.get("delta", {})]
    assert roles == (["assistant"] if "chat" in path else [])
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    text = "".join(c["delta"].get("content") or "" if "delta" in c else c["text"] for c in choices)
    ids = [t for c in choices for t in c.get("token_ids") or []] or None
    return text, ids, choices[-1]["finish_reason"], usage_chunks[0]["usage"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("length", [BLOCK - 1, BLOCK, BLOCK + 1])
@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_greedy_outputs_equal_a_single_engine(cluster, single, kind, length, max_tokens):
    path, body = _body(kind, length, max_tokens)
    ours, theirs = _answer(cluster, path, body), _answer(single, path, body)
    assert ours[:4] == theirs[:4]  # text, token ids, logprobs (offsets included), finish
    usage, expected = ours[4]["usage"], theirs[4]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        expected["prompt_tokens"], max_tokens,
    )  # fmt: skip
    kv = usage.get("kv_transfer")
    if max_tokens == 1:  # ends at its first token: never handed off
        assert kv is None
    else:
        assert kv["ok"] is True and kv["error"] is None and kv["retried"] is None
        assert kv["bytes"] > 0 and kv["worker"] == "prefill-0"
        assert kv["transfer_ms"] >= 0 and kv["prefill_ms"] >= 0
        assert kv["decode_worker"] == "decode-0" and kv["install_ms"] >= 0
        assert "first_token_ids" not in kv
    streamed, reference = _streamed(cluster, path, body), _streamed(single, path, body)
    assert streamed[:3] == reference[:3]
    assert streamed[3]["completion_tokens"] == max_tokens


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_is_handed_off_and_reads_as_a_single_engines(cluster, single, kind):
    # vLLM's continuous_usage_stats (`bench run`'s default): usage in every chunk.
    path, body = _body(kind, BLOCK + 1, 4)
    body = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    before = transfers(cluster).get(("1", "ok"), 0)
    ours, theirs = sse_events(cluster, path, body), sse_events(single, path, body)
    assert transfers(cluster).get(("1", "ok"), 0) == before + 1  # a handoff really happened
    usages = [e["usage"] for e in ours[:-1]]
    assert [_without_kv(u) for u in usages] == [_without_kv(e["usage"]) for e in theirs[:-1]]
    # A finished request's kv_memory, on the same chunks (the decode worker's own record).
    assert ["kv_memory" in u for u in usages] == ["kv_memory" in e["usage"] for e in theirs[:-1]]
    prompt = usages[0]["prompt_tokens"]
    # Chunk for chunk: (chat: the role chunk, 0 tokens), then 1, 2, 3, 4 tokens, then the final.
    counts = [u["completion_tokens"] for u in usages]
    assert counts == ([0] if kind == "chat" else []) + [1, 2, 3, 4, 4]
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    assert ["kv_transfer" in u for u in usages] == [False] * (len(usages) - 1) + [True]
    assert usages[-1]["kv_transfer"]["ok"] is True


def _without_kv(usage: dict) -> dict:
    """A usage without the router's kv_transfer extension (the final one has it) and the
    serving worker's kv_memory record (a decode worker ran fewer steps than one engine)."""
    return {k: v for k, v in usage.items() if k not in ("kv_transfer", "kv_memory")}


@pytest.mark.parametrize(("max_tokens", "stream"), [(1, False), (3, False), (1, True), (3, True)])
def test_each_answer_names_the_worker_that_served_it(cluster, max_tokens, stream):
    path, body = _body("completions", 20, max_tokens)
    body = {**body, "stream": stream, "stream_options": {"include_usage": True}}
    if not stream:
        body.pop("stream_options")
    status, headers, raw = request(cluster, path, body)
    assert status == 200
    if stream:  # the headers went out before the prefill leg: they name the decode worker
        assert headers["x-bench-worker"] == "decode-0"
        usage = json.loads(raw.decode().split("data: ")[-2])["usage"]
    else:  # the worker that answered last
        assert headers["x-bench-worker"] == ("prefill-0" if max_tokens == 1 else "decode-0")
        usage = json.loads(raw)["usage"]
    kv = usage.get("kv_transfer")
    if max_tokens == 1:
        assert kv is None
    else:
        assert kv["decode_worker"] == "decode-0" and kv["worker"] == "prefill-0"
        assert isinstance(kv["install_ms"], float) and kv["install_ms"] >= 0


def test_a_request_ending_at_its_first_token_never_reaches_the_decode_worker(cluster):
    before = transfers(cluster)
    path, body = _body("completions", 5, 1)
    assert _answer(cluster, path, body)[3] == "length"
    assert transfers(cluster) == before


def test_a_flipped_bit_on_the_link_is_caught_and_the_request_recomputed(cluster, single):
    path, body = _body("completions", BLOCK + 1, 6)
    # A prompt whose first output token is a whole character: a recompute's text equals the
    # single engine's then (docs/CONTRACTS.md: a first token holding part of a character).
    body["prompt"] = "The cat sat on the mat, and the dog sat on the log."
    faulty = {**body, "kv_transfer_params": {"fault": "flip_bit"}}
    before = transfers(cluster)
    ours, theirs = _answer(cluster, path, faulty), _answer(single, path, body)
    assert ours[:4] == theirs[:4]
    kv = ours[4]["usage"]["kv_transfer"]
    assert kv["ok"] is False and kv["retried"] == "recompute"
    assert "block 0 failed its CRC-32C checksum" in kv["error"]
    assert kv["decode_worker"] == "decode-0" and kv["install_ms"] is None  # nothing installed
    assert ours[4]["usage"]["completion_tokens"] == 6
    after = transfers(cluster)
    assert after.get(("1", "failed"), 0) - before.get(("1", "failed"), 0) == 1
    assert after.get(("1", "recomputed"), 0) - before.get(("1", "recomputed"), 0) == 1
    assert after.get(("1", "ok"), 0) == before.get(("1", "ok"), 0)  # never installed
    # Streamed: the first token reached the client before the transfer failed.
    streamed = _streamed(cluster, path, faulty)
    assert streamed[:3] == _streamed(single, path, body)[:3]
    assert streamed[3]["kv_transfer"]["retried"] == "recompute"
    # Usage in every chunk: the recompute worker counts the first token as prompt; the chunks
    # read as the single engine's all the same (1 to 6 tokens, then the final usage).
    continuous = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ours = sse_events(cluster, path, {**faulty, **continuous})
    theirs = sse_events(single, path, {**body, **continuous})
    usages = [_without_kv(e["usage"]) for e in ours[:-1]]
    assert usages == [_without_kv(e["usage"]) for e in theirs[:-1]]
    assert [u["completion_tokens"] for u in usages] == [1, 2, 3, 4, 5, 6, 6]
    assert ours[-2]["usage"]["kv_transfer"]["retried"] == "recompute"


def test_a_client_cannot_set_the_transfer_itself(cluster, single):
    path, body = _body("completions", 4, 3)
    forged = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "x"}}
    assert _answer(cluster, path, forged)[:4] == _answer(single, path, body)[:4]


def test_dense_routes_and_other_apis_go_to_a_decode_worker(cluster, single):
    body = {"model": "tiny-random", "input": "hello there"}
    status, ours = post_json(cluster, "/v1/embeddings", body)
    assert status == 200
    (theirs,) = post_json(single, "/v1/embeddings", body)[1]["data"]
    # Another thread count sums in another order: equal to float32 rounding.
    assert ours["data"][0]["embedding"] == pytest.approx(theirs["embedding"], abs=1e-5)
    chat = {"model": "tiny-random", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}], "n": 2}  # fmt: skip
    status, answer = post_json(cluster, "/v1/chat/completions", chat)
    assert status == 200 and len(answer["choices"]) == 2 and "kv_transfer" not in answer["usage"]
    routed = {
        s.labels["worker"]: s.value for s in samples(cluster) if s.name == "router_requests_total"
    }
    assert routed["1"] >= 2  # the decode worker took both


def test_info_and_metrics_describe_the_layout(cluster):
    status, info = post_json(cluster, "/info", None)
    assert status == 200
    pd = info["cluster"]["pd"]
    assert len(pd["prefill_workers"]) == 1 and len(pd["decode_workers"]) == 1
    assert isinstance(pd["decode_workers"][0]["kv_port"], int)
    _answer(cluster, *_body("completions", 20, 3))
    found = samples(cluster)
    assert any(
        s.name == "router_kv_transfers_total" and s.labels == {"worker": "1", "result": "ok"}
        and s.value >= 1 for s in found
    )  # fmt: skip
    nbytes = [s for s in found if s.name == "router_kv_transfer_bytes_total"]
    assert [s.labels["worker"] for s in nbytes] == ["1"] and nbytes[0].value > 0


def test_bench_run_checks_the_outputs_through_the_pd_router(cluster, tmp_path):
    out = tmp_path / "run"
    before = transfers(cluster).get(("1", "ok"), 0)
    bench_run_mixed_checked(cluster, out)
    # Its default options (usage in every chunk) are prefilled and decoded apart: each of the
    # 4 requests was handed off once.
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert all(r["kv_transfer_bytes"] > 0 and r["kv_transfer_ok"] is True for r in rows), rows
    assert transfers(cluster).get(("1", "ok"), 0) == before + 4


def test_a_bad_transfer_field_on_a_worker_is_one_sentence(cluster):
    status, info = post_json(cluster, "/info", None)
    worker = info["cluster"]["pd"]["prefill_workers"][0]
    path, body = _body("completions", 4, 3)
    for params in (
        {"do_remote_decode": True},
        "yes",
        {"do_remote_prefill": True, "transfer_id": "t"},
    ):
        status, _, raw = request(worker, path, {**body, "kv_transfer_params": params})
        assert status == 400
        message = json.loads(raw)["error"]["message"]
        assert message.endswith(".") and "kv_transfer_params" in message
