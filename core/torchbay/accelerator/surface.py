"""Accelerate's ``Accelerator(...)`` arguments that torchbay takes as config, or refuses with advice.

A backend plugin object (``fsdp_plugin=``, ``deepspeed_plugin=``) comes from that backend's
torchbay plugin and gives its settings as config (``to_config()``); arguments for features
torchbay does not have raise a :class:`~torchbay.errors.ConfigError` naming what to use.
"""

from __future__ import annotations

from typing import Any

from torchbay.compile.compiler import dynamo_arguments
from torchbay.errors import ConfigError

#: Accelerator(...) argument -> why torchbay refuses it, and what to do instead
REFUSED = {
    "torch_tp_plugin": "tensor parallelism is configured in a strategy plugin's config section",
    "megatron_lm_plugin": "Megatron-LM is not a torchbay strategy",
}
#: arguments whose value is a backend plugin's settings object
PLUGIN_OBJECTS = ("fsdp_plugin", "deepspeed_plugin", "deepspeed_plugins")


def plugin_objects(arguments: dict[str, Any]) -> dict[str, Any]:
    """The backend plugin objects among ``Accelerator(...)``'s arguments (the active one of a dict), by name."""
    out = {}
    for name in PLUGIN_OBJECTS:
        value = arguments.get(name)
        if isinstance(value, dict) and len(value) == 1:
            value = next(iter(value.values()))
        if value is not None and not isinstance(value, dict):
            out["deepspeed_plugin" if name == "deepspeed_plugins" else name] = value
    return out


def translate(arguments: dict[str, Any]) -> dict[str, Any]:
    """Dotted config values for Accelerate-only ``Accelerator`` arguments (unknown ones are errors)."""
    out: dict[str, Any] = {}
    problems = []
    arguments = dict(arguments)
    dynamo = (arguments.pop("dynamo_backend", None), arguments.pop("dynamo_plugin", None))
    try:
        out.update(dynamo_arguments(*dynamo))  # the compile section (torchbay.compile.compiler)
    except ConfigError as exc:
        problems += exc.problems
    for name, value in arguments.items():
        if name in REFUSED:
            if value is not None:
                problems.append(f"Accelerator({name}=...) is not supported: {REFUSED[name]}")
        elif name in PLUGIN_OBJECTS:
            if value is None:
                continue
            if isinstance(value, dict):  # Accelerate's named deepspeed_plugins: the first is the active one
                if len(value) != 1:
                    problems.append(f"Accelerator({name}=...) with several named plugins is not supported: "
                                    f"prepare each model with its own Accelerator")
                    continue
                value = next(iter(value.values()))
            to_config = getattr(value, "to_config", None)
            if to_config is None:
                problems.append(f"Accelerator({name}=...) takes the object from the torchbay plugin "
                                f"(torchbay.utils.{type(value).__name__}), not {type(value).__module__}'s")
                continue
            out.update(to_config())
        elif name == "parallelism_config":
            if value is None:
                continue
            to_config = getattr(value, "to_config", None)
            if to_config is None:
                problems.append(f"Accelerator(parallelism_config=...) takes torchbay.ParallelismConfig, not "
                                f"{type(value).__module__}.{type(value).__name__}")
                continue
            out.update(to_config())
        elif name == "split_batches":
            out["dataloader.split_batches"] = bool(value)
        elif name == "rng_types":
            if value and any(str(getattr(v, "value", v)) not in ("torch", "generator") for v in value):
                problems.append("Accelerator(rng_types=...): torchbay synchronises the samplers' generators "
                                "itself; leave rng_types unset")
        elif name == "even_batches":
            out["dataloader.even_batches"] = bool(value)
        elif name == "dispatch_batches":
            out["dataloader.dispatch_batches"] = value
        else:
            problems.append(f"Accelerator() got an unexpected argument {name!r}")
    if problems:
        raise ConfigError(problems)
    return out
