"""`--goodput` in AIPerf's names beside vLLM's.

AIPerf (ai-dynamo/aiperf `aiperf profile --goodput`) names its limits by metric tag, in ms:
`time_to_first_token`, `request_latency` and `inter_token_latency`, the last per request
(request_latency - time_to_first_token) / (output tokens - 1)
(`src/aiperf/metrics/types/inter_token_latency_metric.py`), which is vLLM's TPOT. So each
AIPerf name sets the same SLO field as its vLLM name, and the two vocabularies can be mixed.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.cli.vllm_compat import fold_nargs_plus, parse_goodput, translate
from harness.errors import HarnessError
from slo.spec import as_spec

VLLM = "ttft:500 tpot:50 e2el:5000"
AIPERF = "time_to_first_token:500 inter_token_latency:50 request_latency:5000"


@pytest.mark.parametrize(
    ("aiperf", "vllm", "limits"),
    [
        (AIPERF, VLLM, {"ttft_ms": 500.0, "tpot_ms": 50.0, "e2e_ms": 5000.0}),
        (
            "time_to_first_token:100 inter_token_latency:3.40",
            "ttft:100 tpot:3.4",
            {"ttft_ms": 100.0, "tpot_ms": 3.4},
        ),  # AIPerf's tutorial example
        ("request_latency:750", "e2el:750", {"e2e_ms": 750.0}),
        (
            "time_to_first_token:500 tpot:50",
            "ttft:500 inter_token_latency:50",
            {"ttft_ms": 500.0, "tpot_ms": 50.0},
        ),  # the two vocabularies mixed
    ],
)
def test_aiperf_names_give_the_same_limits_as_vllm_s(aiperf, vllm, limits):
    kwargs_aiperf, _, _ = translate({"goodput": aiperf})
    kwargs_vllm, _, _ = translate({"goodput": vllm})
    assert kwargs_aiperf["slo"]["per_request"] == kwargs_vllm["slo"]["per_request"] == limits
    assert as_spec(kwargs_aiperf["slo"]) == as_spec(
        dict(kwargs_vllm["slo"], source=kwargs_aiperf["slo"]["source"])
    )


def test_aiperf_values_are_folded_like_vllm_s():
    args = [
        "--goodput",
        "time_to_first_token:100",
        "inter_token_latency:3.40",
        "--num-prompts",
        "3",
    ]
    assert fold_nargs_plus(args) == ["--goodput", "time_to_first_token:100 inter_token_latency:3.40",
                                     "--num-prompts", "3"]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "ttft:500 time_to_first_token:400",
            "--goodput gives one limit twice, 'ttft:500' and 'time_to_first_token:400'; give it once.",
        ),
        ("inter_token_latency:0", "--goodput inter_token_latency must be a positive number of ms"),
        ("request_latency:abc", "--goodput request_latency must be a number of ms"),
    ],
)
def test_contradictory_or_bad_aiperf_limits_are_refused(text, message):
    with pytest.raises(HarnessError) as info:
        parse_goodput(text)
    assert message in str(info.value)


def test_the_same_limit_under_both_names_is_accepted_when_they_agree():
    assert parse_goodput("ttft:500 time_to_first_token:500")["per_request"] == {"ttft_ms": 500.0}


@pytest.mark.parametrize("name", ["output_token_throughput_per_user", "latency", "TTFT"])
def test_an_unknown_name_lists_both_vocabularies_in_one_sentence(name, tmp_path, monkeypatch):
    """Through `bench run`: refused before anything is written, one sentence naming vLLM's
    and AIPerf's names (AIPerf has more metric tags; only these three map onto this harness's
    per-request limits)."""
    from harness.cli.main import _is_user_error

    monkeypatch.chdir(tmp_path)
    argv = ["run", "--goodput", f"{name}:5", "--tokenizer", "tiny-random"]
    result = CliRunner().invoke(bench, argv)
    assert not (tmp_path / "runs").exists()
    assert _is_user_error(result.exception), result.exception
    text = str(result.exception)
    assert text == (
        "--goodput takes KEY:MS pairs with KEY one of vLLM's ttft, tpot, e2el or AIPerf's "
        f"time_to_first_token, inter_token_latency, request_latency; got '{name}:5'."
    )
