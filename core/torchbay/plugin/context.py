"""What the selected plugins and the Accelerator share: one :class:`RunContext` per process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.cluster import ClusterEnvironment
    from torchbay.axes.device import DeviceBackend
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.config.model import CoreConfig, ResolvedConfig
    from torchbay.plugin.manager import PluginManager


@dataclass
class RunContext:
    """The resolved config and the objects chosen for each axis.

    ``device_backend_cls``, ``strategy_cls`` and ``precision_cls`` are known before any
    process group starts (validation sees them); the instances are filled in afterwards.
    """

    resolved: ResolvedConfig
    pm: PluginManager
    cluster: ClusterEnvironment
    device_backend_cls: type[DeviceBackend]
    strategy_cls: type[Strategy]
    precision_cls: type[Precision]
    device_backend: DeviceBackend | None = None
    strategy: Strategy | None = None
    precision: Precision | None = None
    #: the user's ``kwargs_handlers`` by class (``AutocastKwargs``, ``GradScalerKwargs``,
    #: ``DistributedDataParallelKwargs``...), for the selected objects that honour them
    kwargs_handlers: dict[type, Any] = field(default_factory=dict)
    #: the backend plugin objects given to ``Accelerator(...)`` by argument name (Accelerate's
    #: ``fsdp_plugin=``, ``deepspeed_plugin=``), for the selected strategy that shows them on ``state``
    plugin_objects: dict[str, Any] = field(default_factory=dict)

    def handler(self, kind: type) -> Any:
        """The user's handler of class ``kind`` (e.g. ``AutocastKwargs``), or ``None``."""
        return self.kwargs_handlers.get(kind)

    @property
    def config(self) -> CoreConfig:
        return self.resolved.config
