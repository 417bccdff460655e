"""One configuration tree: ``model`` (the core sections, :class:`Section` for plugins, :class:`ResolvedConfig`),
``files`` (reading YAML), ``handlers`` (Accelerate's kwargs handlers: ``AutocastKwargs``...). Resolving the tree for
the installed plugins (``resolve_config``) needs the plugin manager, so it lives above, in
:mod:`torchbay.registry.resolve` (``torchbay.resolve_config``)."""

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
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["CheckpointSection", "CompileSection", "CoreConfig", "DataLoaderSection", "LaunchSection", "PluginsSection",
           "ProjectSection", "ResolvedConfig", "Section", "TrackingSection"]

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
# -- end of the names written by scripts/public_names.py --
