"""Results, errors and helpers shared by the conformance checks (see :mod:`torchbay.testing.conformance`)."""


import contextlib
import os
from dataclasses import dataclass, field

import torch

from torchbay.axes.device import DeviceBackend
from torchbay.registry import manager as plugins
from torchbay.registry.manager import get_plugin_manager


class ConformanceFailure(AssertionError):
    """A check found the device backend not conforming; the message says what and how to fix it."""


class ConformanceSkip(Exception):
    """A check cannot run here (device missing, capability not declared)."""


@dataclass
class CheckResult:
    name: str
    status: str  # "passed", "failed", "skipped"
    message: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __str__(self) -> str:
        text = f"[{self.status.upper():7}] {self.name} ({self.seconds:.1f}s)"
        return text + (f": {self.message}" if self.message else "")


@dataclass
class ConformanceReport:
    device: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks are allowed)."""
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    def __getitem__(self, name: str) -> CheckResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(name)

    def __str__(self) -> str:
        lines = [f"torchbay device conformance for '{self.device}':"] + [f"  {r}" for r in self.results]
        return "\n".join(lines)

    def raise_for_failures(self) -> None:
        if self.failures:
            raise ConformanceFailure(str(self))


# --- helpers -------------------------------------------------------------------------------


def _fail(message: str) -> None:
    raise ConformanceFailure(message)


def _get_pm(pm=None):
    if pm is not None:
        return pm
    return get_plugin_manager()


def _device_class(name: str, pm=None):
    registry = _get_pm(pm).registries()["devices"]
    cls = registry.get(name)
    if cls is None:
        failed = [f"{i.name}: {i.error}" for i in _get_pm(pm).failed_plugins()]
        _fail(f"device '{name}' is not registered (registered: {', '.join(sorted(registry)) or 'none'})"
              + (f"; plugins that failed to load: {'; '.join(failed)}" if failed else "")
              + ": is the plugin installed, with an entry point in group 'torchbay' whose "
                "torchbay_register_devices() returns its class?")
    if not (isinstance(cls, type) and issubclass(cls, DeviceBackend)):
        _fail(f"device '{name}' is registered as {cls!r}, which is not a torchbay.axes.device.DeviceBackend subclass")
    return cls


def _require_available(cls) -> None:
    reason = cls.unavailable_reason()
    if reason:
        raise ConformanceSkip(f"device '{cls.name}' is not available here: {reason}")


def _first(t: torch.Tensor, n: int = 4) -> list:
    return [round(float(v), 6) for v in t.detach().flatten()[:n].cpu()]


@contextlib.contextmanager
def _plugin_manager(pm):
    """Make ``pm`` the process-wide manager for the duration (Accelerator uses that one)."""
    if pm is None:
        yield
        return
    saved = plugins.peek_plugin_manager()
    plugins.reset_plugin_manager(pm)
    try:
        yield
    finally:
        plugins.reset_plugin_manager(saved)


@contextlib.contextmanager
def _single_process_env():
    """Hide launcher variables so that in-process checks run one process."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHBAY_RESOLVED_CONFIG",
            "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)

def _draw(device: torch.device, n: int = 64) -> torch.Tensor:
    return torch.rand(n, device=device).cpu()
