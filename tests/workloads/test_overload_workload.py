"""The `overload` built-in: its stages are the phases a run is cut by. The build keeps them in
its manifest (which a run's manifest.json holds), `slo.load_phases` reads them back, and each
phase holds exactly rate x duration requests. End to end, the whole 75 s schedule against the
managed tiny-random engine (far faster than its sizing, so nothing is shed) is in the soak tier;
`tests/harness/test_builtin_workloads_e2e.py` runs a few of its requests in every CI run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from reports.build import build_card
from slo.load_phases import load_phases, phase_of
from slo.overload import phase_kinds
from workloads import resolve_workload

# (duration_s, rate) of the five stages: base, ramp, ramp, hold, base
STAGES = [(15.0, 6.0), (5.0, 12.0), (5.0, 18.0), (10.0, 24.0), (40.0, 6.0)]
PER_PHASE = [90, 60, 90, 240, 240]  # rate x duration
KINDS = ["base", "peak", "peak", "peak", "after_peak"]


def test_the_build_keeps_its_stages_and_each_phase_its_requests(bpe_tokenizer):
    built = resolve_workload("overload", tokenizer=bpe_tokenizer, use_cache=False)
    arrivals = built.manifest["parameters"]["effective"]["arrivals"]
    assert arrivals["process"] == "stages"
    assert [(s["duration_s"], s["rate"]) for s in arrivals["stages"]] == STAGES
    assert built.manifest["duration_s"] == 75 and built.table.num_rows == sum(PER_PHASE) == 720
    arrival_ns = np.array(built.table.column("arrival_s").to_pylist()) * 1e9
    phases = load_phases(built.manifest, arrival_ns)
    assert [(p.start_ns / 1e9, p.end_ns / 1e9) for p in phases] == [
        (0.0, 15.0), (15.0, 20.0), (20.0, 25.0), (25.0, 35.0), (35.0, 75.0)
    ]  # fmt: skip
    index = phase_of(arrival_ns, arrival_ns, phases)
    assert np.bincount(index).tolist() == PER_PHASE
    assert [k.value for k in phase_kinds(phases)] == KINDS
    lengths = {(r["input_tokens"], r["max_output_tokens"]) for r in built.table.to_pylist()}
    assert lengths == {(64, 32)}
    assert "capacity" in built.manifest["description"]  # the sizing and its measurement


@pytest.mark.slow
@pytest.mark.soak
def test_the_whole_schedule_against_tiny_random(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "harness.cli", "run", "--model", "tiny-random",
               "--workload", "overload", "--quiet", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    block = build_card(out).overload
    assert [p.n_sent for p in block.phases] == PER_PHASE
    assert [p.kind for p in block.phases] == KINDS
    assert (block.n_shed, block.first_shed_s) == (0, None)  # tiny-random keeps up
    assert [p.n_ok for p in block.phases] == PER_PHASE
    for phase in block.phases:  # a steady state in every phase: Little's law holds loosely
        assert 0.5 < phase.little_law.ratio < 1.5
