"""`bench export --format vllm|llmd|csv`: vLLM's result keys and units, the llm-d Benchmark
Report validated against its published v0.2.1 JSON Schema (fetched data beside the clone:
`llmd_schemas`), and one CSV row per request. tests/reports/test_exports_current.py
checks the newer fields by hand."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner
from llmd_schemas import llmd_schema
from rundir_builder import SyntheticRun, write_run

from reports.cli_export import export
from slo.conventions import ChunkView, VllmMetrics, vllm_peaks

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    spec = SyntheticRun(n_requests=60, failures={"rejected": 2, "timeout": 1})
    return write_run(tmp_path_factory.mktemp("export") / "run", spec)


def _export(run, *args) -> str:
    result = CliRunner().invoke(export, [str(run), *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_llmd_report_validates_against_the_published_v0_2_1_schema(run):
    report = json.loads(_export(run, "--format", "llmd"))
    jsonschema.Draft202012Validator(llmd_schema()).validate(report)
    aggregate = report["results"]["request_performance"]["aggregate"]
    assert report["version"] == "0.2.1"
    assert aggregate["requests"]["total"] == 60 and aggregate["requests"]["failures"] == 3
    assert aggregate["latency"]["time_to_first_token"]["units"] == "ms"
    assert aggregate["throughput"]["output_token_rate"]["units"] == "tokens/s"


def test_llmd_report_of_a_run_with_no_ok_request_still_validates(tmp_path):
    spec = SyntheticRun(n_requests=4, failures={"rejected": 4}, slo=None)
    report = json.loads(_export(write_run(tmp_path / "r", spec), "--format", "llmd"))
    jsonschema.Draft202012Validator(llmd_schema()).validate(report)
    assert (
        "time_to_first_token"
        not in report["results"]["request_performance"]["aggregate"]["latency"]
    )


def test_a_broken_report_fails_the_schema(run):
    """The validation can fail: a statistic without units is refused."""
    report = json.loads(_export(run, "--format", "llmd"))
    del report["results"]["request_performance"]["aggregate"]["latency"]["request_latency"]["units"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(llmd_schema()).validate(report)


def test_vllm_export_keys_and_units(run):
    data = json.loads(_export(run, "--format", "vllm", "--detailed"))
    assert data["completed"] == 57 and data["failed"] == 3 and data["num_prompts"] == 60
    assert data["total_output_tokens"] == sum(data["output_lens"])
    assert data["request_throughput"] == pytest.approx(57 / data["duration"])
    # medians in ms (the builder draws TTFT around 60 ms, TPOT around 12 ms)
    assert 40 < data["median_ttft_ms"] < 90 and 8 < data["median_tpot_ms"] < 18
    ttfts = [t for t in data["ttfts"] if t is not None]
    assert len(ttfts) == 57 and np.median(ttfts) == pytest.approx(data["median_ttft_ms"] / 1e3)
    assert data["errors"].count("") == 57


def test_csv_has_one_row_per_request_with_derived_latencies(run):
    rows = list(csv.DictReader(io.StringIO(_export(run, "--format", "csv"))))
    assert len(rows) == 60
    ok = [r for r in rows if r["status"] == "ok"]
    row = ok[0]
    sent, first = int(row["t_sent_ns"]), int(row["t_first_token_ns"])
    assert float(row["ttft_ms"]) == pytest.approx((first - sent) / 1e6, rel=1e-5)
    assert float(row["queue_ms"]) == pytest.approx(
        (sent - int(row["t_scheduled_ns"])) / 1e6, rel=1e-5
    )
    failed = [r for r in rows if r["status"] != "ok"]
    assert all(r["ttft_ms"] == "" for r in failed)  # undefined is empty, not 0


def test_export_to_a_file_and_bad_inputs(run, tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(export, [str(run), "--format", "llmd", "-o", str(out)])
    assert result.exit_code == 0 and json.loads(out.read_text())["version"] == "0.2.1"
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(export, [str(empty), "--format", "csv"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    result = CliRunner().invoke(export, [str(run), "--format", "parquet"])
    assert result.exit_code == 2


@pytest.mark.parametrize(
    ("b_sent_s", "in_flight"),
    [(1.5, 1), (1.3, 1), (1.299, 2)],
    ids=["after-a-ends", "as-a-ends", "before-a-ends"],
)
def test_vllm_peaks_by_hand(b_sent_s, in_flight):
    """Two requests. A: sent at 0 s, chunks at 0.2, 0.4, 1.2 s, E2EL 1.3 s, in flight over
    [0, 1.3). B: chunks 0.2 and 0.4 s after its send, E2EL 0.5 s. Tokens per second from the
    first send: [2, 3] whichever B (its chunks fall in second 1). In flight at once: 1 when B
    starts after A ends or just as it ends (half-open intervals), 2 when B starts just before."""
    ms = 1e3
    b_sent_ns = b_sent_s * 1e9
    vllm = VllmMetrics(
        request_id=np.array(["a", "b"]),
        ttft_ms=np.array([200.0, 200.0]),
        tpot_ms=np.array([np.nan, np.nan]),
        e2el_ms=np.array([1300.0, 500.0]),
        chunks=ChunkView(
            first_ns=np.array([0.2e9, b_sent_ns + 0.2e9]),
            last_ns=np.array([1.2e9, b_sent_ns + 0.4e9]),
            gaps_ms=np.array([]), gaps_by_request={"a": np.array([0.2, 0.8]) * ms,
                                                   "b": np.array([0.2]) * ms},
        ),
    )  # fmt: skip
    assert vllm_peaks(vllm, np.array([0.0, b_sent_ns])) == (3.0, in_flight)
    assert vllm_peaks(vllm, np.array([np.nan, np.nan])) == (0.0, 0)
