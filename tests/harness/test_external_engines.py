"""Managed external engines (`--target vllm|llamacpp`), tested with a fake engine: a command
template that starts the mock server. Launch, readiness, log capture, manifest, shutdown, a
server that fails to start and one that never answers; the tokenizer that follows the target;
engine ids and output checks recorded per request."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.errors import HarnessError
from harness.run.config import RunConfig
from harness.targets.engines import ENGINES, parse_assignments, plan_launch
from harness.targets.launch import free_port, launched
from harness.targets.managed import ManagedServerConfig, managed_server
from harness.targets.spec import TargetSpec
from harness.targets.tokenizer_choice import choose_tokenizer
from slo.runrecord import RequestColumn

pytestmark = pytest.mark.slow  # each test starts a server process

FAKE_VLLM = (
    "vllm={python} -m harness.cli mock-server --port {port} --model {served_model} --metrics"
)


@pytest.fixture(autouse=True)
def _cache(private_cache):
    """Exports and oracle outputs land in a fresh cache; fetched models are shared with it."""


@pytest.fixture
def smollm2_tokenizer(smollm2_path):
    """The SmolLM2 file is fetched (session fixture, before `_cache` moves the cache), so
    these tests never depend on another test having fetched it first."""
    return smollm2_path


def _run(tmp_path, *args: str):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        bench,
        ["run", "--model", "tiny-random", "--workload", "random", "--num-requests", "4",
         "--input-len", "16", "--output-len", "4", "--request-rate", "inf", "--out", str(out),
         "--quiet", *args],
    )  # fmt: skip
    return result, out


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def test_fake_vllm_is_launched_recorded_and_stopped(tmp_path):
    result, out = _run(tmp_path, "--target", "vllm", "--engine-command", FAKE_VLLM)
    assert result.exit_code == 0, result.output
    target = json.loads((out / "manifest.json").read_text())["target"]
    assert target["kind"] == "managed" and target["engine"] == "vllm"
    assert target["engine_command"][:4] == [sys.executable, "-m", "harness.cli", "mock-server"]
    # vLLM serves the export of the reference model, and the run counts with its tokenizer
    assert target["weights"].endswith("tiny-random-float32")
    assert target["tokenizer"] == {
        "source": target["weights"],
        "how": "served by the managed vllm",
        "known": True,
    }
    log = (out / "server.log").read_text()
    assert target["server_log"] == str(out / "server.log") and "listening on" in log
    assert not _answers(target["url"].removesuffix("/v1") + "/health")  # stopped
    requests = pq.read_table(out / "requests.parquet").to_pylist()
    assert [r[RequestColumn.STATUS] for r in requests] == ["ok"] * 4
    assert {r[RequestColumn.RESPONSE_ID] for r in requests} == {"mock"}
    engine_ids = {r[RequestColumn.ENGINE_REQUEST_ID] for r in requests}
    assert len(engine_ids) == 4 and all(i.startswith("mock-") for i in engine_ids)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["server_metrics"]["available"] is True
    html = tmp_path / "card.html"
    card = CliRunner().invoke(bench, ["report", str(out), "-o", str(html)])
    assert card.exit_code == 0, card.output
    assert "running requests" in card.output  # the console card's server-metrics table
    page = html.read_text()
    assert "Server metrics over time" in page and "<svg" in page


def test_an_engine_that_exits_ends_in_one_sentence_with_its_log_tail(tmp_path):
    bad = "vllm={python} -c \"import sys; print('no such model here'); sys.exit(3)\""
    result, out = _run(tmp_path, "--target", "vllm", "--engine-command", bad)
    assert result.exit_code != 0
    message = str(result.exception)
    assert isinstance(result.exception, HarnessError)
    assert message.startswith("vllm exited with code 3 before it was ready")
    assert "no such model here" in message and str(out / "server.log") in message


def test_an_engine_that_never_answers_times_out_and_is_stopped(tmp_path):
    sleeper = "WAIT=1 {python} -c 'import os, time; print(os.getpid(), flush=True); time.sleep(120)' {port}"
    plan = plan_launch("vllm", "tiny-random", served_model="x", command=sleeper, port=free_port())
    assert plan.env == {"WAIT": "1"}
    log = tmp_path / "server.log"
    with pytest.raises(HarnessError, match=r"vllm did not answer /health within 1 s; its log"):
        with launched(plan, plan.port, log, startup_timeout_s=1):
            pass
    first, pid = log.read_text().splitlines()[:2]
    assert first.startswith("$ ")
    with pytest.raises(ProcessLookupError):  # the `with` stopped it on the way out
        os.kill(int(pid), 0)


def test_stop_ends_the_process_group(tmp_path):
    plan = plan_launch(
        "vllm",
        "tiny-random",
        served_model="x",
        command=FAKE_VLLM.split("=", 1)[1],
        port=free_port(),
    )
    with launched(plan, plan.port, tmp_path / "server.log", startup_timeout_s=60) as server:
        assert _answers(f"http://127.0.0.1:{plan.port}/health")
        proc = server.proc
    assert proc.poll() is not None
    assert not _answers(f"http://127.0.0.1:{plan.port}/health")


def parse_target(text: str) -> tuple[str, str | None]:
    """`(kind, url)` of a `--target` value, as `TargetSpec.parse` reads it."""
    spec = TargetSpec.parse(text)
    return spec.kind, spec.url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ref", ("ref", None)),
        ("vllm", ("vllm", None)),
        ("llamacpp", ("llamacpp", None)),
        ("url:http://127.0.0.1:8000/v1", ("url", "http://127.0.0.1:8000/v1")),
    ],
)
def test_parse_target(text, expected):
    assert parse_target(text) == expected


@pytest.mark.parametrize("text", ["sglang", "url:ftp://x", "", "VLLM"])
def test_parse_target_refuses_in_one_sentence(text):
    with pytest.raises(HarnessError, match=r"--target"):
        parse_target(text)


@pytest.mark.parametrize("value", ["vllm", "tgi=x", "vllm=", "=x"])
def test_engine_assignments_are_checked(value):
    with pytest.raises(HarnessError, match=r"ENGINE=VALUE"):
        parse_assignments((value,), "--engine-command")


def test_a_template_with_an_unknown_field_is_one_sentence():
    with pytest.raises(HarnessError, match=r"the vllm command template .* is not usable"):
        plan_launch("vllm", "tiny-random", served_model="x", command="{python} {weights}", port=1)


def test_llamacpp_needs_a_gguf_model():
    with pytest.raises(HarnessError, match="llama.cpp serves GGUF files"):
        plan_launch("llamacpp", "tiny-random", served_model="x", port=1)
    assert "--interrupt_requests False" in ENGINES["llamacpp"].command
    assert ENGINES["llamacpp"].serialises_requests


@pytest.mark.parametrize(
    ("config", "source", "known"),
    [
        (RunConfig(model="tiny-random"), "tiny-random", True),  # the managed reference model
        (RunConfig(url="http://h:1/v1", model="tiny-random"), "tiny-random", True),  # the issue
        (RunConfig(url="http://h:1/v1", model="served-name"), "smollm2-135m", False),
        (RunConfig(url="http://h:1/v1", tokenizer="tiny-random"), "tiny-random", True),
        (RunConfig(target="url:http://h:1/v1"), "smollm2-135m", False),
    ],
)
def test_the_tokenizer_follows_the_model_under_test(config, source, known):
    choice = choose_tokenizer(config.server)
    assert (choice.source, choice.warning is None) == (source, known)
    if not known:
        assert "--tokenizer" in choice.warning


def _url_run(tmp_path, url: str, name: str):
    out = tmp_path / name
    result = CliRunner().invoke(
        bench,
        ["run", "--url", url, "--workload", "random", "--num-requests", "3", "--input-len", "8",
         "--output-len", "2", "--request-rate", "inf", "--out", str(out), "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    target = json.loads((out / "manifest.json").read_text())["target"]
    return result.output, target["tokenizer"]


@pytest.mark.slow  # starts a reference server
def test_a_url_to_a_reference_server_counts_with_the_model_its_info_names(tmp_path, mock_server):
    # No --model, no --tokenizer: the reference server's /info says it serves tiny-random.
    config = ManagedServerConfig(model="tiny-random", startup_timeout_s=120)
    with managed_server(config) as server:
        output, tokenizer = _url_run(tmp_path, server.base_url, "ref")
    assert "warning" not in output
    assert tokenizer == {"source": "tiny-random", "known": True,
                         "how": "the reference server's /info names its model"}  # fmt: skip
    # Another engine (the mock has no /info) leaves the default and its one-sentence warning.
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        output, tokenizer = _url_run(tmp_path, url, "mock")
    assert "tokenizer is not known" in output and "--tokenizer" in output
    assert tokenizer["source"] == "smollm2-135m" and not tokenizer["known"]


def test_tiny_random_served_with_the_smollm2_tokenizer_warns(tmp_path, smollm2_tokenizer):
    """The issue's case: prompts built with SmolLM2's tokenizer for a tiny-random server."""
    result, out = _run(tmp_path, "--tokenizer", "smollm2-135m", "--check-outputs")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "the prompt tokens the workload recorded" in lines[0]
    summary = json.loads((out / "summary.json").read_text())
    check = summary["prompt_tokens"]
    assert check["verdict"] == "disagree" and check["ratio"] > 2
    card = CliRunner().invoke(bench, ["report", str(out), "--json", str(tmp_path / "c.json")])
    assert card.exit_code == 0, card.output
    notes = json.loads((tmp_path / "c.json").read_text())["notes"]
    assert any(f"{check['ratio']:.2f}x" in n for n in notes)
    # the oracle ran too: greedy outputs of the same engine at batch 1
    assert summary["correctness"]["n_compared"] == 4


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_right_tokenizer_does_not_warn_and_checks_outputs(tmp_path, endpoint):
    """Chat prompts carry the template's constant overhead, which the check allows for."""
    result, out = _run(tmp_path, "--check-outputs", "--diverge-before", "8", "--endpoint", endpoint)
    assert result.exit_code == 0, result.output
    assert "warning:" not in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompt_tokens"]["verdict"] == "agree"
    assert summary["prompt_tokens"]["ratio"] == pytest.approx(1.0, abs=0.05)
    assert (summary["prompt_tokens"]["overhead_tokens"] > 0) == (endpoint == "chat")
    correctness = summary["correctness"]
    assert correctness["n_compared"] == 4 and correctness["diverge_before"] == 8
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    assert all(r[RequestColumn.OUTPUT_VALID] is not None for r in rows)
    # the reference outputs were cached beside the workloads
    assert list((tmp_path / "cache" / "oracle").glob("*.json"))


@pytest.mark.parametrize("when", ["while running", "while starting"])
def test_ctrl_c_stops_the_managed_engine(tmp_path, when):
    """SIGINT to `bench run` mid-run (exit 130, a readable run) or while the engine is still
    starting: either way the engine's process is gone afterwards."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    engine = FAKE_VLLM + " --ttft-ms 100 --itl-ms 200"
    if when == "while starting":  # prints its pid, then never answers
        engine = "vllm={python} -c 'import os, time; print(os.getpid(), flush=True); time.sleep(120)' {port}"
    cmd = [sys.executable, "-m", "harness.cli", "run", "--target", "vllm", "--engine-command",
           engine, "--model", "tiny-random", "--workload", "random", "--num-requests", "4",
           "--input-len", "8", "--output-len", "50", "--request-rate", "inf", "--out", str(out),
           "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        log = out / "server.log"
        deadline = time.monotonic() + 60
        ready = "listening on" if when == "while running" else "\n"
        while time.monotonic() < deadline:
            text = log.read_text() if log.is_file() else ""
            if ready in text.split("\n", 1)[-1]:
                break
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = log.read_text()
    if when == "while running":
        assert proc.returncode == 130, output
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["complete"] is False
        url = manifest["target"]["url"].removesuffix("/v1")
        assert not _answers(url + "/health")
    else:
        assert proc.returncode == 130 and b"Traceback" not in output, output
        pid = int(text.splitlines()[1])
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_fake_llamacpp_serves_the_gguf_and_counts_tokens_with_its_tokenizer(
    tmp_path, smollm2_tokenizer
):
    """llama.cpp's server sends no usage when streaming: tokens are counted with the GGUF's
    own tokenizer, the prompt-token check says it could not check, and the card says the
    engine serves one request at a time."""
    from engine_ref.loading.model_files import resolve_model

    fake = "llamacpp={python} -m harness.cli mock-server --port {port} --model {served_model} --no-usage"
    out = tmp_path / "run"
    result = CliRunner().invoke(
        bench,
        ["run", "--target", "llamacpp", "--engine-command", fake, "--model", "smollm2-135m",
         "--workload", "random", "--num-requests", "3", "--input-len", "16", "--output-len",
         "4", "--request-rate", "inf", "--out", str(out), "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    target = json.loads((out / "manifest.json").read_text())["target"]
    gguf = str(resolve_model("smollm2-135m").path)
    assert target["weights"] == gguf and target["tokenizer"]["source"] == gguf
    assert target["serialises_requests"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert summary["output_tokens_source"] == "tokenizer"
    assert summary["prompt_tokens"]["verdict"] == "not_checked"
    card_json = tmp_path / "card.json"
    card = CliRunner().invoke(bench, ["report", str(out), "--json", str(card_json)])
    assert card.exit_code == 0, card.output
    notes = json.loads(card_json.read_text())["notes"]
    assert any("serves one request at a time" in n for n in notes)


def test_a_tokenizer_json_file_is_a_tokenizer(tmp_path):
    from harness.targets.engines import exported_dir
    from harness.targets.tokenizer_choice import load_chosen

    path = exported_dir("tiny-random") / "tokenizer.json"
    choice = choose_tokenizer(RunConfig(url="http://h:1/v1", tokenizer=str(path)).server)
    assert (choice.source, choice.how) == (str(path), "--tokenizer")
    tokenizer = load_chosen(choice)
    assert tokenizer.encode("hello world") == load_chosen(
        choose_tokenizer(RunConfig(model="tiny-random").server)
    ).encode("hello world")
    with pytest.raises(HarnessError, match="cannot load the tokenizer"):
        load_chosen(
            choose_tokenizer(RunConfig(url="http://h:1/v1", tokenizer=str(tmp_path)).server)
        )


def test_engine_faults_act_on_a_managed_external_engine(tmp_path):
    """kill-engine on a managed (fake) vLLM: SIGKILLed 1 s in and started again on its port;
    every scheduled request has one outcome, none lost or invented, one restart recorded."""
    plan = tmp_path / "kill.yaml"
    plan.write_text("name: kill\nwindows:\n  - kind: kill_engine\n    at: 1s\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(
        bench,
        ["run", "--model", "tiny-random", "--workload", "random", "--num-requests", "40",
         "--input-len", "16", "--output-len", "16", "--request-rate", "10", "--timeout", "30",
         "--out", str(out), "--quiet", "--target", "vllm", "--engine-command", FAKE_VLLM,
         "--faults", str(plan)],
    )  # fmt: skip
    assert "Traceback" not in result.output, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fault_plan"]["engine_restarts"] == 1
    assert "error" not in manifest["fault_plan"]["windows"][0]
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    assert len(rows) == 40 and len({r[RequestColumn.REQUEST_ID] for r in rows}) == 40
    statuses = [r[RequestColumn.STATUS] for r in rows]
    assert 0 < statuses.count("ok") < 40  # the kill cost some requests, the restart served more
    ledger = json.loads((out / "summary.json").read_text())["ledger"]
    assert (ledger["lost"], ledger["unexpected"]) == (0, 0), ledger


def test_a_plan_with_engine_args_is_refused_for_an_external_engine(tmp_path):
    result, out = _run(tmp_path, "--target", "vllm", "--engine-command", FAKE_VLLM,
                       "--faults", "shrunken-kv")  # fmt: skip
    assert isinstance(result.exception, HarnessError)  # `bench` prints it in one sentence
    message = str(result.exception)
    assert "--num-blocks 64, which only the reference engine understands" in message
    assert message.endswith("against vllm.") and not out.exists()


def test_sweep_and_capacity_take_a_managed_target_too(tmp_path):
    """`--target vllm` on `bench sweep` and `bench capacity`: the (fake) engine is started once
    for every run of each, and each run's manifest names it."""
    common = ["--model", "tiny-random", "--workload", "random", "--num-requests", "4",
              "--input-len", "16", "--output-len", "4", "--target", "vllm",
              "--engine-command", FAKE_VLLM]  # fmt: skip
    result = CliRunner().invoke(
        bench, ["sweep", *common, "--concurrency", "2", "--out", str(tmp_path / "sweep")]
    )
    assert result.exit_code == 0, result.output
    points = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["points"]
    assert len(points) == 1
    for point in points:
        manifest = json.loads((tmp_path / "sweep" / point["run_dir"] / "manifest.json").read_text())
        assert manifest["target"]["engine"] == "vllm"
        # the tokenizer is the one of the weights the engine serves, as for `bench run`
        assert manifest["target"]["tokenizer"]["how"] == "served by the managed vllm"
    result = CliRunner().invoke(
        bench,
        ["capacity", *common, "--slo", "p99", "--start-rate", "50", "--max-iterations", "2",
         "--out", str(tmp_path / "cap"), "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert len(record["probes"]) == 2
    probe = tmp_path / "cap" / record["probes"][0]["run_dir"] / "manifest.json"
    assert json.loads(probe.read_text())["target"]["engine"] == "vllm"
    result = CliRunner().invoke(bench, ["capacity", "--slo", "p99", "--target", "nonesuch"])
    assert isinstance(result.exception, HarnessError)  # `bench` prints it in one sentence
    assert str(result.exception).startswith("unknown --target 'nonesuch'; use one of ref, vllm")
