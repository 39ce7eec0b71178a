"""The embeddings and rerank APIs on the wire: the request bodies and the checks of the answers.

Both answer whole (never streamed), so a request's only latency is its own (sent -> done) and
its tokens are its inputs'. Bodies:

- `/embeddings` (OpenAI): `{"model", "input": [texts], "encoding_format": "float"}`; the
  answer's `data` holds one `{"index", "embedding": [floats]}` per input.
- `/rerank` (the Jina/Cohere shape vLLM and TEI serve): `{"model", "query", "documents":
  [texts]}`; the answer's `results` holds `{"index", "relevance_score"}`, one per document
  (the client never sends `top_n`, so every document is scored).

An answer of the wrong shape (a count that is not the batch's, vectors of unequal length, a
number that is not finite, an index out of range or repeated) is an error of class
`malformed_json` with one sentence saying what was wrong: the server answered 200 with
something a client could not use.

A dense request's texts travel in its RequestSpec row under `DENSE_INPUTS` (the batch's
texts) and, for rerank, `DENSE_QUERY` (see `harness.run.dense_plan`); a row without them sends
its own prompt as a batch of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

from slo.runrecord import Endpoint, ErrorClass

DENSE_INPUTS = "dense_inputs"  # RequestSpec row key: the texts of the batch
DENSE_QUERY = "dense_query"  # RequestSpec row key: the rerank query


def dense_fields(endpoint: Endpoint, model: str, spec: dict, extra_body: dict | None) -> dict:
    """The JSON body of one RequestSpec row for `/embeddings` or `/rerank`, as a dict."""
    texts = list(spec.get(DENSE_INPUTS) or [spec["prompt"]])
    body: dict
    if endpoint is Endpoint.EMBEDDINGS:
        body = {"model": model, "input": texts, "encoding_format": "float"}
    else:
        query = spec.get(DENSE_QUERY)
        body = {"model": model, "query": spec["prompt"] if query is None else query}
        body["documents"] = texts
    if spec.get("tenant") is not None:
        body["user"] = spec["tenant"]
    if extra_body:
        body.update(extra_body)
    return body


@dataclass(frozen=True, slots=True)
class DenseAnswer:
    """What one dense answer said: its usage and id, and what was wrong with it (None: its
    shape is right). `count` is the vectors (embeddings) or scores (rerank) it held; `dim`
    the embeddings' length."""

    usage: dict | None = None
    response_id: str | None = None
    count: int | None = None
    dim: int | None = None
    error_message: str | None = None

    @property
    def error_class(self) -> ErrorClass | None:
        return None if self.error_message is None else ErrorClass.MALFORMED_JSON


def check_answer(body: bytes, endpoint: Endpoint, expected: int | None) -> DenseAnswer:
    """Parse and check one 200 answer of `endpoint`; `expected` is the number of inputs (or
    documents) the request sent, None when unknown (the count is then only checked to be at
    least one)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return DenseAnswer(error_message=f"the response is not JSON: {body[:60]!r}")
    if not isinstance(obj, dict):
        return DenseAnswer(error_message="the response is not a JSON object")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    response_id = obj["id"] if isinstance(obj.get("id"), str) else None
    if endpoint is Endpoint.EMBEDDINGS:
        count, dim, problem = _check_embeddings(obj.get("data"), expected)
    else:
        count, dim, problem = _check_rerank(obj.get("results"), expected)
    return DenseAnswer(usage, response_id, count, dim, problem)


def _count_problem(what: str, count: int, expected: int | None) -> str | None:
    if expected is not None and count != expected:
        return f"the response holds {count} {what} for {expected} sent"
    if count == 0:
        return f"the response holds no {what}"
    return None


def _check_indices(indices: list, count: int, what: str) -> str | None:
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        return f"{what} index {bad[0]!r} is not an integer"
    out_of_range = [i for i in indices if not 0 <= i < count]
    if out_of_range:
        return f"{what} index {out_of_range[0]} is outside 0..{count - 1}"
    if len(set(indices)) != len(indices):
        return f"the response repeats a {what} index"
    return None


def _finite_numbers(values: list) -> bool:
    return all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )


def _check_embeddings(data, expected: int | None) -> tuple[int | None, int | None, str | None]:
    if not isinstance(data, list):
        return None, None, "the response lacks a data list"
    count = len(data)
    problem = _count_problem("embeddings", count, expected)
    if problem:
        return count, None, problem
    vectors, indices = [], []
    for item in data:
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(vector, list) or not vector:
            return count, None, "an embedding is not a non-empty list of numbers"
        vectors.append(vector)
        indices.append(item.get("index", len(indices)))
    dims = {len(v) for v in vectors}
    if len(dims) > 1:
        return count, None, f"the embeddings differ in length ({min(dims)} to {max(dims)})"
    if not all(_finite_numbers(v) for v in vectors):
        return count, None, "an embedding holds a value that is not a finite number"
    problem = _check_indices(indices, count, "embedding")
    return count, dims.pop(), problem


def _check_rerank(results, expected: int | None) -> tuple[int | None, None, str | None]:
    if not isinstance(results, list):
        return None, None, "the response lacks a results list"
    count = len(results)
    problem = _count_problem("scores", count, expected)
    if problem:
        return count, None, problem
    if not all(isinstance(r, dict) for r in results):
        return count, None, "a rerank result is not an object"
    scores = [r.get("relevance_score") for r in results]
    if not _finite_numbers(scores):
        return count, None, "a relevance_score is not a finite number"
    return count, None, _check_indices([r.get("index") for r in results], count, "document")
