"""One configuration tree: ``model`` (the core sections, :class:`Section` for plugins, :class:`ResolvedConfig`),
``files`` (reading YAML), ``handlers`` (Accelerate's kwargs handlers: ``AutocastKwargs``...). Resolving the tree for
the installed plugins (``resolve_config``) needs the plugin manager, so it lives above, in
:mod:`torchbay.plugin.resolve` (``torchbay.resolve_config``)."""

from torchbay._lazy import serve_names

_SOURCES = {
    "torchbay.config.model": ["Section", "CoreConfig", "ResolvedConfig", "CheckpointSection", "CompileSection",
                              "DataLoaderSection", "LaunchSection", "PluginsSection", "ProjectSection",
                              "TrackingSection"],
}
__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES, fallback=("torchbay.config.model",))
