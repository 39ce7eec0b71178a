"""Without xgrammar (the `grammar` extra) a constrained request is a 400 naming the install
command and the server keeps serving; unconstrained requests never import the library."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from server_fixtures import running_server
from test_server import _config

from engine_ref.core import grammar


@pytest.fixture
def no_xgrammar(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    grammar.check_guided.cache_clear()
    yield
    grammar.check_guided.cache_clear()


def test_a_constrained_request_without_the_library_is_a_400(no_xgrammar):
    assert not grammar.grammar_available()
    with running_server(_config()) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        with client:
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="tiny-random", prompt="x", max_tokens=4,
                                          extra_body={"guided_regex": "a+"})  # fmt: skip
            message = info.value.body["message"]
            assert "needs the xgrammar library" in message
            assert "pip install 'llm-bench-harness[grammar]'" in message
            out = client.completions.create(model="tiny-random", prompt="x", max_tokens=2)
            assert out.choices[0].text is not None


def test_an_unconstrained_engine_never_imports_the_library():
    code = (
        "import sys\n"
        "from engine_ref import EngineConfig, SamplingParams, build_engine\n"
        "e = build_engine(EngineConfig(model='tiny-random', num_blocks=64, dtype='float32'))\n"
        "e.add_request('a', [5, 6, 7], SamplingParams(max_tokens=3))\n"
        "while e.has_unfinished(): e.step()\n"
        "print('xgrammar' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
