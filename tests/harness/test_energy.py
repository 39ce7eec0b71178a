"""The energy meter (`harness.run.energy`) on a fake sysfs powercap tree and a fake NVML: package
zones only, a wraparound undone, GPUs that do and do not count, and the record's reasons when
nothing can be read; and one `bench run --cost-per-hour` against the managed tiny-random engine,
whose summary carries the bounds, the cost and the energy."""

from __future__ import annotations

import json
import math
import sys

import pytest

from harness.run.energy import EnergyMeter, counted
from reports.build import build_card
from reports.html import render_html
from slo.runrecord import EnergyRecord, RunSummary

MAX_UJ = 262_143_328_850  # a real package's max_energy_range_uj


def zone(root, dirname: str, name: str, energy_uj: int, max_uj: int = MAX_UJ):
    path = root / dirname
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def set_energy(path, energy_uj: int) -> None:
    (path / "energy_uj").write_text(f"{energy_uj}\n")


class FakeNVML:
    """`pynvml`'s calls the meter makes: GPU 0 counts millijoules, GPU 1 cannot (pre-Volta)."""

    def __init__(self, energy_mj: list[float | None]):
        self.energy_mj = energy_mj
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.energy_mj)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if self.energy_mj[handle] is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.energy_mj[handle]

    def nvmlShutdown(self):
        self.shut = True


class NoNVML:
    def nvmlInit(self):
        raise RuntimeError("NVML_ERROR_LIBRARY_NOT_FOUND")


def test_package_zones_counted_once_with_a_wraparound(tmp_path):
    root = tmp_path / "powercap"
    pkg0 = zone(root, "intel-rapl:0", "package-0", 1_000)
    pkg1 = zone(root, "intel-rapl:1", "package-1", MAX_UJ - 2_000_000)  # wraps during the run
    core = zone(root, "intel-rapl:0:0", "core", 500)  # part of package-0
    psys = zone(root, "intel-rapl:2", "psys", 7_000)  # the whole platform, packages included
    mmio = zone(root, "intel-rapl-mmio:0", "package-0", 9_000)  # package-0 again, by MMIO
    nvml = FakeNVML([1_000.0, None])
    meter = EnergyMeter.open(powercap_root=root, nvml=nvml)
    meter.begin()
    set_energy(pkg0, 6_000_000)
    set_energy(pkg1, 3_000_000)
    for other in (core, psys, mmio):
        set_energy(other, 99_000_000)
    nvml.energy_mj[0] = 3_500.0
    record = meter.end()
    joules = [(c.name, c.joules) for c in record.counters]
    # package-0: 5,999,000 uJ; package-1: 3,000,000 + MAX - (MAX - 2,000,000) uJ; GPU 0: 2,500 mJ
    assert joules == [("rapl:package-0", 5.999), ("rapl:package-1", 5.0), ("nvml:0", 2.5)]
    assert {c.name: c.wrap_joules for c in record.counters}["rapl:package-0"] == MAX_UJ / 1e6
    assert record.unavailable is None and record.duration_s >= 0 and nvml.shut
    assert "nvml:1 does not report its energy" in meter.unavailable[0]
    assert meter.end() is record  # once ended, the same record


@pytest.mark.parametrize(
    ("start", "end", "wrap", "count"),
    [(10, 15, 100, 5), (95, 5, 100, 10), (99, 99, 100, 0), (0, 99, 100, 99), (5, 3, None, -2)],
)
def test_counted_undoes_one_wrap(start, end, wrap, count):
    assert counted(start, end, wrap) == count


def test_no_counter_anywhere_says_why(tmp_path):
    meter = EnergyMeter.open(powercap_root=tmp_path / "absent", nvml=NoNVML())
    meter.begin()
    record = meter.end()
    assert record.counters == [] and record.unavailable == (
        f"no RAPL counters ({tmp_path / 'absent'} does not exist); "
        "no GPU energy counter (NVML: NVML_ERROR_LIBRARY_NOT_FOUND)"
    )


def test_without_pynvml_and_without_package_zones(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    root = tmp_path / "powercap"
    zone(root, "intel-rapl:0", "psys", 1)
    meter = EnergyMeter.open(powercap_root=root)
    meter.begin()
    assert meter.end().unavailable == (
        f"no RAPL package zone under {root}; no GPU energy counter (pynvml is not installed)"
    )


def test_a_phase_that_never_started(tmp_path):
    record = EnergyMeter.open(powercap_root=tmp_path, nvml=NoNVML()).end()
    assert record.unavailable == "the measured phase never started"


def check_bounds_cost_and_energy(run_dir, summary: dict, req: dict) -> None:
    """The bounds, cost and energy blocks of a managed tiny-random run of 6 ok requests of 16
    prompt tokens and 8 outputs, `--cost-per-hour 3.6` and an SLO every answer meets
    (tests/harness/test_managed_and_scrape.py runs it: one engine start for both)."""
    bounds = RunSummary.from_dict(summary).bounds
    rows = [dict(zip(req, values, strict=True)) for values in zip(*req.values(), strict=True)]
    assert [(r["status"], r["usage_prompt_tokens"], r["output_tokens"]) for r in rows] == [
        ("ok", 16, 8)
    ] * 6

    # tiny-random: 4 layers, 2 KV heads, head_dim 64 / 4 = 16; bf16 (2 bytes) or float32 (4)
    geometry = json.loads((run_dir / "manifest.json").read_text())["target"]["kv_geometry"]
    kv = bounds.kv_request
    assert kv.bytes_per_token == 2 * 4 * 2 * 16 * geometry["element_bytes"]
    # each request held 16 + 8 - 1 = 23 tokens at its peak, in 2 blocks of 16 slots
    assert kv.n == 6 and kv.bound_bytes == 6 * 23 * kv.bytes_per_token
    assert kv.measured_bytes == sum(r["kv_peak_bytes"] for r in rows) == 6 * 32 * kv.bytes_per_token
    assert kv.ratio == pytest.approx(32 / 23) and kv.explained_ratio.max == pytest.approx(32 / 23)
    assert bounds.kv_peak.tokens_held is not None and bounds.little_law.phases
    assert "not a prefill/decode cluster" in bounds.transfer.absent

    cost = bounds.cost  # 3.6 USD an hour is 0.001 USD a second of the window
    tokens = sum(r["output_tokens"] for r in rows)
    assert cost.cost_per_hour_usd == 3.6 and cost.all_output_tokens == tokens == 48
    assert cost.usd_per_million_output_tokens == pytest.approx(
        0.001 * summary["window_s"] / tokens * 1e6
    )
    assert cost.good_output_tokens == 48 and cost.good_absent is None
    assert cost.usd_per_million_good_tokens == cost.usd_per_million_output_tokens

    record = EnergyRecord.from_dict(json.loads((run_dir / "manifest.json").read_text())["energy"])
    energy = bounds.energy
    if record.counters:  # a host with readable RAPL counters or NVML GPUs
        joules = sum(c.joules for c in record.counters)
        assert energy.joules_per_output_token == pytest.approx(joules / tokens)
    else:
        assert energy.absent == record.unavailable and record.duration_s > 0
    assert math.isfinite(record.duration_s)

    html = render_html(build_card(run_dir))
    assert "Bounds and cost" in html and "per million of all 48 output tokens" in html
