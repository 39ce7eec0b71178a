"""The `serve` command: options generated from EngineConfig, user errors, and a real
`python -m engine_ref.serving` subprocess with the engine in its own process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from engine_ref.serving.cli_serve import ByteSize, serve


def test_options_mirror_engine_config_fields():
    result = CliRunner().invoke(serve, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--model",
        "--dtype",
        "--device",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory",
        "--enable-prefix-caching / --disable-prefix-caching",
        "--enable-chunked-prefill / --disable-chunked-prefill",
        "--max-waiting-requests",
        "--num-threads",
        "--seed",
        "--host",
        "--port",
        "--port-file",
        "--engine-loop",
    ):
        assert option in result.output, option
    flat = " ".join(result.output.split())
    assert "EngineConfig.max_waiting_requests (default: 4096)" in flat  # from the dataclass


def test_byte_sizes():
    size = ByteSize()
    assert size.convert("1GiB", None, None) == 1 << 30
    assert size.convert("512MB", None, None) == 512_000_000
    assert size.convert("4096", None, None) == 4096


def test_invalid_engine_option_is_one_sentence_and_exit_code_2():
    result = CliRunner().invoke(serve, ["--model", "tiny-random", "--dtype", "float8"])
    assert result.exit_code == 2
    assert "Unknown dtype 'float8'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
@pytest.mark.parametrize("engine_loop", ["thread", "process"])
def test_engine_that_cannot_be_built_is_one_sentence_and_exit_code_2(engine_loop):
    # A KV cache too small for two blocks: LLMEngine refuses it when it is built, which the
    # thread mode does on its engine thread and the process mode in its child.
    args = ["--model", "tiny-random", "--kv-cache-memory", "1KiB", "--port", "0"]
    result = CliRunner().invoke(serve, [*args, "--engine-loop", engine_loop])
    assert result.exit_code == 2, result.output
    assert "holds fewer than 2 blocks" in result.output
    assert "Traceback" not in result.output


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow  # spawns a server and an engine process, each importing torch (~10 s)
def test_process_mode_subprocess_serves_and_stops_cleanly(tmp_path):
    port_file = tmp_path / "port"
    command = [
        sys.executable,
        "-m",
        "engine_ref.serving",
        "--model",
        "tiny-random",
        "--port",
        "0",
        "--engine-loop",
        "process",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--num-threads",
        "1",
        "--port-file",
        str(port_file),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        url = None
        assert process.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, f"server exited early with code {process.wait(5)}"
            match = re.fullmatch(r"listening on (http://127\.0\.0\.1:(\d+))\n", line)
            if match:
                url = match.group(1)
                assert port_file.read_text().strip() == match.group(2)
        assert url is not None
        engine_children = _children(process.pid)
        assert engine_children, "the engine should run in a child process"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        chunks = list(
            client.chat.completions.create(
                model="tiny-random",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens == 5
        # A stream still in flight must not hold up the shutdown.
        stream = client.completions.create(
            model="tiny-random",
            prompt="Hi",
            max_tokens=1500,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        t_signal_s = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - t_signal_s < 10
        stream.close()
        time.sleep(0.2)
        assert not [
            pid
            for pid in engine_children
            if Path(f"/proc/{pid}").exists()
            and "Z" not in (Path(f"/proc/{pid}") / "stat").read_text().split()[2]
        ]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stdout.close()


def test_server_options_come_from_server_config():
    result = CliRunner().invoke(serve, ["--help"])
    flat = " ".join(result.output.split())
    for option in (
        "--api-key",
        "--enable-prompt-tokens-details",
        "--max-body-bytes",
        "--max-prompt-chars",
        "--header-timeout",
        "--stream-write-timeout",
        "--max-stream-backlog",
    ):
        assert option in flat, option
    assert "(default: 16777216)" in flat and "(default: 1000000)" in flat  # from the dataclass


def test_an_empty_api_key_is_one_sentence_and_exit_code_2():
    result = CliRunner().invoke(serve, ["--model", "tiny-random", "--api-key", ""])
    assert result.exit_code == 2
    assert "The API key must not be empty" in result.output
    assert "Traceback" not in result.output
