"""`bench history`: the run history database, trends and the trend gate, through the `bench` CLI.

The acceptance case: 30 nightly runs (written by the production writer) whose latencies step up
by 30% from run 20 on. The history shows the shift at run 20, the trend gate passes each of
runs 2-19 against the runs before it, calls run 20 (a lone run beyond the others)
inconclusive, and calls the regression, located at run 20, once further runs share the level.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import numpy as np
import pytest
from click.testing import CliRunner
from history_builder import clone_runs, write_series
from rundir_builder import SyntheticRun, write_run

from harness.cli.main import bench
from reports.errors import ReportError
from reports.history import trend as trend_module
from reports.history.catalogue import resolve_metric
from reports.history.record import api_of, read_run
from reports.history.schema import CREATE_V1, SCHEMA_VERSION
from reports.history.store import HistoryStore
from reports.history.trend import TrendConfig, find_shifts, trend_gate

ROOT = Path(__file__).resolve().parents[2]
STEP_AT = 20  # the first run of the new level (1-based)


def cli(*args: str):
    return CliRunner().invoke(bench, ["history", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def nightly(tmp_path_factory) -> tuple[Path, list[Path]]:
    """30 runs, latencies x1.3 from run 20 on, all added to one history."""
    root = tmp_path_factory.mktemp("nightly")
    runs = write_series(root / "runs", [1.0] * (STEP_AT - 1) + [1.3] * (31 - STEP_AT))
    db = root / "history.duckdb"
    result = cli("add", *map(str, runs), "--history", str(db))
    assert result.exit_code == 0, result.output
    return db, runs


def show_json(db: Path, metric: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{metric}.json"
    result = cli("show", "--metric", metric, "--history", str(db), "--json", str(out))
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def gate_json(db: Path, run: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / f"gate-{Path(run).name}.json"
    result = cli("gate", run, "--history", str(db), "--json", str(out), *extra)
    return result.exit_code, json.loads(out.read_text())


# acceptance -------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["ttft_p50", "ttft_p99", "tpot_p50", "e2e_p99"])
def test_the_history_shows_the_step_at_run_20(nightly, tmp_path, metric):
    db, _ = nightly
    trend = show_json(db, metric, tmp_path)
    assert len(trend["points"]) == 30
    shifts = trend["shifts"]
    assert len(shifts) == 1, shifts
    assert abs(shifts[0]["index"] + 1 - STEP_AT) <= 1
    assert shifts[0]["worse"] and shifts[0]["change"] > 0.2


def test_runs_1_to_19_show_no_shift_and_pass_against_each_other(nightly):
    db, _ = nightly
    runs = HistoryStore(db).runs()[: STEP_AT - 1]
    for k in range(1, len(runs)):
        result = trend_gate(runs, runs[k])
        assert result.verdict == "pass", (runs[k].run_id, result.results)
        assert result.window == [r.run_id for r in runs[:k]]


def test_the_gate_flags_the_step_at_run_20(nightly, tmp_path):
    db, _ = nightly
    code, first = gate_json(db, "run-19", tmp_path)
    assert (code, first["verdict"]) == (0, "pass")
    # run 20 alone: beyond every earlier run, but one run is not yet a change point
    code, lone = gate_json(db, "run-20", tmp_path)
    assert (code, lone["verdict"]) == (3, "inconclusive")
    # by run 22 the new level is shared: a regression, located at run 20
    code, confirmed = gate_json(db, "run-22", tmp_path)
    assert (code, confirmed["verdict"]) == (1, "regressed")
    located = [r["shift_run_id"] for r in confirmed["results"] if r["verdict"] == "regressed"]
    assert located and all(r is not None for r in located)
    assert sum(abs(int(r.split("-")[1]) - STEP_AT) <= 1 for r in located) >= len(located) - 1
    ttft = next(r for r in confirmed["results"] if r["metric"] == "ttft_p50_ms")
    assert ttft["verdict"] == "regressed" and ttft["shift_run_id"] == "run-20"


def test_bench_compare_history_gate_is_the_trend_gate(nightly, tmp_path):
    """`bench compare RUN --history FILE --gate` (the issue's spelling) judges RUN as `bench
    history gate` does, exit codes included: pass at run 19, inconclusive at 20, regressed at
    22; `--history RUN` with no file is the run against the default history. Without --gate
    the exit code is 0, as for two runs."""
    db, runs = nightly
    for k, want in ((19, 0), (20, 3), (22, 1)):
        run = str(runs[k - 1])
        out = tmp_path / f"cmp-{k}.json"
        args = ["compare", run, "--history", str(db), "--gate", "--json", str(out)]
        result = CliRunner().invoke(bench, args, catch_exceptions=False)
        code, direct = gate_json(db, run, tmp_path)
        assert result.exit_code == code == want, result.output
        assert json.loads(out.read_text()) == direct
    ungated = CliRunner().invoke(bench, ["compare", str(runs[21]), "--history", str(db)])
    assert ungated.exit_code == 0 and "regressed" in ungated.output
    cache = tmp_path / "cache"
    (cache / "history").mkdir(parents=True)
    shutil.copy(db, cache / "history" / "history.duckdb")
    result = CliRunner(env={"BENCH_CACHE_DIR": str(cache)}).invoke(
        bench, ["compare", "--history", str(runs[21]), "--gate"]
    )
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["RUN2"], "takes one run"),
        (["--slo", "p99"], "--slo compare two runs"),
        (["--markdown", "m.md", "--allow-mismatch"], "--markdown, --allow-mismatch compare two"),
    ],
)
def test_bench_compare_history_refuses_what_only_two_runs_take(nightly, tmp_path, extra, said):
    db, runs = nightly
    extra = [str(runs[1]) if e == "RUN2" else e for e in extra]
    args = ["compare", str(runs[0]), *extra, "--history", str(db), "--gate"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output


def test_bench_compare_still_needs_two_runs_without_history(nightly):
    result = CliRunner().invoke(bench, ["compare", str(nightly[1][0])])
    assert result.exit_code == 2 and "or one run with --history" in result.output


def test_the_new_level_becomes_the_baseline(nightly, tmp_path):
    db, _ = nightly
    code, late = gate_json(db, "run-30", tmp_path)
    assert (code, late["verdict"]) == (0, "pass")
    ttft = next(r for r in late["results"] if r["metric"] == "ttft_p50_ms")
    assert ttft["baseline_runs"][0] in ("run-19", "run-20", "run-21")


def test_with_detection_off_the_step_is_not_flagged(nightly, monkeypatch):
    # Negative control of the acceptance: no change-point search, no regression verdict.
    runs = HistoryStore(nightly[0]).runs()
    assert trend_gate(runs, runs[21]).verdict == "regressed"
    assert trend_gate(runs, runs[21], TrendConfig(detect=False)).verdict != "regressed"


def test_a_new_run_directory_is_gated_and_added(nightly, tmp_path):
    db, runs = nightly
    copy = shutil.copytree(runs[-1], tmp_path / "candidate")
    local = tmp_path / "h.duckdb"
    shutil.copy(db, local)
    code, result = gate_json(local, str(copy), tmp_path, "--add")
    assert code == 0 and result["candidate"] == "run-30"  # its run id: already present
    assert HistoryStore(local).count() == 30


# the database -----------------------------------------------------------------------------


def test_adding_the_same_run_twice_changes_nothing(tmp_path):
    run = write_run(tmp_path / "r1", SyntheticRun(n_requests=20))
    db = tmp_path / "h.duckdb"
    assert "added 1 run(s)" in cli("add", str(run), str(run), "--history", str(db)).output
    again = cli("add", str(run), "--history", str(db))
    assert (
        again.exit_code == 0
        and "added 0 run(s)" in again.output
        and "1 already present" in again.output
    )
    assert HistoryStore(db).count() == 1


def test_a_deleted_run_directory_still_shows(tmp_path):
    run = write_run(tmp_path / "gone", SyntheticRun(n_requests=20))
    db = tmp_path / "h.duckdb"
    cli("add", str(run), "--history", str(db))
    before = HistoryStore(db).runs()[0].metrics["ttft_p99_ms"]
    shutil.rmtree(run)
    listing = cli("list", "--runs", "--history", str(db))
    assert "deleted" in listing.output
    after = HistoryStore(db).runs()[0].metrics["ttft_p99_ms"]
    assert after == before and after.ci_low <= after.value <= after.ci_high


def test_every_figure_lies_in_its_interval(nightly):
    for run in HistoryStore(nightly[0]).runs():
        for key, p in run.metrics.items():
            assert p.ci_low is not None, key
            assert p.ci_low - 1e-9 <= p.value <= p.ci_high + 1e-9, (run.run_id, key, p)


def test_a_version_1_database_opens_with_the_current_code(tmp_path):
    run = read_run(write_run(tmp_path / "old", SyntheticRun(n_requests=20)))
    db = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(db))
    for statement in CREATE_V1:
        con.execute(statement)
    key = run.key
    con.execute(
        "INSERT INTO runs VALUES (?, NULL, now()::TIMESTAMP, ?, true, 20, ?, ?, ?, ?, ?, NULL, ?, ?, 'p99', NULL)",
        [run.run_id, run.run_dir, key.workload_name, key.workload_sha256, key.engine,
         key.engine_version, key.model, key.dtype, key.hardware],
    )  # fmt: skip
    con.execute("INSERT INTO metrics VALUES (?, 'ttft_p99_ms', 81.5, 70.0, 90.0, 20)", [run.run_id])
    con.close()
    (migrated,) = HistoryStore(db).runs()
    assert migrated.key.series_id == run.key.series_id  # backfilled by SQL = computed in Python
    assert migrated.metrics["ttft_p99_ms"].value == 81.5
    con = duckdb.connect(str(db))
    assert con.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    con.close()
    # and the migrated history takes new runs of the same series
    HistoryStore(db).add(
        [read_run(write_run(tmp_path / "new", SyntheticRun(n_requests=20, seed=5)))]
    )
    assert len({r.key.series_id for r in HistoryStore(db).runs()}) == 1


def _add_process(db: Path, runs: list[Path]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "history", "add", "--history", str(db), *map(str, runs)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_processes_adding_50_runs_each_leave_100(tmp_path):
    source = write_run(tmp_path / "source", SyntheticRun(n_requests=12))
    a = clone_runs(source, tmp_path / "a", 50, "a")
    b = clone_runs(source, tmp_path / "b", 50, "b")
    db = tmp_path / "h.duckdb"
    procs = [_add_process(db, a), _add_process(db, b)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert HistoryStore(db).count() == 100


def test_a_new_history_appears_whole(tmp_path, monkeypatch):
    """A new history is built in a file of its own and linked into place: DuckDB is never
    asked to create the history's own path, so a second process can never open a file the
    first has only begun to write. (It could: the 50 + 50 test above failed under load with
    "exists, but it is not a valid DuckDB database file".) Negative control: connecting to
    the missing path, as before, is caught by the spy."""
    import duckdb

    db = tmp_path / "h.duckdb"
    created_in_place: list[str] = []
    connect = duckdb.connect

    def spy(path, *args, **kwargs):
        if Path(path) == db and not db.exists():
            created_in_place.append(str(path))
        return connect(path, *args, **kwargs)

    monkeypatch.setattr(duckdb, "connect", spy)
    HistoryStore(db).add([])
    assert created_in_place == []
    assert HistoryStore(db).count() == 0
    assert [p.name for p in tmp_path.iterdir()] == ["h.duckdb"]  # the build file is gone


@pytest.fixture
def held_lock(tmp_path):
    """(database, release): another process holds the history open until `release()`."""
    db = tmp_path / "h.duckdb"
    HistoryStore(db).add([])  # create it
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys\n"
         "c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.readline(); c.close()", str(db)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"

    def release() -> None:
        if not holder.stdin.closed:
            holder.stdin.close()

    yield db, release
    release()
    holder.wait(timeout=30)
    holder.stdout.close()


def test_an_add_waits_for_the_lock(held_lock, tmp_path):
    db, release = held_lock
    run = read_run(write_run(tmp_path / "r", SyntheticRun(n_requests=12)))
    threading.Timer(0.5, release).start()  # the holder lets go while the add is retrying
    HistoryStore(db, lock_timeout_s=60).add([run])
    assert HistoryStore(db).count() == 1


def test_an_add_gives_up_after_the_bounded_wait(held_lock, tmp_path):
    db, _ = held_lock
    run = read_run(write_run(tmp_path / "r", SyntheticRun(n_requests=12)))
    with pytest.raises(ReportError, match="locked"):
        HistoryStore(db, lock_timeout_s=0.1).add([run])


def test_the_cli_default_window_is_the_gate_default():
    from reports.history import cli as history_cli

    assert history_cli.DEFAULT_WINDOW == trend_module.DEFAULT_WINDOW


# bad input: one sentence, exit 2 --------------------------------------------------------------


def _fails_in_one_sentence(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0]


def test_bad_input_is_one_sentence(nightly, tmp_path):
    db, _ = nightly
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    _fails_in_one_sentence(cli("add", str(not_a_run), "--history", str(db)), "requests.parquet")
    _fails_in_one_sentence(
        cli("show", "--metric", "ttft_p42", "--history", str(db)), "unknown metric"
    )
    _fails_in_one_sentence(cli("gate", "no-such-run", "--history", str(db)), "neither")
    corrupt = tmp_path / "corrupt.duckdb"
    corrupt.write_bytes(b"not a database " * 200)
    _fails_in_one_sentence(cli("list", "--history", str(corrupt)), "not a readable history")
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).execute("CREATE TABLE t (a INTEGER)").close()
    _fails_in_one_sentence(cli("list", "--history", str(other)), "not a bench history")
    newer = tmp_path / "newer.duckdb"
    con = duckdb.connect(str(newer))
    con.execute("CREATE TABLE schema_version (version INTEGER)")
    con.execute("INSERT INTO schema_version VALUES (99)")
    con.close()
    _fails_in_one_sentence(cli("list", "--history", str(newer)), "version 99")
    _fails_in_one_sentence(
        cli("show", "--metric", "ttft_p99", "--history", str(tmp_path / "none.duckdb")),
        "no history",
    )


def test_show_without_enough_keys_lists_the_series(tmp_path):
    db = tmp_path / "h.duckdb"
    one = write_run(tmp_path / "a", SyntheticRun(n_requests=12))
    two = write_run(
        tmp_path / "b", SyntheticRun(n_requests=12, engine="vllm", engine_version="0.9")
    )
    cli("add", str(one), str(two), "--history", str(db))
    _fails_in_one_sentence(
        cli("show", "--metric", "ttft_p99", "--history", str(db)), "2 series match", "--target"
    )
    picked = cli("show", "--metric", "ttft_p99", "--target", "vllm", "--history", str(db))
    assert picked.exit_code == 0 and "vllm 0.9" in picked.output


# the trend card -----------------------------------------------------------------------------


def test_the_trend_card_is_self_contained(nightly, tmp_path):
    db, _ = nightly
    out = tmp_path / "trend.html"
    result = cli("report", "-o", str(out), "--history", str(db))
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert html.count('<figure class="chart"') == 6  # the six default metrics, one series
    assert html.count("<svg") == 6
    assert "<script" not in html and 'src="http' not in html and "@import" not in html
    assert "TTFT p99" in html and "from run-20" in html  # the shift, named


def test_the_gate_divides_its_significance_among_metrics(nightly, monkeypatch):
    # With the per-metric test at the full 5% (no Bonferroni), two unlucky runs would do: the
    # gate must not pass that significance through undivided.
    seen = []
    real = trend_module.find_shifts
    monkeypatch.setattr(
        trend_module, "find_shifts", lambda *a, **k: seen.append(a[2].significance) or real(*a, **k)
    )
    runs = HistoryStore(nightly[0]).runs()
    trend_gate(runs, runs[5], TrendConfig(metrics=("ttft_p50", "ttft_p99")))
    assert set(seen) == {0.025}


@pytest.mark.parametrize(
    ("after", "widths", "kept"),
    [
        (108.0, 1.0, True),  # +8%: beyond the 5% p50 threshold and the runs' own noise
        (108.0, 10.0, False),  # +8 ms but the runs' intervals are +-10 ms wide: noise
        (105.0, 0.0, False),  # +5% exactly: at the threshold, not beyond
        (105.5, 0.0, True),  # just above it
    ],
)
def test_a_shift_must_beat_the_threshold_and_the_runs_noise(after, widths, kept):
    metric = resolve_metric("ttft_p50")  # 5% relative, 1 ms floor
    config = TrendConfig()
    values = [100.0] * 10 + [after] * 10
    found = find_shifts(values, metric, config, config.rng(), np.full(20, widths))
    assert [s.index for s in found] == ([10] if kept else [])


def test_a_shift_within_the_noise_floor_is_dropped():
    metric = resolve_metric("tpot_p50")  # 0.1 ms floor
    config = TrendConfig()
    assert find_shifts([1.0] * 10 + [1.09] * 10, metric, config, config.rng()) == []  # +9%, 0.09 ms
    assert [
        s.index for s in find_shifts([1.0] * 10 + [1.11] * 10, metric, config, config.rng())
    ] == [10]


@pytest.mark.parametrize(
    ("config", "target_endpoint", "api"),
    [
        ({}, "/v1/completions", None),  # streamed completions: the default adds nothing
        ({"endpoint": "completions"}, "completions", None),
        ({"endpoint": "chat"}, "chat", "chat"),
        ({}, "/v1/chat/completions", "chat"),
        ({"stream": False}, "completions", "not streamed"),
        ({"endpoint": "embeddings", "batch_size": 8}, "embeddings", "embeddings, batch 8"),
        ({"endpoint": "rerank", "batch_size": 1}, "rerank", "rerank"),
        ({"endpoint": "rerank", "batch_size": {"dist": "uniform", "low": 2, "high": 8}}, "rerank",
         'rerank, batch {"dist": "uniform", "high": 8, "low": 2}'),
    ],
)  # fmt: skip
def test_the_api_a_run_used_is_part_of_its_series(tmp_path, config, target_endpoint, api):
    """The same workload sent to another API measures something else: its runs are another
    series (bench history list once put responses, messages and rerank runs of `random` in one)."""
    from slo.runrecord import read_manifest, write_json_atomic
    from slo.runrecord.reader import MANIFEST_FILE

    base = write_run(tmp_path / "base", SyntheticRun(n_requests=20))
    other = tmp_path / "other"
    shutil.copytree(base, other)
    manifest = read_manifest(other)
    target = {**(manifest.target or {}), "endpoint": target_endpoint}
    changes = dict(config={**(manifest.config or {}), **config}, target=target, run_id="other")
    write_json_atomic(other / MANIFEST_FILE, manifest.evolve(**changes).to_json())
    assert api_of(read_manifest(other)) == api
    same = api is None
    assert (read_run(other).key.series_id == read_run(base).key.series_id) is same
    db = tmp_path / "h.duckdb"
    HistoryStore(db).add([read_run(base), read_run(other)])
    assert len({r.key.series_id for r in HistoryStore(db).runs()}) == (1 if same else 2)


def test_the_itl_interval_weighs_a_bounded_number_of_gaps_at_once(tmp_path, monkeypatch):
    """A long run's pooled-gap bootstrap weighs at most WEIGHT_CELLS resampled gaps at a time
    (64 resamples of 30 million gaps were 15 GB, and `bench history add` was killed), and one
    resample at a time below that; the interval still holds the figure. Negative control: with
    the batch fixed at 64 again, the first bound fails."""
    from reports.history import record

    run = write_run(tmp_path / "run", SyntheticRun(n_requests=60))
    shapes: list[tuple[int, int]] = []
    weighted = record.weighted_statistic

    def spy(statistic, values, weights, *args):
        shapes.append(weights.shape)  # [resamples, gaps]
        return weighted(statistic, values, weights, *args)

    monkeypatch.setattr(record, "weighted_statistic", spy)
    gaps = None
    for cells in (3_000, 1):
        monkeypatch.setattr(record, "WEIGHT_CELLS", cells)
        shapes.clear()
        point = read_run(run).metrics["itl_p99_ms"]
        assert point.ci_low <= point.value <= point.ci_high
        gaps = shapes[0][1]
        assert 1_000 < gaps <= 3_000  # the run's gaps: one resample fits the first bound
        assert all(rows * n <= max(cells, n) for rows, n in shapes), (cells, shapes)


def test_a_sketched_run_s_itl_intervals_are_the_exact_ones_within_the_sketch_bound(tmp_path):
    """A run whose gaps overflow its memory budget is read as the summary reads it: a sketch per
    request, never the whole chunks table. Its ITL intervals resample requests with their
    buckets' counts, so with the same draws each end is within the sketch's relative error of
    the exact run's. Negative control: dropping the counts (each bucket weighed once) moves
    them well past the bound."""
    from slo.sketch import RELATIVE_ERROR

    exact = write_run(tmp_path / "exact", SyntheticRun(n_requests=80))
    sketched = write_run(tmp_path / "sketch", SyntheticRun(n_requests=80, memory_budget_mb=0.001))
    summary = json.loads((sketched / "summary.json").read_text())
    assert summary["latency_ms"]["itl"]["quantiles"] == "sketch"
    a, b = read_run(exact).metrics, read_run(sketched).metrics
    for key in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms"):
        for end in ("ci_low", "ci_high"):
            want, got = getattr(a[key], end), getattr(b[key], end)
            assert got == pytest.approx(want, rel=RELATIVE_ERROR), (key, end)
        assert b[key].ci_low <= b[key].value <= b[key].ci_high
