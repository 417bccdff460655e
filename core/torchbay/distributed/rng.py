"""Every random number generator a training step may draw from, captured and restored per rank.

Python's ``random``, NumPy's global generator, torch's CPU generator and the selected
device's generators (through its :class:`~torchbay.axes.device.DeviceBackend`). A part that
cannot be restored raises a :class:`CheckpointError` naming it; nothing is only logged.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from torchbay.errors import CheckpointError


def capture_rng_state(device_backend) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "device_type": device_backend.torch_type(),
        "device": device_backend.get_rng_state(),
    }


def restore_rng_state(state: dict[str, Any], device_backend) -> None:
    part = "python"
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        part = "numpy"
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        part = "torch"
        torch.set_rng_state(state["torch"])
        part = f"device ({state.get('device_type')})"
        if state.get("device_type") != device_backend.torch_type():
            raise CheckpointError(f"the checkpoint's device RNG is for '{state.get('device_type')}' but this run "
                                  f"uses '{device_backend.torch_type()}'; "
                                  f"load it with device: {state.get('device_type')}")
        device_backend.set_rng_state(state["device"])
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"RNG state part '{part}' could not be restored: {type(exc).__name__}: {exc}") from exc
