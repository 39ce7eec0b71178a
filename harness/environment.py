"""Facts about the machine and the checkout, for the run manifest."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def hardware_info() -> dict:
    """CPU model, core count, memory and GPU (when torch sees one), without failing."""
    info = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": None,
        "gpu": None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def git_sha() -> str | None:
    """The commit of the harness's own checkout, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def software_versions() -> dict:
    """Versions of Python and the packages whose behaviour shapes the figures (no imports)."""
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist in ("llm-bench-harness", "aiohttp", "uvloop", "orjson", "pyarrow", "numpy", "torch"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions
