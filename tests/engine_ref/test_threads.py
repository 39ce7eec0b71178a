"""The engine's default thread count follows the CPUs the process may run on (its affinity
mask), not the machine's count: a process pinned to one CPU (taskset, a cpuset, an xdist
worker in this suite) runs one thread instead of spinning two on one core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_ref import EngineConfig

CODE = (
    "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    "from engine_ref import EngineConfig; "
    "print(EngineConfig(model='tiny-random').threads(), EngineConfig(model='tiny-random', "
    "num_threads=3).threads())"
)


pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS"
)


def test_a_process_pinned_to_one_cpu_gets_one_thread():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "3"]  # the mask's one CPU; an explicit count stands


def test_the_default_is_the_affinity_mask_here():
    assert EngineConfig(model="tiny-random").threads() == len(os.sched_getaffinity(0))
