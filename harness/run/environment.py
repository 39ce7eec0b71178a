"""Facts about the machine and the checkout, for the run manifest."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# Flags whose value is a secret (a token in a header, an API key): kept out of the manifest.
SECRET_FLAGS = ("--otlp-header", "--header", "--api-key")
URL_FLAGS = ("--otlp",)  # a URL that may carry credentials: recorded without them
REDACTED = "<redacted>"


def hardware_info() -> dict:
    """CPU model, core count, memory and GPU (when there is one), without failing."""
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
    info["gpu"] = _gpu_name()
    return info


def _gpu_name() -> str | None:
    """The first GPU's name: torch's word when this process already imported it (a reference
    engine in-process), else `nvidia-smi`'s; a client never imports torch only to ask."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        except Exception:  # a broken CUDA set-up says nothing about the run
            return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=5, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


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


def recorded_command_line(argv: list[str]) -> list[str]:
    """`argv` as the manifest records it: the values of `SECRET_FLAGS` replaced by
    `<redacted>` and the `URL_FLAGS` URLs without user, password or query (both the
    `--flag value` and `--flag=value` forms)."""
    out: list[str] = []
    after: str | None = None
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if after is not None:
            out.append(_recorded_value(after, arg))
            after = None
        elif flag in (*SECRET_FLAGS, *URL_FLAGS) and eq:
            out.append(f"{flag}={_recorded_value(flag, value)}")
        else:
            out.append(arg)
            after = arg if arg in (*SECRET_FLAGS, *URL_FLAGS) else None
    return out


def _recorded_value(flag: str, value: str) -> str:
    if flag in SECRET_FLAGS:
        return REDACTED
    try:
        parts = urlsplit(value)
        host = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
    except ValueError:
        return REDACTED
