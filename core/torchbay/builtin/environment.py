"""The core's lines of ``torchbay env`` (torch, python, platform, the accelerator torch sees)."""

from __future__ import annotations

import platform

from torchbay.registry.info import _own_version
from torchbay.registry.manager import hookimpl


@hookimpl
def torchbay_report_env() -> dict:
    import torch

    return {"torchbay": _own_version(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "torch accelerator":
            str(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else "none"}
