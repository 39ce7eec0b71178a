"""The bad-input case table: every request `bench probe bad-input` sends, and what answer passes.

A case is data (`case.ProbeCase`): a method, a path under the server's root, a body (bytes, or
a `LazyBody` streamed in pieces), headers, and an `Expect` saying which answers are acceptable.
The common expectation is `REJECT`: a 4xx whose body is `{"error": {"message": ...}}`. `EITHER`
also accepts a 200 with a well-formed completion, for requests a server may legitimately serve
(unknown fields, an empty prompt, an extension field it does not implement). `LIMIT` cases
(oversized body or header) may be refused at the HTTP layer, so any 4xx passes, and so does a
closed connection. Whatever the answer, the server must stay healthy afterwards (`probe.py`).

The cases live by kind: `syntax` (malformed JSON, wrong types, missing fields, encoding),
`numeric` (numeric extremes, and the rule for which must be rejected), `sizes` (sizes, nesting,
HTTP limits), `api` (unknown model, messages, unknown fields, methods, content types) and
`events` (the Responses and Messages routes) and `dense` (the embeddings and rerank routes),
each reported as not served where a server lacks the route.
"""

from __future__ import annotations

from faults.probe_cases import api, dense, events, numeric, sizes, syntax
from faults.probe_cases.case import ProbeCase


def build_cases(model: str) -> tuple[ProbeCase, ...]:
    """Every case, in the order they run, for a server serving `model`."""
    builders = (
        syntax.malformed_json,
        syntax.wrong_types,
        syntax.missing_fields,
        numeric.numeric_extremes,
        sizes.sizes,
        sizes.nesting,
        syntax.encoding,
        sizes.limits,
        api.unknown_model,
        api.messages,
        api.unknown_fields,
        api.methods,
        api.content_types,
        events.event_apis,
        dense.dense_apis,
    )
    cases = tuple(case for build in builders for case in build(model))
    names = [case.name for case in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Probe case names must be unique; repeated: {', '.join(duplicates)}.")
    return cases
