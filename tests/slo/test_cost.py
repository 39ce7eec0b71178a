"""Cost per million output tokens at the SLO (`slo.cost`), worked by hand on a run written with
the production writer, its boundaries, and `--cost-per-hour` refused in one sentence."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner
from slo_runs import ms, write_run

from harness.cli.main import bench
from harness.errors import HarnessError
from reports.bounds_view import cost_sentence, energy_sentence
from slo import summarize
from slo.cost import NO_COST, NO_GOOD, NO_SLO
from slo.runrecord import EnergyCounter, EnergyRecord, RunSummary

TTFT_200 = {"name": "ttft-200", "per_request": {"ttft_ms": 200.0}}
S = 1000.0  # ms


def cost_rows() -> list[dict]:
    """Four requests over a 360 s window (first send 0, last done 360 s):

    a ok, TTFT 100 ms, 100 tokens: meets TTFT <= 200 ms.
    b ok, TTFT 500 ms, 50 tokens: misses it.
    c error after 30 streamed tokens: fails (its tokens count in all, never as good).
    d ok, TTFT 150 ms, 20 tokens: meets it.
    """
    return [
        dict(request_id="a", t_sent_ns=ms(0), t_first_token_ns=ms(100), t_last_token_ns=ms(10 * S),
             t_done_ns=ms(10 * S), status="ok", input_tokens=10, output_tokens=100),
        dict(request_id="b", t_sent_ns=ms(1 * S), t_first_token_ns=ms(1 * S + 500),
             t_last_token_ns=ms(20 * S), t_done_ns=ms(20 * S), status="ok", input_tokens=10,
             output_tokens=50),
        dict(request_id="c", t_sent_ns=ms(2 * S), t_first_token_ns=ms(2 * S + 100),
             t_done_ns=ms(30 * S), status="error", error_class="incomplete_stream",
             input_tokens=10, output_tokens=30),
        dict(request_id="d", t_sent_ns=ms(300 * S), t_first_token_ns=ms(300 * S + 150),
             t_last_token_ns=ms(360 * S), t_done_ns=ms(360 * S), status="ok", input_tokens=10,
             output_tokens=20),
    ]  # fmt: skip


def cost_of(tmp_path, cost_per_hour, spec=TTFT_200, **manifest):
    config = {} if cost_per_hour is None else {"cost_per_hour": cost_per_hour}
    run_dir = write_run(tmp_path / "run", cost_rows(), [], {"config": config, **manifest})
    return RunSummary.from_dict(summarize(run_dir, spec)).bounds


def test_cost_per_million_good_tokens_worked_by_hand(tmp_path):
    cost = cost_of(tmp_path, 10.0).cost
    # 10 USD/h x 360 s = 1 USD; good tokens a + d = 120; all tokens 100 + 50 + 30 + 20 = 200
    assert cost.window_s == 360.0 and cost.run_cost_usd == pytest.approx(1.0)
    assert (cost.good_output_tokens, cost.all_output_tokens) == (120, 200)
    assert cost.usd_per_million_good_tokens == pytest.approx(1.0 / 120 * 1e6)  # 8,333.33
    assert cost.usd_per_million_output_tokens == pytest.approx(1.0 / 200 * 1e6)  # 5,000
    assert cost.good_absent is None and cost.all_absent is None and cost.absent is None


def test_without_an_slo_only_the_all_tokens_figure_and_why(tmp_path):
    cost = cost_of(tmp_path, 10.0, spec=None).cost
    assert cost.usd_per_million_good_tokens is None and cost.good_output_tokens is None
    assert cost.usd_per_million_output_tokens == pytest.approx(5000.0)
    assert cost.good_absent == NO_SLO


def test_no_good_token_has_no_figure_and_says_it_is_infinite(tmp_path):
    spec = {"name": "ttft-50", "per_request": {"ttft_ms": 50.0}}  # none is that fast
    cost = cost_of(tmp_path, 10.0, spec=spec).cost
    assert cost.good_output_tokens == 0 and cost.usd_per_million_good_tokens is None
    assert cost.good_absent == NO_GOOD and "infinite" in NO_GOOD
    assert cost.usd_per_million_output_tokens == pytest.approx(5000.0)


@pytest.mark.parametrize(("per_hour", "good", "every"), [(0.0, 0.0, 0.0), (0.01, 1e-3 / 120 * 1e6, 1e-3 / 200 * 1e6)])  # fmt: skip
def test_a_free_or_cheap_target(tmp_path, per_hour, good, every):
    cost = cost_of(tmp_path, per_hour).cost
    assert cost.usd_per_million_good_tokens == pytest.approx(good)
    assert cost.usd_per_million_output_tokens == pytest.approx(every)


def test_without_a_cost_the_block_says_so(tmp_path):
    cost = cost_of(tmp_path, None).cost
    assert cost.absent == NO_COST and cost.run_cost_usd is None


def test_energy_per_output_token_from_the_manifest_record(tmp_path):
    record = EnergyRecord(
        counters=[EnergyCounter(name="rapl:package-0", joules=300.0),
                  EnergyCounter(name="nvml:0", joules=100.0)],
        duration_s=360.0,
    )  # fmt: skip
    target = {"url": "http://127.0.0.1:8000/v1"}
    energy = cost_of(tmp_path, None, energy=record.to_dict(), target=target).energy
    assert energy.joules == 400.0 and energy.all_output_tokens == 200
    assert energy.joules_per_output_token == pytest.approx(2.0)
    assert energy.mean_power_w == pytest.approx(400 / 360)
    assert energy.joules_by_counter == {"rapl:package-0": 300.0, "nvml:0": 100.0}
    assert "this host" in energy.note and energy.absent is None


@pytest.mark.parametrize(
    ("record", "target", "absent"),
    [
        (None, {}, "recorded no energy counters"),
        (EnergyRecord(counters=[], unavailable="no RAPL counters (x does not exist)").to_dict(), {},
         "no RAPL counters (x does not exist)"),
        (EnergyRecord(counters=[EnergyCounter(name="rapl:package-0", joules=1.0)], duration_s=1.0).to_dict(),
         {"url": "http://gpu-box:8000/v1"}, "the target (gpu-box) is not on the harness's host"),
    ],
)  # fmt: skip
def test_energy_absent_with_the_reason(tmp_path, record, target, absent):
    energy = cost_of(tmp_path, None, energy=record, target=target).energy
    assert energy.joules_per_output_token is None and absent in energy.absent


@pytest.mark.parametrize(("value", "ok"), [("-0.01", False), ("nan", False), ("inf", False), ("0", True)])  # fmt: skip
def test_the_config_refuses_a_cost_below_zero(tmp_path, value, ok):
    # An unreachable URL: a cost the config accepts gets as far as contacting the target.
    args = ["run", "--url", "http://127.0.0.1:9/v1", "--tokenizer", "tiny-random", "--num-requests", "1",
            "--out", str(tmp_path / "r"), "--quiet", "--cost-per-hour", value]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    refused = f"--cost-per-hour must be a dollar amount of zero or more, got {float(value)!r}."
    if ok:
        assert isinstance(result.exception, HarnessError) and "127.0.0.1:9" in str(result.exception)
    else:
        assert isinstance(result.exception, HarnessError) and str(result.exception) == refused
    assert not (tmp_path / "r").exists()


def test_bench_run_refuses_a_negative_cost_in_one_sentence(tmp_path):
    command = [sys.executable, "-m", "harness.cli", "run", "--url", "http://127.0.0.1:9/v1",
               "--tokenizer", "tiny-random", "--num-requests", "1", "--cost-per-hour", "-1",
               "--out", str(tmp_path / "r")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr == "error: --cost-per-hour must be a dollar amount of zero or more, got -1.0.\n"
    )
    assert not (tmp_path / "r").exists()


def test_the_card_sentences(tmp_path):
    record = EnergyRecord(
        counters=[EnergyCounter(name="rapl:package-0", joules=400.0)], duration_s=360.0
    )
    bounds = cost_of(
        tmp_path, 10.0, energy=record.to_dict(), target={"url": "http://localhost:1/v1"}
    )
    assert cost_sentence(bounds.cost) == (
        "Cost: $8,333.3333 per million output tokens at the SLO (120 tokens of good requests); "
        "$5,000.0000 per million of all 200 output tokens; the run cost $1.0000 ($10.00 an hour "
        "over 360.0 s)."
    )
    assert energy_sentence(bounds.energy).startswith(
        "Energy: 400.0 J over 360.0 s (1.11 W): 2.0000 J per output token (rapl:package-0 400.0 J); "
    )
    assert cost_sentence(cost_of(tmp_path / "b", None).cost) == f"Cost: absent: {NO_COST}."
