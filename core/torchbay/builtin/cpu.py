"""The built-in cpu device."""

from __future__ import annotations

import os

import torch

from torchbay.axes.device import DeviceBackend
from torchbay.registry.manager import hookimpl


def _proc_status_kib(*fields: str) -> list[int]:
    """The ``fields`` of ``/proc/self/status`` in KiB (0 where absent), read in one pass."""
    found = dict.fromkeys(fields, 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.partition(":")[0]
                if key in found:
                    found[key] = int(line.split()[1])
    except OSError:
        pass
    return [found[name] for name in fields]


class CPUBackend(DeviceBackend):
    """The host CPU: one device, gloo collectives, memory read from the process table."""

    name = "cpu"
    device_type = "cpu"
    priority = 0
    one_process_per_device = False
    pinned_staging = False  # the state is in host memory already: nothing to pin for

    def __init__(self, local_rank: int = 0):
        self.index = 0
        self.device = torch.device("cpu")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def dist_backend(cls) -> str:
        return "gloo"

    @classmethod
    def memory_capacity(cls) -> dict[int, tuple[int, int]]:
        """``{0: (available, total)}``: available counts reclaimable page cache (MemAvailable)."""
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        page = os.sysconf("SC_PAGE_SIZE")
        total = info.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
        free = info.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
        return {0: (min(free, total), total)}

    def set_current(self) -> None:
        pass

    def process_group_kwargs(self) -> dict:
        return {}

    def ddp_device_ids(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])

    def synchronize(self) -> None:
        pass

    def memory_stats(self) -> dict[str, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        rss, hwm = _proc_status_kib("VmRSS", "VmHWM")
        return {
            "allocated": rss * 1024,
            "peak_allocated": hwm * 1024,
            "reserved": rss * 1024,
            "free": os.sysconf("SC_AVPHYS_PAGES") * page,
            "total": os.sysconf("SC_PHYS_PAGES") * page,
        }

    def mem_get_info(self) -> tuple[int, int]:
        stats = self.memory_stats()
        return stats["free"], stats["total"]

    def reset_peak_memory(self) -> None:
        try:  # writing 5 to clear_refs resets VmHWM on Linux
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def empty_cache(self) -> None:
        pass

    def peak_flops(self, dtype) -> None:
        """Unknown: a CPU's peak depends on its vector units (AVX2, AVX-512, AMX), cores in use and clocks, which no
        portable query tells; an estimate from the core count would be a guess, so the cpu device has no MFU."""
        return None

    def report(self) -> dict:
        return {"device": "cpu", "count": 1, "cores": os.cpu_count(), "threads": torch.get_num_threads()}


@hookimpl
def torchbay_register_devices():
    return [CPUBackend]
