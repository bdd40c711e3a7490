"""Energy counters for the bench: RAPL package domains (CPU) and NVML (NVIDIA GPUs), or a reason why not.

The bench reads the counters just before and just after each decode call and adds the joules up per
method; where no counter can be read it reports none (null plus the reason), never an estimate.

- RAPL: /sys/class/powercap/intel-rapl:N/energy_uj, microjoules since an arbitrary origin, for each
  top-level domain named `package-N` (subdomains such as core / uncore / dram are inside a package and
  `psys` covers the whole platform, so summing them with the packages would count energy twice). The
  counter wraps to 0 after `max_energy_range_uj`; a call shorter than one full range (~262 kJ on
  common CPUs, tens of minutes at full load) is measured exactly. Many kernels make energy_uj
  readable only by root (since the PLATYPUS side channel), which is reported as the reason.
- NVML: nvmlDeviceGetTotalEnergyConsumption, millijoules since the driver loaded (64-bit, Volta and
  later), per GPU; only when `pynvml` is importable.

Package and GPU counters cover the whole device, other processes included: on a shared machine the
figure is what the machine spent while the method ran, not what the method alone cost.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

POWERCAP_ROOT = Path("/sys/class/powercap")
NOT_AVAILABLE = "not available"
_TOP_LEVEL_DOMAIN = re.compile(r"intel-rapl:\d+")


@dataclass(frozen=True)
class _Counter:
    """One cumulative counter: its name, how to read it (in joules), and where it wraps (None: never)."""

    name: str
    read: Callable[[], float]  # joules
    wraps_at: float | None = None


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _microjoules_file(path: Path) -> float:
    """A powercap energy_uj file's value, in joules."""
    return _read_int(path) / 1e6


def _nvml_joules(pynvml, handle) -> float:
    """A GPU's total energy since the driver loaded, in joules (NVML counts millijoules)."""
    return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def _rapl_counters(root: Path) -> tuple[list[_Counter], str | None]:
    """The package domains under a powercap root, and why none could be used (None when some can)."""
    domains = sorted(p for p in root.glob("intel-rapl:*") if _TOP_LEVEL_DOMAIN.fullmatch(p.name))
    counters, refused = [], []
    for domain in domains:
        try:
            name = (domain / "name").read_text().strip()
            if not name.startswith("package"):
                continue
            wraps_at = _read_int(domain / "max_energy_range_uj") / 1e6
            _read_int(domain / "energy_uj")
        except PermissionError:
            refused.append(domain.name)
            continue
        except (OSError, ValueError):
            continue
        counters.append(_Counter(f"RAPL {name}", partial(_microjoules_file, domain / "energy_uj"), wraps_at))
    if counters:
        return counters, None
    if refused:
        return [], f"RAPL counters under {root} are readable only by root on this kernel ({', '.join(refused)})"
    return [], f"no readable RAPL package domain under {root}"


def _nvml_counters() -> tuple[list[_Counter], str | None]:
    """One counter per NVIDIA GPU whose driver reports total energy, and why none (None when some)."""
    try:
        import pynvml
    except ImportError:
        return [], "pynvml is not installed (NVIDIA GPUs)"
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        return [], f"NVML did not start ({exc})"
    counters = []
    for index, handle in enumerate(handles):
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError:  # pre-Volta GPUs have no energy counter
            continue
        counters.append(_Counter(f"NVML GPU {index}", partial(_nvml_joules, pynvml, handle)))
    return counters, None if counters else "no NVIDIA GPU reports total energy through NVML"


class EnergyMeter:
    """Reads every energy counter this machine exposes; `joules_since(read())` measures a stretch of work.

    `available` is False when there is none, and `reason` then says why ("not available: ...").
    """

    def __init__(self, root: Path | None = None, nvml: bool = True) -> None:
        rapl, rapl_reason = _rapl_counters(POWERCAP_ROOT if root is None else root)
        gpus, gpu_reason = _nvml_counters() if nvml else ([], None)
        self.counters = rapl + gpus
        reasons = "; ".join(r for r in (rapl_reason, gpu_reason) if r)
        self.reason = None if self.counters else f"{NOT_AVAILABLE}: {reasons or 'no energy counter'}"

    @property
    def available(self) -> bool:
        return bool(self.counters)

    @property
    def description(self) -> str:
        """The counters read (e.g. "RAPL package-0, RAPL package-1"), or the reason there are none."""
        return ", ".join(c.name for c in self.counters) if self.counters else self.reason

    def read(self) -> list[float]:
        """Every counter's value now, in joules (an empty list when none is available)."""
        return [counter.read() for counter in self.counters]

    def joules_since(self, before: list[float]) -> float | None:
        """Joules spent since `before` (a read()) over all counters, unwrapping each once; None if unavailable."""
        if not self.counters:
            return None
        total = 0.0
        for counter, start, end in zip(self.counters, before, self.read()):
            if end < start and counter.wraps_at is not None:
                end += counter.wraps_at  # the counter passed its range and restarted from 0
            total += end - start
        return total
