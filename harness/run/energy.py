"""Energy over the measured phase: this host's energy counters read when it starts and when the
load ends, for the manifest's `energy` record (`slo.runrecord.EnergyRecord`), from which
`slo.cost.energy_summary` gives joules per output token.

Two kinds of counter, each read only where it exists:
- RAPL (`/sys/class/powercap`): the CPU package zones only (`intel-rapl:N` whose `name` starts
  with `package`). Their subzones (core, uncore, dram: `intel-rapl:N:M`) are parts of the
  package and would count twice, `psys` covers the whole platform including the packages, and
  `intel-rapl-mmio:N` is a second interface to the same package counter. A counter is a
  microjoule count that wraps at `max_energy_range_uj`; an end value below the start value
  wrapped once and is undone with that range. Two readings cannot see a second wrap, so a
  measured phase longer than the range at the package's power (about 44 minutes for 262 kJ at
  100 W) is counted short. Since Linux 5.10 the counters are readable by root only.
- NVML (`pynvml`, only when it imports and a GPU answers): each GPU's total energy since the
  driver loaded (millijoules, Volta and later), read the same way.

Discovery and NVML's start-up happen in `EnergyMeter.open`, before the load; `begin` and
`end` only read counters, so the start of the measured phase is not delayed. Nothing here
raises: a counter that cannot be read is left out, and with none the record says why.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slo.runrecord import EnergyCounter, EnergyRecord

POWERCAP_ROOT = Path("/sys/class/powercap")
PACKAGE_ZONE = re.compile(r"(intel|amd)-rapl:\d+")  # top-level zones; subzones have two numbers
UJ_PER_J = 1e6
MJ_PER_J = 1e3


@dataclass(frozen=True)
class RaplZone:
    """A RAPL package zone: its counter file and the value at which the counter wraps."""

    name: str
    energy_path: Path
    max_range_uj: int


def rapl_packages(root: Path = POWERCAP_ROOT) -> tuple[list[RaplZone], str | None]:
    """(the package zones under `root`, None), or ([], why there are none)."""
    if not root.is_dir():
        return [], f"no RAPL counters ({root} does not exist)"
    zones, unreadable = [], []
    for path in sorted(root.iterdir()):
        if not PACKAGE_ZONE.fullmatch(path.name):
            continue
        try:
            name = (path / "name").read_text().strip()
            if not name.startswith("package"):
                continue
            max_range = int((path / "max_energy_range_uj").read_text())
            int((path / "energy_uj").read_text())
        except PermissionError:
            unreadable.append(path.name)
            continue
        except (OSError, ValueError):
            continue
        zones.append(RaplZone(f"rapl:{name}", path / "energy_uj", max_range))
    if unreadable and not zones:
        return [], (
            f"the RAPL counters ({', '.join(unreadable)} under {root}) are readable by root "
            "only (Linux 5.10 and later)"
        )
    if not zones:
        return [], f"no RAPL package zone under {root}"
    return zones, None


def counted(start: float, end: float, wrap: float | None) -> float:
    """The count between two readings of a counter that wraps at `wrap` (None: never)."""
    if end >= start or not wrap:
        return end - start
    return end + wrap - start


@dataclass
class _Counter:
    name: str
    read: Any  # () -> the counter's value in its own unit
    per_joule: float
    wrap: float | None
    start: float | None = None


@dataclass
class EnergyMeter:
    """The counters this host has, read at `begin` and `end` (see the module docstring)."""

    counters: list[_Counter] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    nvml: Any = None
    t_begin_ns: int | None = None
    ended: EnergyRecord | None = None

    @classmethod
    def open(cls, *, powercap_root: Path = POWERCAP_ROOT, nvml: Any = None) -> EnergyMeter:
        """Find the counters: the RAPL packages under `powercap_root`, and the GPUs of `nvml`
        (a `pynvml`-like module; None: `pynvml` when it imports)."""
        meter = cls()
        zones, why = rapl_packages(powercap_root)
        if why is not None:
            meter.unavailable.append(why)
        for zone in zones:
            meter.counters.append(
                _Counter(zone.name, _file_reader(zone.energy_path), UJ_PER_J, zone.max_range_uj)
            )
        meter._open_nvml(nvml)
        return meter

    def _open_nvml(self, nvml: Any) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.unavailable.append("no GPU energy counter (pynvml is not installed)")
                return
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:  # NVML raises its own error class per failure
            self.unavailable.append(f"no GPU energy counter (NVML: {exc})")
            return
        self.nvml = nvml
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = f"nvml:{index}"
            reader = _nvml_reader(nvml, handle)
            if reader() is None:
                self.unavailable.append(f"{name} does not report its energy (before Volta)")
                continue
            self.counters.append(_Counter(name, reader, MJ_PER_J, None))
        if count == 0:
            self.unavailable.append("no GPU energy counter (NVML sees no GPU)")

    def begin(self) -> None:
        """Read every counter at the start of the measured phase (not again once ended)."""
        if self.ended is not None:
            return
        self.t_begin_ns = time.perf_counter_ns()
        for counter in self.counters:
            counter.start = counter.read()

    def end(self) -> EnergyRecord:
        """Read every counter again, shut NVML down, and return the record: the joules each
        readable counter counted since `begin`. Once ended, the same record again."""
        if self.ended is None:
            self.ended = self._read_end()
            self.close()
        return self.ended

    def _read_end(self) -> EnergyRecord:
        if self.t_begin_ns is None:
            return EnergyRecord(counters=[], unavailable="the measured phase never started")
        duration_s = (time.perf_counter_ns() - self.t_begin_ns) / 1e9
        read = []
        for counter in self.counters:
            end = counter.read()
            if counter.start is None or end is None:
                self.unavailable.append(f"{counter.name} could not be read")
                continue
            wrap = None if counter.wrap is None else counter.wrap / counter.per_joule
            joules = counted(counter.start, end, counter.wrap) / counter.per_joule
            read.append(EnergyCounter(name=counter.name, joules=joules, wrap_joules=wrap))
        return EnergyRecord(
            counters=read,
            duration_s=duration_s,
            unavailable=None if read else "; ".join(self.unavailable) or "no energy counter",
        )

    def close(self) -> None:
        """Shut NVML down (idempotent)."""
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # shutting down a library that failed is no error of the run
                pass
            self.nvml = None


def _file_reader(path: Path):
    def read() -> float | None:
        try:
            return float(path.read_text())
        except (OSError, ValueError):
            return None

    return read


def _nvml_reader(nvml: Any, handle: Any):
    def read() -> float | None:
        try:
            return float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except Exception:  # not supported on this GPU, or the driver went away
            return None

    return read
