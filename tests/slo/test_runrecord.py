"""The run-record contract: schemas and record types agree, documents are versioned, the writer
refuses values outside the enums, parts survive a crash, and docs/CONTRACTS.md matches."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from slo.runrecord import (
    CHUNKS_SCHEMA,
    REQUESTS_SCHEMA,
    ChunkColumn,
    ChunkRecord,
    Endpoint,
    ErrorClass,
    RequestColumn,
    RequestRecord,
    RequestStatus,
    RunManifest,
    RunRecordError,
    RunSummary,
    RunWriter,
    TokenSource,
    open_run,
    read_manifest,
)
from slo.runrecord.docs import contract_markdown, replace_section

ROOT = Path(__file__).resolve().parents[2]


def test_schemas_records_and_enums_are_one_contract():
    assert REQUESTS_SCHEMA.names == [c.value for c in RequestColumn]
    assert REQUESTS_SCHEMA.names == [f.name for f in fields(RequestRecord)]
    assert CHUNKS_SCHEMA.names == [c.value for c in ChunkColumn]
    assert CHUNKS_SCHEMA.names == [f.name for f in fields(ChunkRecord)]


def test_token_sources_say_who_counted():
    assert not TokenSource.USAGE.counted_by_client
    assert TokenSource.TOKENIZER.counted_by_client and TokenSource.CHUNK_COUNT.counted_by_client
    assert (
        Endpoint.CHAT.path == "/chat/completions" and Endpoint("completions").path == "/completions"
    )


@pytest.mark.parametrize("cls", [RunManifest, RunSummary])
def test_documents_round_trip(cls):
    doc = cls()
    assert cls.from_json(doc.to_json()) == doc


@pytest.mark.parametrize("cls", [RunManifest, RunSummary])
@pytest.mark.parametrize("version", [0, 2, None, "1", 1.5])
def test_documents_refuse_other_schema_versions_in_one_sentence(cls, version):
    data = cls().to_dict()
    data["schema_version"] = version
    with pytest.raises(RunRecordError) as err:
        cls.from_dict(data)
    message = str(err.value)
    assert "schema_version" in message and message.count("\n") == 0 and message.endswith(".")


@pytest.mark.parametrize("cls", [RunManifest, RunSummary])
def test_documents_refuse_unknown_fields_and_non_objects(cls):
    with pytest.raises(RunRecordError, match="does not know \\(zzz\\)"):
        cls.from_dict({**cls().to_dict(), "zzz": 1})
    with pytest.raises(RunRecordError, match="JSON object"):
        cls.from_dict([1, 2])
    with pytest.raises(RunRecordError, match="not valid JSON"):
        cls.from_json("{nope")


def _writer(tmp_path: Path) -> RunWriter:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    return RunWriter(run, RunManifest(t0_ns=0, config={"seed": 1}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("status", "client_count"),
        ("status", "OK"),
        ("status", None),
        ("error_class", "http_500"),
        ("output_tokens_source", "client_count"),  # the defect's spelling, now refused
    ],
)
def test_writer_refuses_values_outside_the_enums(tmp_path, field, value):
    writer = _writer(tmp_path)
    record = RequestRecord(request_id="r1", status=RequestStatus.OK)
    setattr(record, field, value)
    with pytest.raises(RunRecordError) as err:
        writer.append_requests([record])
    assert "r1" in str(err.value) and str(err.value).count("\n") == 0


def test_writer_accepts_every_member_and_reads_back_strings(tmp_path):
    writer = _writer(tmp_path)
    records = [
        RequestRecord(request_id=f"s{i}", status=s, error_class=e, output_tokens_source=t)
        for i, (s, e, t) in enumerate(
            zip(
                list(RequestStatus) * 2,
                list(ErrorClass),
                list(TokenSource) * 4,
                strict=False,
            )
        )
    ]
    writer.append_requests(records)
    writer.close(complete=True)
    table = open_run(writer.run_dir).requests
    assert table.column(RequestColumn.STATUS).to_pylist() == [r.status.value for r in records]
    assert table.column(RequestColumn.ERROR_CLASS).to_pylist() == [
        r.error_class.value for r in records
    ]


def test_parts_are_readable_while_open_and_merged_on_close(tmp_path):
    writer = _writer(tmp_path)
    for batch in range(3):
        writer.append_requests(
            [RequestRecord(request_id=f"b{batch}-{i}", status=RequestStatus.OK) for i in range(2)]
        )
        writer.append_chunks([(f"b{batch}-0", 10 * batch, 1, 4)])
        open_now = open_run(writer.run_dir)  # the writer is still open
        assert open_now.requests.num_rows == 2 * (batch + 1)
        assert open_now.chunks.num_rows == batch + 1
        assert read_manifest(writer.run_dir).complete is False
    writer.close(complete=True, reason=None)
    run = writer.run_dir
    assert not (run / ".parts").exists()
    assert pq.ParquetFile(run / "requests.parquet").num_row_groups == 1  # small parts, joined
    done = open_run(run)
    assert done.requests.num_rows == 6 and done.manifest.complete is True
    assert done.manifest.num_requests_recorded == 6 and done.manifest.config == {"seed": 1}


@pytest.mark.parametrize(("parts_per_group", "groups"), [(1, 5), (2, 3), (4, 2), (5, 1), (9, 1)])
def test_close_joins_consecutive_parts_into_row_groups_of_the_size_set(
    tmp_path, monkeypatch, parts_per_group, groups
):
    """Parts are joined in order until a group holds ROW_GROUP_BYTES (here set to that many
    parts' bytes): five parts make ceil(5 / k) groups, and the rows keep their order."""
    from slo.runrecord import writer as writer_module

    writer = _writer(tmp_path)
    for part in range(5):
        writer.append_requests([RequestRecord(request_id=f"p{part}", status=RequestStatus.OK)])
    one_part = pq.read_table(next((writer.run_dir / ".parts").glob("requests-*.parquet"))).nbytes
    monkeypatch.setattr(writer_module, "ROW_GROUP_BYTES", parts_per_group * one_part)
    writer.close(complete=True, reason=None)
    assert pq.ParquetFile(writer.run_dir / "requests.parquet").num_row_groups == groups
    ids = open_run(writer.run_dir).requests.column(RequestColumn.REQUEST_ID).to_pylist()
    assert ids == [f"p{part}" for part in range(5)]


def test_chunk_columns_write_the_same_rows_as_chunk_tuples(tmp_path):
    import numpy as np

    rows = [("a", 5, 1, 2), ("a", 9, 0, 0), ("c", -3, 2**31 - 1, 7)]
    by_rows, by_columns = _writer(tmp_path / "r"), _writer(tmp_path / "c")
    by_rows.append_chunks(rows)
    # "b" owns no chunk: a count of 0 is a request with none
    by_columns.append_chunk_columns(
        ["a", "b", "c"], np.array([2, 0, 1]), np.array([5, 9, -3]),
        np.array([1, 0, 2**31 - 1]), np.array([2, 0, 7]),
    )  # fmt: skip
    for writer in (by_rows, by_columns):
        writer.close(complete=True, reason=None)
    assert open_run(by_rows.run_dir).chunks.equals(open_run(by_columns.run_dir).chunks)
    with pytest.raises(ValueError, match="differ in length"):
        _writer(tmp_path / "bad").append_chunk_columns(
            ["a"], np.array([2]), np.array([1]), np.array([1]), np.array([1])
        )
    with pytest.raises(Exception, match="not in range"):  # an int32 column overflows loudly
        _writer(tmp_path / "big").append_chunk_columns(
            ["a"], np.array([1]), np.array([1]), np.array([2**31]), np.array([1])
        )


def test_a_killed_writer_leaves_every_appended_row(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    script = f"""
import os, signal
from slo.runrecord import RequestRecord, RequestStatus, RunManifest, RunWriter
w = RunWriter({str(run)!r}, RunManifest(t0_ns=0))
w.append_requests([RequestRecord(request_id="a", status=RequestStatus.OK)])
w.append_requests([RequestRecord(request_id="b", status=RequestStatus.TIMEOUT)])
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60)
    assert proc.returncode == -9
    tables = open_run(run)
    assert tables.requests.column(RequestColumn.REQUEST_ID).to_pylist() == ["a", "b"]
    assert tables.manifest.complete is False


def test_open_run_refuses_a_manifest_of_another_version(tmp_path):
    writer = _writer(tmp_path)
    writer.close(complete=True)
    path = writer.run_dir / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(RunRecordError, match="schema_version 99"):
        open_run(writer.run_dir)


@pytest.mark.slow
def test_bench_report_on_a_future_run_is_one_sentence(tmp_path):
    writer = _writer(tmp_path)
    writer.append_requests([RequestRecord(request_id="r", status=RequestStatus.OK)])
    writer.close(complete=True)
    path = writer.run_dir / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 2}))
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "report", str(writer.run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "schema_version 2" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_contracts_doc_matches_the_module():
    doc = (ROOT / "docs" / "CONTRACTS.md").read_text()
    assert contract_markdown() in doc, (
        "docs/CONTRACTS.md differs from slo.runrecord; run `python -m slo.runrecord.docs --write`"
    )
    assert replace_section(doc) == doc
