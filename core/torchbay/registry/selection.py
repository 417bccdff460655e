"""Choosing the device, strategy and precision by name, and validating them together.

Everything here runs before any process group starts; every problem found is collected
and raised at once as :class:`~torchbay.errors.IncompatibleSetupError`.
"""

from __future__ import annotations

import logging
from typing import Any

from torchbay.axes.cluster import detect_cluster_environment
from torchbay.axes.context import RunContext
from torchbay.axes.precision import SHARED_SECTIONS, Precision, by_mode, engine_setting, mode_install_hint
from torchbay.axes.strategy import Strategy, strategies_building
from torchbay.compile.compiler import section_problems as compile_problems
from torchbay.config.model import RESOLVED_ENV, ResolvedConfig
from torchbay.distributed.parallelism_config import parallel_sizes
from torchbay.errors import IncompatibleSetupError, PluginError, TorchbayError
from torchbay.registry.published import DEVICE, STRATEGY, install_hint
from torchbay.registry.resolve import resolve_config

log = logging.getLogger("torchbay")


def _missing(kind: str, name: str, registry: dict[str, Any], pm) -> str:
    failed = [f"{i.name} ({i.distribution}: {i.error})" for i in pm.failed_plugins()]
    msg = (f"{kind} '{name}' is not installed (installed: {', '.join(sorted(registry)) or 'none'}); "
           f"{install_hint(kind, name, registry)}")
    if failed:
        msg += f"; plugins that failed to load: {'; '.join(failed)}"
    return msg


def check_selected(cls, context, problems: list[str], pm) -> None:
    """``cls.check(context)``: a selected class's own complaints; a crash there names its plugin."""
    try:
        problems += list(cls.check(context) or [])
    except TorchbayError:
        raise
    except Exception as exc:
        plugin = getattr(cls, "_torchbay_plugin", "?")
        info = pm.infos.get(plugin)
        dist = f" (distribution {info.distribution})" if info else ""
        problems.append(f"plugin '{plugin}'{dist} failed in {cls.__name__}.check: {type(exc).__name__}: {exc}")


def core_problems(context: RunContext) -> list[str]:
    """Problems with the core's own settings for this job (the selected classes check theirs)."""
    config = context.config
    problems = []
    backend = config.process_group_backend
    if backend and context.cluster.world_size() > 1:
        import torch.distributed as dist

        if backend not in ("gloo", "mpi") and not hasattr(dist.Backend, backend.upper()):
            problems.append(f"process_group_backend '{backend}' is not a torch.distributed backend here; "
                            f"remove it to use device '{context.device_backend_cls.name}''s default")
    launch = config.launch
    if launch.num_processes and launch.nproc_per_node and \
            launch.num_processes != launch.nproc_per_node * launch.num_machines:
        problems.append(f"launch.num_processes ({launch.num_processes}) is not launch.nproc_per_node "
                        f"({launch.nproc_per_node}) x launch.num_machines ({launch.num_machines}); "
                        f"give one of num_processes or nproc_per_node")
    problems += compile_problems(config.compile)
    return problems


def select_device(name: str, registry: dict[str, Any], pm, problems: list[str]):
    if name == "auto":
        imported = (pm.load_registered(entry) for entry in registry.values())
        available = [cls for cls in imported if cls is not None and cls.is_available()]
        if not available:
            problems.append("device: auto found no usable device (is the built-in cpu plugin blocked?)")
            return None
        return max(available, key=lambda c: c.priority)
    cls = registry.get(name)
    if cls is None:
        problems.append(_missing(DEVICE, name, registry, pm))
        return None
    if pm.load_registered(cls) is None:
        return cls  # its plugin failed to import it: build_context reports the plugin's message
    reason = cls.unavailable_reason()
    if reason:
        problems.append(f"device '{name}' cannot be used here: {reason}; or choose another device "
                        f"(installed: {', '.join(sorted(registry))})")
    return cls


def select_strategy(name: str, registry: dict[str, Any], world_size: int, pm, problems: list[str],
                    config: Any = None):
    if name == "auto":
        name = _auto_strategy(registry, world_size, config)
    cls = registry.get(name)
    if cls is None:
        problems.append(_missing(STRATEGY, name, registry, pm))
    return cls


def _auto_strategy(registry: dict[str, Any], world_size: int, config: Any) -> str:
    """``ddp`` on several processes (``single`` on one); but where the ``parallelism`` section asks for
    dimensions it does not build, the installed strategy that builds them all (the first by name)."""
    default = "ddp" if world_size > 1 else "single"
    wanted = {dim for dim, size in parallel_sizes(config).items() if size > 1} if config is not None else set()
    if not wanted or wanted <= set(getattr(registry.get(default), "parallel_dims", ())):
        return default
    offering = strategies_building(registry, wanted)
    if not offering:
        return default  # the default's check names what is missing
    log.info("strategy auto chose '%s': it builds the parallel dimension(s) %s the parallelism section asks for",
             offering[0], ", ".join(sorted(wanted)))
    return offering[0]


def select_precision(config, registry: dict[str, Any], device_cls, pm, problems: list[str]):
    """The class of ``config.mixed_precision``; for a mode several engines serve, the one
    ``<mode>.backend`` names, or with ``auto`` the available engine of highest priority."""
    modes = by_mode(registry)
    mode = config.mixed_precision
    for other, engines in modes.items():  # an engine named for a mode not in use is still a typo
        choice = engine_setting(config, other)
        if (other != mode and other not in SHARED_SECTIONS and _has_engines(engines) and choice != "auto"
                and choice not in engines):
            problems.append(f"{other}.backend '{choice}' is not an installed {other.upper()} engine (installed "
                            f"engines: {_names(engines)}); set {other}.backend to one of them or auto "
                            f"({_engine_hint(other, choice, engines)})")
    engines = modes.get(mode)
    if engines is None:
        problems.append(f"mixed_precision '{mode}' has no registered implementation (registered: "
                        f"{', '.join(modes)}); install {mode_install_hint(mode)}")
        return None
    if not _has_engines(engines):
        return engines[None]
    return _select_engine(mode, engines, engine_setting(config, mode), config, device_cls, pm, problems)


def _engine_hint(mode: str, choice: str, engines: dict) -> str:
    return install_hint(f"{mode} engine", choice, [e for e in engines if e is not None])


def _has_engines(engines: dict) -> bool:
    return any(engine is not None for engine in engines)


def _names(engines: dict) -> str:
    return ", ".join(sorted(e for e in engines if e is not None)) or "none"


def _select_engine(mode: str, engines: dict, choice: str, config, device_cls, pm, problems: list[str]):
    if choice != "auto":
        cls = engines.get(choice)
        if cls is None:
            problems.append(f"{mode} backend '{choice}' is not installed (installed engines: {_names(engines)}): "
                            f"{_engine_hint(mode, choice, engines)}")
            return None
        reason = device_cls and cls.unavailable_reason(device_cls, config)
        if reason:
            problems.append(f"{mode} backend '{choice}' cannot run here: {reason}")
        return cls
    reasons = []
    imported = ((engine, pm.load_registered(cls)) for engine, cls in engines.items() if engine is not None)
    ranked = sorted(((e, c) for e, c in imported if c is not None), key=lambda ec: -ec[1].priority)
    for engine, cls in ranked:
        reason = cls.unavailable_reason(device_cls, config) if device_cls else "no device"
        if reason is None:
            log.info("%s.backend auto chose '%s': the highest-priority installed engine that supports device '%s'"
                     " (skipped: %s)", mode, engine, getattr(device_cls, "name", "?"), "; ".join(reasons) or "none")
            return cls
        reasons.append(f"{engine}: {reason}")
    problems.append(f"mixed_precision {mode} with {mode}.backend auto found no usable {mode.upper()} engine ("
                    + "; ".join(reasons) + f"); install one ({mode_install_hint(mode)}), or use mixed_precision: bf16")
    return None


def _name_handler_source(resolved, problems: list[str], start: int) -> None:
    """An engine choice a kwargs handler made (``TERecipeKwargs`` sets ``fp8.backend``): its problems say so."""
    mode = resolved.config.mixed_precision
    source = resolved.source_of(f"{SHARED_SECTIONS.get(mode, mode)}.backend")
    if source.startswith("kwargs handler"):
        problems[start:] = [f"{p} (set by {source})" for p in problems[start:]]


def _unused_section_warning(resolved, modes: dict) -> None:
    """Settings in a mode's section (``<mode>.*``) while another mode runs have no effect: say so."""
    config = resolved.config
    for mode in modes:
        if mode == config.mixed_precision or SHARED_SECTIONS.get(config.mixed_precision) == mode:
            continue
        set_here = sorted(k for k, src in resolved.sources.items() if k.startswith(f"{mode}.") and src != "default")
        if set_here:
            log.warning("torchbay: %s set but mixed_precision is '%s', so no %s engine runs and the %s section has "
                        "no effect; set mixed_precision: %s to use it, or remove the %s section",
                        ", ".join(set_here), config.mixed_precision, mode.upper(), mode, mode, mode)


def build_context(resolved: ResolvedConfig, pm, cluster=None) -> RunContext:
    """Select every axis and validate the combination; raise with all problems at once.

    ``cluster`` describes the job; by default it is detected from this process's
    environment (a launcher passes one describing the processes it is about to start).
    """
    config = resolved.config
    try:
        pm.check_required(config.plugins.required)
        problems: list[str] = []
    except PluginError as exc:
        problems = str(exc).splitlines()
    registries = pm.registries()
    cluster = cluster or detect_cluster_environment(registries["cluster_environments"])
    chosen = [select_device(config.device, registries["devices"], pm, problems),
              select_strategy(config.strategy, registries["strategies"], cluster.world_size(), pm, problems, config)]
    before = len(problems)
    chosen.append(select_precision(config, registries["precisions"], chosen[0], pm, problems))
    _name_handler_source(resolved, problems, before)
    if config.checkpoint.io not in registries["checkpoint_io"]:
        problems.append(_missing("checkpoint io", config.checkpoint.io, registries["checkpoint_io"], pm))
    chosen.append(registries["checkpoint_io"].get(config.checkpoint.io))
    # a class registered lazily is imported here, once selected; if that fails, its plugin's message says why
    device_cls, strategy_cls, precision_cls = (None if entry is None else pm.load_registered(entry)
                                               for entry in chosen[:3])
    context = RunContext(resolved=resolved, pm=pm, cluster=cluster, device_backend_cls=device_cls,
                         strategy_cls=strategy_cls or Strategy, precision_cls=precision_cls or Precision)
    if device_cls is not None and strategy_cls is not None and precision_cls is not None:
        problems += core_problems(context)
        for cls in (device_cls, strategy_cls, precision_cls):
            check_selected(cls, context, problems, pm)
        for found in pm.hook.torchbay_validate(context=context):
            problems += list(found or [])
    selected = {getattr(entry, "_torchbay_plugin", None) for entry in chosen if entry is not None} - {None}
    for name in sorted(selected):
        if pm.is_failed(name):  # it failed in a hook since it registered the class: the run cannot use it
            problems.append(pm.infos[name].message)
    if not problems:
        _unused_section_warning(resolved, by_mode(registries["precisions"]))
    pm.selected = selected  # from now on a failure of these stops the run instead of disabling them
    if problems:
        raise IncompatibleSetupError(problems)
    return context


def probe_run_hooks(pm, config_file: str | None = None) -> None:
    """Call, once, the per-run hooks that only ask (``torchbay_validate``, ``torchbay_state_extra``)
    with the context of the configured set-up and no object created yet, as ``torchbay plugins``
    and ``torchbay env`` do: a plugin that raises in one is disabled and listed as failed, with
    its error and distribution, before a run finds out. Nothing is selected for a run here (the
    failure only disables the plugin), and the set-up's own problems are left to the run (or
    ``torchbay launch --dry-run``) to report.

    :param config_file: the config file of the set-up (else ``TORCHBAY_CONFIG_FILE``); with
        ``TORCHBAY_*``, or the defaults when that configuration is invalid.
    """
    import os

    environ = {k: v for k, v in os.environ.items() if k != RESOLVED_ENV}
    try:
        resolved = resolve_config(file=config_file, environ=environ, pm=pm)
    except TorchbayError:  # the run reports the config's problems
        resolved = resolve_config(environ={}, pm=pm)
    registries = pm.registries()
    config, ignored = resolved.config, []
    cluster = detect_cluster_environment(registries["cluster_environments"])
    device_cls = select_device(config.device, registries["devices"], pm, ignored) or registries["devices"].get("cpu")
    strategy_cls = select_strategy(config.strategy, registries["strategies"], cluster.world_size(), pm, ignored,
                                   config)
    precision_cls = select_precision(config, registries["precisions"], device_cls, pm, ignored)
    if device_cls is None:  # even the built-in cpu is blocked: nothing to describe a run with
        return
    context = RunContext(resolved=resolved, pm=pm, cluster=cluster, device_backend_cls=device_cls,
                         strategy_cls=strategy_cls or Strategy, precision_cls=precision_cls or Precision)
    selected, pm.selected = pm.selected, set()
    try:
        for hook in (pm.hook.torchbay_validate, pm.hook.torchbay_state_extra):
            try:
                hook(context=context)
            except TorchbayError:  # a plugin's deliberate answer about this set-up: the run reports it
                pass
    finally:
        pm.selected = selected
