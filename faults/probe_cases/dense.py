"""Bad requests to the embeddings (`/v1/embeddings`) and rerank (`/v1/rerank`) routes: a
malformed body, a missing or empty list of texts, texts that are not strings, an input longer
than any context, a bad `encoding_format` or `top_n`, an unknown model. Every one must be
rejected with a 4xx and an error body.

A generation server may serve neither route: `route_checks` holds one well-formed request per
route, and a route that answers it 404 (or 405) has its cases reported as not served
(`faults.probe_routes`). Every wrong value is one the OpenAI embeddings API and the Jina/Cohere
rerank shape both leave no room for (a list of token ids is a valid embeddings input, so the
non-string case mixes a string and a number).
"""

from __future__ import annotations

from typing import Any

from faults.probe_cases.case import DROP, REJECT, Category, ProbeCase, encode

EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
# An input of about 150,000 tokens (900,000 characters): over any common context, under the
# usual body limits.
OVER_CONTEXT_WORDS = 150_000


def _merged(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in {**base, **fields}.items() if v is not DROP}


def embeddings_body(model: str, /, **fields: Any) -> dict[str, Any]:
    """A well-formed embeddings request with `fields` replaced (`DROP` removes one)."""
    return _merged({"model": model, "input": ["Hello", "World"]}, fields)


def rerank_body(model: str, /, **fields: Any) -> dict[str, Any]:
    """A well-formed rerank request with `fields` replaced (`DROP` removes one)."""
    return _merged({"model": model, "query": "Hello", "documents": ["Hello", "World"]}, fields)


def route_checks(model: str) -> dict[str, tuple[bytes, tuple[tuple[str, str], ...]]]:
    """route -> (a well-formed body, its headers): what tells whether a server serves it."""
    return {
        EMBEDDINGS: (encode(embeddings_body(model)), ()),
        RERANK: (encode(rerank_body(model)), ()),
    }


def dense_apis(model: str) -> list[ProbeCase]:
    cat = Category.DENSE_APIS

    def embeddings(name: str, summary: str, body: bytes | None = None, **fields) -> ProbeCase:
        body = encode(embeddings_body(model, **fields)) if body is None else body
        return ProbeCase(f"embeddings-{name}", cat, summary, REJECT, body, path=EMBEDDINGS)

    def rerank(name: str, summary: str, body: bytes | None = None, **fields) -> ProbeCase:
        body = encode(rerank_body(model, **fields)) if body is None else body
        return ProbeCase(f"rerank-{name}", cat, summary, REJECT, body, path=RERANK)

    other = "no-such-model-probe"
    long_text = "Hello " * OVER_CONTEXT_WORDS
    return [
        embeddings("truncated-json", "body cut mid-string", encode(embeddings_body(model))[:-6]),
        embeddings("input-missing", "no input", input=DROP),
        embeddings("input-null", "input: null", input=None),
        embeddings("input-empty-list", "input: []", input=[]),
        embeddings("input-number", "input: 42", input=42),
        embeddings("input-mixed", 'input: ["Hello", 7]', input=["Hello", 7]),
        embeddings("input-object", 'input: [{"text": "Hello"}]', input=[{"text": "Hello"}]),
        embeddings("input-over-context", f"input: one text of {OVER_CONTEXT_WORDS:,} words", input=[long_text]),
        embeddings("encoding-format-hex", 'encoding_format: "hex"', encoding_format="hex"),
        embeddings("unknown-model", f"model: {other!r}", model=other),
        rerank("truncated-json", "body cut mid-string", encode(rerank_body(model))[:-6]),
        rerank("query-missing", "no query", query=DROP),
        rerank("query-number", "query: 42", query=42),
        rerank("documents-missing", "no documents", documents=DROP),
        rerank("documents-empty-list", "documents: []", documents=[]),
        rerank("documents-number", "documents: 42", documents=42),
        rerank("documents-mixed", 'documents: ["Hello", 7]', documents=["Hello", 7]),
        rerank("top-n-word", 'top_n: "many"', top_n="many"),
        rerank("unknown-model", f"model: {other!r}", model=other),
    ]  # fmt: skip
