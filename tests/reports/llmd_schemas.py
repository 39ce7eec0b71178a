"""The llm-d Benchmark Report JSON Schemas the export tests validate against. They are fetched
data (llm-d/llm-d-benchmark, Apache-2.0), kept beside the clone in `../shared/data/llm-d-benchmark`
(its README names each file's source commit and sha256), not in the project: a test that needs
one skips with the allow-listed reason when the folder is not there."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

SCHEMA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "llm-d-benchmark"
V0_2_1 = "br_v0_2_1_json_schema.json"
V0_2 = "br_v0_2_json_schema.json"


@functools.cache
def _read(name: str) -> dict | None:
    path = SCHEMA_DIR / name
    return json.loads(path.read_text()) if path.is_file() else None


def llmd_schema(name: str = V0_2_1) -> dict:
    """The schema `name`; skips the calling test when shared/data is not beside the clone."""
    schema = _read(name)
    if schema is None:
        pytest.skip(f"shared/data not beside the clone: {SCHEMA_DIR / name} is missing")
    return schema
