"""The skip mark of every test that needs the `grammar` extra (xgrammar)."""

from __future__ import annotations

import pytest

from engine_ref.core.grammar import grammar_available

requires_grammar = pytest.mark.skipif(
    not grammar_available(),
    reason="xgrammar is not installed (pip install 'llm-bench-harness[grammar]')",
)
