"""One configuration tree: ``model`` (the core sections, :class:`Section` for plugins, :class:`ResolvedConfig`),
``resolve`` (``resolve_config`` from defaults, file, environment, flags and arguments, for the installed plugins),
``files`` (reading YAML), ``handlers`` (Accelerate's kwargs handlers: ``AutocastKwargs``...)."""

from torchbay._lazy import serve_names

_SOURCES = {
    "torchbay.config.model": ["Section", "CoreConfig", "ResolvedConfig", "CheckpointSection", "CompileSection",
                              "DataLoaderSection", "LaunchSection", "PluginsSection", "ProjectSection",
                              "TrackingSection"],
    "torchbay.config.resolve": ["resolve_config", "config_model"],
}
__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES, fallback=("torchbay.config.model", "torchbay.config.resolve"))
