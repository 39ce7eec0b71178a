"""What the CPU this process runs on offers: the cores it may use and whether it has bf16 units
(the engine's thread count and its `auto` dtype follow from them)."""

from __future__ import annotations

import os

import torch


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, a container's cpuset),
    which can be fewer than the machine's `os.cpu_count()`."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (`amx_bf16` or `avx512_bf16` among its flags).
    `cpuinfo` is the text of /proc/cpuinfo (read when None); without it, torch's own detection
    of AVX-512 decides."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & {"amx_bf16", "avx512_bf16"})
