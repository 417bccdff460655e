"""What the selected plugins and the Accelerator share: one :class:`RunContext` per process.

It sits with the axes (below :mod:`torchbay.plugin`) because every axis is handed one; what an axis may ask of the
plugin manager it holds is :class:`InstalledPlugins` (torchbay's :class:`~torchbay.registry.manager.PluginManager`
is one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

    from torchbay.axes.cluster import ClusterEnvironment
    from torchbay.axes.device import DeviceBackend
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.config.model import CoreConfig, ResolvedConfig


class InstalledPlugins(Protocol):
    """What the context's ``pm`` offers the axes: pluggy's hooks and what the installed plugins registered."""

    hook: pluggy.HookRelay

    def registries(self) -> dict[str, dict[str, Any]]: ...


@dataclass
class RunContext:
    """The resolved config and the objects chosen for each axis.

    ``device_backend_cls``, ``strategy_cls`` and ``precision_cls`` are known before any
    process group starts (validation sees them); the instances are filled in afterwards.
    """

    resolved: ResolvedConfig
    pm: InstalledPlugins
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
