"""One configuration tree: ``model`` (the core sections, :class:`Section` for plugins, :class:`ResolvedConfig`),
``resolve`` (``resolve_config`` from defaults, file, environment, flags and arguments, for the installed plugins),
``files`` (reading YAML), ``handlers`` (Accelerate's kwargs handlers: ``AutocastKwargs``...)."""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "Section": "torchbay.config.model",
    "CoreConfig": "torchbay.config.model",
    "ResolvedConfig": "torchbay.config.model",
    "CheckpointSection": "torchbay.config.model",
    "CompileSection": "torchbay.config.model",
    "DataLoaderSection": "torchbay.config.model",
    "LaunchSection": "torchbay.config.model",
    "PluginsSection": "torchbay.config.model",
    "ProjectSection": "torchbay.config.model",
    "TrackingSection": "torchbay.config.model",
    "resolve_config": "torchbay.config.resolve",
    "config_model": "torchbay.config.resolve",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["CheckpointSection", "CompileSection", "CoreConfig", "DataLoaderSection", "LaunchSection", "PluginsSection",
           "ProjectSection", "ResolvedConfig", "Section", "TrackingSection", "config_model", "resolve_config"]

if TYPE_CHECKING:
    from torchbay.config.model import (
        CheckpointSection,
        CompileSection,
        CoreConfig,
        DataLoaderSection,
        LaunchSection,
        PluginsSection,
        ProjectSection,
        ResolvedConfig,
        Section,
        TrackingSection,
    )
    from torchbay.config.resolve import config_model, resolve_config
# -- end of the names written by scripts/public_names.py --
