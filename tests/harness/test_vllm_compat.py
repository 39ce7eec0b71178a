"""`vllm bench serve` command lines on `bench run`: aliases, vLLM defaults, URLs without /v1,
`--header`, `--extra-body`, `--goodput` and `--save-result`."""

from __future__ import annotations

import json
import math
import shlex
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.cli.vllm_compat import (
    fold_nargs_plus,
    parse_extra_body,
    parse_goodput,
    parse_headers,
    translate,
)
from harness.errors import HarnessError
from harness.run.config import RunConfig
from harness.targets.spec import normalise_base_url
from slo.runrecord import Endpoint

# The first example of vLLM's docs/benchmarking/cli.md ("Online Benchmark"), as printed there.
VLLM_DOC_EXAMPLE = """vllm bench serve \\
  --backend vllm \\
  --model NousResearch/Hermes-3-Llama-3.1-8B \\
  --endpoint /v1/completions \\
  --dataset-name sharegpt \\
  --dataset-path <your data path>/ShareGPT_V3_unfiltered_cleaned_split.json \\
  --num-prompts 10"""

# keys `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py), default metrics
VLLM_RESULT_KEYS = {
    "date", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
    "std_itl_ms", "p99_itl_ms",
}  # fmt: skip


def _sharegpt_file(path: Path, n: int = 12) -> Path:
    convs = [
        {
            "id": str(i),
            "conversations": [
                {
                    "from": "human",
                    "value": f"Tell me a short story about cat number {i} and its fish.",
                },
                {"from": "gpt", "value": "Once upon a time a cat liked fish and milk. " * 2},
            ],
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(convs))
    return path


def _vllm_args(example: str, data_dir: Path) -> list[str]:
    # as the shell reads it: backslash-newline continues the line
    text = example.replace("\\\n", " ").replace("<your data path>", str(data_dir))
    args = shlex.split(text)
    assert args[:3] == ["vllm", "bench", "serve"]
    return args[3:]


def _port_free(port: int) -> bool:
    """Nothing listens on `port`. SO_REUSEADDR, as the mock server binds: connections of a
    server that ran there a minute ago (TIME_WAIT) do not keep it from binding again."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not _port_free(8000), reason="vLLM's default port 8000 is taken here")
def test_vllm_documentation_command_line_runs_unchanged(mock_server, tmp_path, monkeypatch):
    """vLLM's own example, pasted after `bench run`, against a mock on vLLM's default port."""
    _sharegpt_file(tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json")
    monkeypatch.chdir(tmp_path)
    args = _vllm_args(VLLM_DOC_EXAMPLE, tmp_path)
    with mock_server("--port", "8000", "--ttft-ms", "3", "--itl-ms", "1"):
        result = CliRunner().invoke(bench, ["run", *args, "--out", "run", "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["target"]["url"] == "http://127.0.0.1:8000/v1"
    assert manifest["target"]["model"] == "NousResearch/Hermes-3-Llama-3.1-8B"
    assert manifest["config"]["request_rate"] == "inf"  # vLLM's default
    status = pq.read_table(tmp_path / "run" / "requests.parquet").column("status").to_pylist()
    assert status == ["ok"] * 10


@pytest.mark.serial
def test_vllm_command_line_with_save_result_and_goodput(mock_server, tmp_path):
    """The same example with vLLM's result flags: the file has vLLM's keys, in its units."""
    _sharegpt_file(tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json")
    with mock_server("--ttft-ms", "20", "--itl-ms", "2") as url:
        port = url.rsplit(":", 1)[1].removesuffix("/v1")
        extra = ["--port", port, "--max-concurrency", "4", "--save-result", "--result-dir",
                 str(tmp_path / "results"), "--percentile-metrics", "ttft,tpot,itl,e2el",
                 "--metric-percentiles", "50,99", "--goodput", "ttft:1000", "tpot:100",
                 "--save-detailed"]  # fmt: skip
        args = [*_vllm_args(VLLM_DOC_EXAMPLE, tmp_path), *extra]
        result = CliRunner().invoke(bench, ["run", *args, "--out", str(tmp_path / "r"), "--quiet"])
    assert result.exit_code == 0, result.output
    (path,) = (tmp_path / "results").iterdir()
    assert path.name.startswith("vllm-infqps-concurrency4-Hermes-3-Llama-3.1-8B-")
    data = json.loads(path.read_text())
    expected = VLLM_RESULT_KEYS | {"p50_ttft_ms", "p50_e2el_ms", "p99_e2el_ms", "mean_e2el_ms"}
    assert expected <= set(data)
    assert data["completed"] == 10 and data["failed"] == 0 and data["max_concurrency"] == 4
    assert 18 < data["median_ttft_ms"] < 40  # ms, as vLLM
    # no lower bound on the ITL: the mock schedules
    # tokens at absolute times and sends those it is late for back to back, so on a busy
    # machine most gaps can be tens of microseconds (0.047 ms in one CI run)
    assert 0 <= data["median_itl_ms"] < 6  # the TTFT bounds above check the unit
    assert all(0.015 < t < 0.05 for t in data["ttfts"])  # seconds, as vLLM
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])  # all good
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    limits = {k: v for k, v in manifest["slo"]["per_request"].items() if v is not None}
    assert limits == {"ttft_ms": 1000.0, "tpot_ms": 100.0}


def _assert_vllm_latency_units(data: dict) -> None:
    """Latencies against a mock with a 50 ms TTFT and 20 ms between tokens, in vLLM's units:
    the `*_ms` keys in ms, `ttfts` and `itls` in seconds. Each band admits one unit only (a
    value in seconds, 0.02, fails the ms band; 20 fails the seconds band). Means over 31 gaps
    a stream, not medians: the mock sends tokens it is late for back to back, so single gaps
    can be near 0 on a busy machine while each stream's span stays 31 x 20 ms or more."""
    for key in ("mean_itl_ms", "mean_tpot_ms", "median_tpot_ms"):
        assert 15 <= data[key] <= 60, (key, data[key])
    for key in ("mean_ttft_ms", "median_ttft_ms"):
        assert 40 <= data[key] <= 500, (key, data[key])
    assert len(data["ttfts"]) == 8 and all(0.04 <= t <= 0.5 for t in data["ttfts"]), data["ttfts"]
    assert [len(gaps) for gaps in data["itls"]] == [31] * 8
    assert all(0.015 <= sum(gaps) / len(gaps) <= 0.06 for gaps in data["itls"]), data["itls"]


@pytest.mark.serial
def test_save_result_and_export_report_latencies_in_vllm_units(mock_server, tmp_path):
    """`bench run --save-result` and `bench export --format vllm` of the same run, against a
    mock with known latencies: ms where vLLM writes ms, seconds where it writes seconds."""
    with mock_server("--ttft-ms", "50", "--itl-ms", "20") as url:
        argv = ["run", "--url", url, "--model", "mock", "--tokenizer", "tiny-random",
                "--workload", "random", "--input-len", "8", "--output-len", "32",
                "--num-requests", "8", "--concurrency", "4", "--save-result", "--save-detailed",
                "--result-dir", str(tmp_path / "results"), "--out", str(tmp_path / "r"),
                "--quiet"]  # fmt: skip
        result = CliRunner().invoke(bench, argv)
    assert result.exit_code == 0, result.output
    (path,) = (tmp_path / "results").iterdir()
    saved = json.loads(path.read_text())
    exported_path = tmp_path / "exported.json"
    result = CliRunner().invoke(bench, ["export", str(tmp_path / "r"), "--format", "vllm",
                                        "--detailed", "-o", str(exported_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    exported = json.loads(exported_path.read_text())
    for data in (saved, exported):
        assert data["completed"] == 8 and data["output_lens"] == [32] * 8
        _assert_vllm_latency_units(data)


def test_the_unit_bands_refuse_the_other_unit():
    """Negative control for `_assert_vllm_latency_units`: the mock's latencies written in ms
    pass; the same figures with ms keys in seconds, or seconds lists in ms, fail."""
    right = {"mean_itl_ms": 20.0, "mean_tpot_ms": 20.0, "median_tpot_ms": 20.0,
             "mean_ttft_ms": 50.0, "median_ttft_ms": 50.0, "ttfts": [0.05] * 8,
             "itls": [[0.02] * 31] * 8}  # fmt: skip
    _assert_vllm_latency_units(right)
    ms_in_seconds = {k: v / 1e3 if k.endswith("_ms") else v for k, v in right.items()}
    seconds_in_ms = {**right, "ttfts": [50.0] * 8, "itls": [[20.0] * 31] * 8}
    itls_in_ms = {**right, "itls": [[20.0] * 31] * 8}
    for wrong in (ms_in_seconds, seconds_in_ms, itls_in_ms):
        with pytest.raises(AssertionError):
            _assert_vllm_latency_units(wrong)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--num-prompts", "7"], {"num_requests": 7, "request_rate": math.inf}),
        (["--max-concurrency", "3"], {"concurrency": 3, "request_rate": math.inf}),
        (["--max-concurrency", "3", "--request-rate", "2"], {"concurrency": 3, "request_rate": 2.0}),
        (["--backend", "openai-chat"], {"endpoint": Endpoint.CHAT}),
        (["--backend", "openai"], {"endpoint": Endpoint.COMPLETIONS}),
        (["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
          "--random-range-ratio", "0.5"],
         {"workload": "random", "input_len": 16, "output_len": 8, "range_ratio": 0.5}),
        (["--base-url", "http://h:9"], {"url": "http://h:9/v1"}),
        (["--port", "9001"], {"url": "http://127.0.0.1:9001/v1"}),
        (["--host", "10.0.0.2"], {"url": "http://10.0.0.2:8000/v1"}),
        (["--num-warmups", "2"], {"warmup": 2}),
        (["--temperature", "0.3", "--top-p", "0.75"],
         {"extra_body": {"temperature": 0.3, "top_p": 0.75}}),
        (["--url", "http://h:1/v1", "--num-prompts", "3"], {"url": "http://h:1/v1"}),
        # a vLLM flag beside a named target keeps that target (no default port 8000)
        (["--target", "llamacpp", "--result-dir", "x"], {"url": None, "target": "llamacpp"}),
        (["--target", "vllm", "--num-prompts", "3"],
         {"url": None, "target": "vllm", "num_requests": 3}),
    ],
)  # fmt: skip
def test_vllm_flags_become_run_config_fields(argv, expected):
    config = _config(argv)
    for key, value in expected.items():
        assert config.flat()[key] == value, key


def test_harness_flags_alone_keep_harness_defaults():
    config = _config(["--num-requests", "5", "--slice-duration", "2", "--header", "A: b"])
    flat = config.flat()
    assert flat["url"] is None and flat["request_rate"] is None  # managed engine, workload rate
    assert flat["slice_duration_s"] == 2.0 and flat["headers"] == (("A", "b"),)


def _config(argv: list[str]) -> RunConfig:
    """The RunConfig `bench run argv` would build, without running anything."""
    captured = {}

    def fake_run(config, **_):
        captured["config"] = config
        raise SystemExit(0)

    import harness.run.orchestrator

    monkey = pytest.MonkeyPatch()
    monkey.setattr(harness.run.orchestrator, "run_benchmark", fake_run)
    try:
        result = CliRunner().invoke(bench, ["run", *argv])
    finally:
        monkey.undo()
    assert "config" in captured, result.output
    return captured["config"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "5", "--num-requests", "6"], "--num-prompts and --num-requests"),
        (["--url", "http://h/v1", "--base-url", "http://h"], "--url names the target already"),
        (["--base-url", "http://h", "--port", "1"], "--base-url names the target already"),
        (["--target", "vllm", "--url", "http://h/v1"], "--target vllm names the target already"),
        (["--target", "ref", "--port", "9"], "--target ref names the target already"),
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat"),
        (["--dataset-name", "sonnet"], "--dataset-name sonnet is not available here"),
        (["--goodput", "ttft:abc"], "--goodput ttft must be a number of ms"),
        (["--goodput", "latency:3"], "--goodput takes KEY:MS pairs"),
        (["--goodput", "ttft:5", "--slo", "p99"], "--goodput and --slo"),
        (["--percentile-metrics", "ttft,foo"], "--percentile-metrics takes"),
        (["--metric-percentiles", "0"], "--metric-percentiles takes"),
        (["--extra-body", "{bad"], "--extra-body is not valid JSON"),
        (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
        (["--extra-body", '{"stream": false}'], "--extra-body may not set 'stream'"),
        (["--header", "no-separator"], "--header takes NAME:VALUE"),
        (["--endpoint", "/v1/moderations"], "is not an endpoint here"),
        (["--url", "ftp://h"], "--url must start with http://"),
    ],
)
def test_contradictions_and_bad_values_end_in_one_sentence(argv, message, tmp_path, monkeypatch):
    from harness.cli.main import _is_user_error

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(bench, ["run", *argv, "--tokenizer", "tiny-random"])
    assert not (tmp_path / "runs").exists()  # refused before anything was written
    if isinstance(result.exception, SystemExit):  # click's usage errors
        assert result.exit_code == 2 and message in result.output
    else:  # `main` prints these as one line and exits 2
        assert _is_user_error(result.exception), result.exception
        assert message in str(result.exception)
        assert str(result.exception).endswith(".") and "\n" not in str(result.exception)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h:8000", "http://h:8000/v1"),
        ("http://h:8000/", "http://h:8000/v1"),
        ("http://h:8000/v1", "http://h:8000/v1"),
        ("http://h:8000/v1/", "http://h:8000/v1"),
        ("https://gw.example/openai/v1", "https://gw.example/openai/v1"),
        ("https://gw.example/api", "https://gw.example/api"),  # kept: a 404 then says what to try
    ],
)
def test_base_url_without_v1_is_fixed_up(url, expected):
    assert normalise_base_url(url) == expected


def test_fold_nargs_plus_joins_vllm_multi_value_flags():
    args = ["--goodput", "ttft:1", "tpot:2", "--num-prompts", "3", "--metadata", "a=1", "b=2"]
    assert fold_nargs_plus(args) == ["--goodput", "ttft:1 tpot:2", "--num-prompts", "3",
                                     "--metadata", "a=1 b=2"]  # fmt: skip
    assert fold_nargs_plus(["--goodput"]) == ["--goodput"]
    assert fold_nargs_plus(["--goodput=ttft:1"]) == ["--goodput=ttft:1"]


def test_goodput_maps_vllm_keys_to_slo_fields():
    spec = parse_goodput("ttft:500 tpot:50 e2el:5000")
    assert spec["per_request"] == {"ttft_ms": 500.0, "tpot_ms": 50.0, "e2e_ms": 5000.0}
    with pytest.raises(HarnessError, match="positive"):
        parse_goodput("ttft:0")
    with pytest.raises(HarnessError, match="at least one"):
        parse_goodput("  ")


@pytest.mark.parametrize(
    ("text", "pair"),
    [
        ("X-Team: search", ("X-Team", "search")),
        ("X-Team:search", ("X-Team", "search")),
        ("X-Team=search", ("X-Team", "search")),  # vLLM's KEY=VALUE form
        ("X-Url: http://a:1/b", ("X-Url", "http://a:1/b")),
        ("X-Empty:", ("X-Empty", "")),
    ],
)
def test_header_forms(text, pair):
    assert parse_headers((text,)) == (pair,)


@pytest.mark.parametrize("text", [":v", "bad name: v", "X: a\r\nInjected: 1", "novalue"])
def test_bad_headers_are_refused(text):
    with pytest.raises(HarnessError, match="--header"):
        parse_headers((text,))


def test_extra_body_parse():
    assert parse_extra_body('{"top_k": 20, "min_p": 0.1}') == {"top_k": 20, "min_p": 0.1}
    assert parse_extra_body(None) is None


def test_translate_keeps_vllm_flags_out_of_the_config():
    kwargs, request, no_progress = translate({"num_prompts": 3, "save_result": True,
                                              "disable_tqdm": True})  # fmt: skip
    assert "num_prompts" not in kwargs and kwargs["num_requests"] == 3
    assert request is not None and request.percentile_metrics == ("ttft", "tpot", "itl")
    assert no_progress is True


class _Recorder:
    """A loopback OpenAI-style server (threaded, stdlib) that keeps each request's headers
    and body, and streams a two-token completion."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"data": [{"id": "m"}]}).encode()
                self._send(200, body, "application/json")

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                seen.append((dict(self.headers), json.loads(self.rfile.read(length))))
                events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]}
                          for t in ("a", "b")]  # fmt: skip
                events.append(
                    {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
                )
                body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self._send(200, body.encode(), "text/event-stream")

            def _send(self, code, body, kind):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_headers_and_extra_body_reach_every_request_and_values_stay_unrecorded(tmp_path):
    server = _Recorder()
    with server as root:
        argv = ["run", "--base-url", root, "--model", "m", "--tokenizer", "tiny-random",
                "--input-len", "4", "--output-len", "2", "--num-prompts", "3",
                "--header", "X-Team: search", "--header", "X-Secret=hunter2",
                "--extra-body", '{"top_k": 20, "repetition_penalty": 1.1}', "--top-p", "0.9",
                "--out", str(tmp_path / "r"), "--quiet"]  # fmt: skip
        result = CliRunner().invoke(bench, argv)
    assert result.exit_code == 0, result.output
    assert len(server.seen) == 3
    for headers, body in server.seen:
        assert headers["X-Team"] == "search" and headers["X-Secret"] == "hunter2"
        assert body["top_k"] == 20 and body["repetition_penalty"] == 1.1 and body["top_p"] == 0.9
        assert body["model"] == "m" and body["stream"] is True
    manifest = (tmp_path / "r" / "manifest.json").read_text()
    assert "hunter2" not in manifest
    assert json.loads(manifest)["config"]["headers"] == ["X-Team", "X-Secret"]
    assert json.loads(manifest)["target"]["url"] == root + "/v1"


def test_a_404_on_the_first_request_says_what_was_tried_and_what_to_try(mock_server, tmp_path):
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        root = url.removesuffix("/v1")
        result = CliRunner().invoke(bench, ["run", "--url", root + "/api", "--model", "mock",
                                            "--tokenizer", "tiny-random", "--input-len", "4",
                                            "--output-len", "2", "--num-requests", "4",
                                            "--request-rate", "inf", "--out", str(tmp_path / "r"),
                                            "--quiet"])  # fmt: skip
    assert result.exit_code == 3, result.output
    assert f"4 of 4 requests got HTTP 404 from POST {root}/api/completions" in result.output
    assert f"try --url {root}/api/v1" in result.output
