"""The ``deepspeed`` config section, and turning it (plus a user's JSON) into DeepSpeed configs.

Nothing here imports deepspeed: validation runs before any process group starts.

Two places can set a DeepSpeed value: this section (and the core keys
``gradient_accumulation_steps`` / ``mixed_precision``) and the user's DeepSpeed JSON
(``deepspeed.deepspeed_config_file``). A value set in both with different values is an
error that shows both; a JSON value written ``"auto"`` is filled from the training set-up
(see :func:`fill_auto`) and every filled value is reported.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from torchbay.errors import ConfigError
from torchbay.plugin import Section

AUTO = "auto"
FP8_REFUSAL = ("mixed_precision fp8 does not run under strategy deepspeed; use bf16 or fp16 "
               "(or strategy: fsdp/ddp with an fp8 engine)")
#: the modes an FP8 engine plugin serves (fp4 too), refused here alike
FP8_MODES = ("fp8", "fp4")

#: section key -> path in the DeepSpeed JSON
SECTION_PATHS: dict[str, tuple[str, ...]] = {
    "zero_stage": ("zero_optimization", "stage"),
    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
    "offload_optimizer_nvme_path": ("zero_optimization", "offload_optimizer", "nvme_path"),
    "offload_param_device": ("zero_optimization", "offload_param", "device"),
    "offload_param_nvme_path": ("zero_optimization", "offload_param", "nvme_path"),
    "gradient_clipping": ("gradient_clipping",),
    "zero3_save_16bit_model": ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu",),
}

#: keys whose "auto" is filled from the ZeRO-3 hidden size
HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


class DeepSpeedSection(Section):
    """``deepspeed:`` in the torchbay config (``TORCHBAY_DEEPSPEED__ZERO_STAGE=3``, ``--zero-stage 3``)."""

    deepspeed_config_file: Optional[str] = Field(
        None, description="a DeepSpeed JSON config; its 'auto' values are filled from the set-up")
    zero_stage: Optional[Literal[0, 1, 2, 3]] = Field(None, description="ZeRO stage (2 when set nowhere)")
    offload_optimizer_device: Optional[Literal["none", "cpu", "nvme"]] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_device: Optional[Literal["none", "cpu", "nvme"]] = None
    offload_param_nvme_path: Optional[str] = None
    gradient_clipping: Optional[float] = Field(None, ge=0, description="max gradient norm DeepSpeed clips to")
    zero3_init: bool = Field(False, description="build models under deepspeed.zero.Init (strategy.zero_init())")
    zero3_save_16bit_model: Optional[bool] = Field(
        None, description="DeepSpeed's stage3_gather_16bit_weights_on_model_save (engine.save_16bit_model); "
                          "torchbay's save_model / get_state_dict gather the full weights either way")
    train_micro_batch_size_per_gpu: Optional[int] = Field(
        None, ge=1, description="default: the prepared data loader's per-process batch size")
    config: dict[str, Any] = Field(default_factory=dict,
                                   description="further DeepSpeed keys, as in its JSON (merged, conflicts checked)")
    model_overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per model: {'<prepare index or class name>': {DeepSpeed keys}}")
    load_universal: bool = Field(False, description="load a DeepSpeed universal checkpoint (changed world size)")
    cpu_shm_comm: bool = Field(False, description="on cpu, build DeepSpeed's shared-memory all-reduce op (slow "
                                                  "first compile; inference only)")
    log_level: Literal["debug", "info", "warning", "error"] = "warning"


# --- helpers on nested dicts -------------------------------------------------------------


def get_path(tree: dict, path: tuple[str, ...], default: Any = None) -> Any:
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[path[-1]] = value


def has_path(tree: dict, path: tuple[str, ...]) -> bool:
    sentinel = object()
    return get_path(tree, path, sentinel) is not sentinel


def leaves(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += leaves(value, prefix + (key,))
        else:
            out.append((prefix + (key,), value))
    return out


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def load_json_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"deepspeed.deepspeed_config_file '{path}' does not exist")
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise ConfigError(f"deepspeed.deepspeed_config_file '{path}' is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed.deepspeed_config_file '{path}' must hold a JSON object")
    return data


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


# --- building the base config (before any process group) ---------------------------------


#: where the DeepSpeed config of an Accelerate ``DeepSpeedPlugin`` comes from, in messages
PLUGIN_SOURCE = "the DeepSpeedPlugin's config (Accelerator(deepspeed_plugin=...))"
RUN_PLUGIN_SOURCE = "the run's DeepSpeed config (accelerator.state.deepspeed_plugin)"


def base_config(resolved, world_size: int, plugin_config: Optional[dict] = None, from_user_plugin: bool = True
                ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The DeepSpeed config from every source, with "auto" values still unfilled.

    :param plugin_config: the config of an Accelerate ``DeepSpeedPlugin`` as it is now (transformers'
        Trainer completes it after the Accelerator exists). It stands where the user's DeepSpeed JSON
        stands (conflicts with torchbay's settings are errors) and replaces ``deepspeed.config``, which
        holds the plugin's config as it was when the Accelerator was made. As in Accelerate, its
        ``gradient_accumulation_steps`` wins over the Accelerator's (transformers' Trainer gives the
        Accelerator 1 and accumulates itself).
    :param from_user_plugin: False when the plugin was made from torchbay's own config (a run configured
        without a DeepSpeedPlugin whose ``accelerator.state.deepspeed_plugin`` was asked for): its config
        already holds the JSON file's values, which it replaces.
    :return: ``(config, origins, problems)``: ``origins`` maps a dotted DeepSpeed key to where
        its value came from; ``problems`` lists every conflict (each showing both values).
    """
    config = resolved.config
    section: DeepSpeedSection = config.deepspeed
    problems: list[str] = []
    origins: dict[str, str] = {}
    file_cfg: dict[str, Any] = {}
    file_name = section.deepspeed_config_file
    if plugin_config is not None:
        if file_name and from_user_plugin:
            return {}, {}, [f"deepspeed.deepspeed_config_file ({file_name}) and a DeepSpeedPlugin's config both give "
                            f"the DeepSpeed config; keep one (DeepSpeedPlugin(hf_ds_config={file_name!r}) reads the "
                            f"file)"]
        file_cfg = copy.deepcopy(plugin_config)
        file_cfg.pop("steps_per_print", None)
    elif file_name:
        try:
            file_cfg = load_json_file(file_name)
        except ConfigError as exc:
            return {}, {}, exc.problems
    where_file = f"the DeepSpeed JSON {file_name}"
    if plugin_config is not None:
        where_file = PLUGIN_SOURCE if from_user_plugin else RUN_PLUGIN_SOURCE
    if "bfloat16" in file_cfg:  # DeepSpeed still reads its old name for the bf16 section
        if "bf16" in file_cfg:
            problems.append(f"{where_file} has both 'bf16' and its old name 'bfloat16'; keep one ('bf16')")
        else:
            file_cfg["bf16"] = file_cfg.pop("bfloat16")
    out = copy.deepcopy(file_cfg)
    for path, _ in leaves(file_cfg):
        origins[dotted(path)] = where_file

    def source(key: str) -> str:
        src = resolved.source_of(key)
        labels = {"env": "TORCHBAY_* environment", "file": "the torchbay config file", "cli": "a command-line flag",
                  "args": "Accelerator(...) arguments", "default": "the default", "launcher": "torchbay launch"}
        return f"torchbay '{key}' (from {labels.get(src, src)})"

    def put(path: tuple[str, ...], value: Any, where: str) -> None:
        if has_path(file_cfg, path):
            theirs = get_path(file_cfg, path)
            if theirs != AUTO and not _same(theirs, value):
                problems.append(f"DeepSpeed '{dotted(path)}' is {theirs!r} in {where_file} but {value!r} in {where}; "
                                f"remove one of them or write \"auto\" in the JSON")
                return
        set_path(out, path, value)
        origins[dotted(path)] = where

    # the section's own keys
    for key, path in SECTION_PATHS.items():
        value = getattr(section, key)
        if value is not None:
            put(path, value, source(f"deepspeed.{key}"))
    if plugin_config is None:  # else deepspeed.config is the plugin's config when the Accelerator was made
        for path, value in leaves(section.config):
            put(path, value, source("deepspeed.config." + dotted(path)))

    # core keys DeepSpeed must agree with
    ga = config.gradient_accumulation_steps
    plugin_ga = file_cfg.get("gradient_accumulation_steps") if plugin_config is not None else None
    if isinstance(plugin_ga, int) and not isinstance(plugin_ga, bool):
        ga = plugin_ga  # Accelerate: "Using DeepSpeed's value"
    else:
        put(("gradient_accumulation_steps",), ga, source("gradient_accumulation_steps"))
    mp = config.mixed_precision
    if mp in FP8_MODES:
        problems.append(FP8_REFUSAL.replace("fp8", mp, 1))
    for name in ("bf16", "fp16"):
        want = mp == name
        path = (name, "enabled")
        theirs = get_path(file_cfg, path)
        if theirs is None and name in file_cfg and isinstance(file_cfg[name], dict):
            theirs = True  # a section without "enabled" means enabled in DeepSpeed
        if theirs not in (None, AUTO) and bool(theirs) != want:
            problems.append(f"DeepSpeed '{name}.enabled' is {theirs!r} in {where_file} but "
                            f"{source('mixed_precision')} is '{mp}'; set mixed_precision: "
                            f"{name if theirs else 'no'} or write \"enabled\": \"auto\" in the JSON")
            continue
        if want or has_path(out, (name,)):
            set_path(out, path, want)
            origins.setdefault(dotted(path), source("mixed_precision"))
    if get_path(out, ("bf16", "enabled")) and get_path(out, ("fp16", "enabled")):
        problems.append(f"{where_file} enables both bf16 and fp16; enable one")
    stage = get_path(out, ("zero_optimization", "stage"))
    if stage is None:
        set_path(out, ("zero_optimization", "stage"), 2)
        origins["zero_optimization.stage"] = "torchbay-deepspeed's default"
    elif stage == AUTO:
        problems.append(f"DeepSpeed 'zero_optimization.stage' is \"auto\" in {where_file}; write a stage (0-3) there "
                        f"or set deepspeed.zero_stage")
    tbs = get_path(out, ("train_batch_size",))
    mbs = get_path(out, ("train_micro_batch_size_per_gpu",))
    if isinstance(tbs, int) and isinstance(mbs, int) and tbs != mbs * ga * world_size:
        problems.append(f"DeepSpeed 'train_batch_size' is {tbs} in {where_file} but micro batch {mbs} x "
                        f"gradient accumulation {ga} x {world_size} processes is {mbs * ga * world_size}; "
                        f"write \"auto\"")
    out.setdefault("steps_per_print", 2**31 - 1)  # torchbay users log themselves
    out.setdefault("zero_allow_untested_optimizer", True)
    return out, origins, problems


def model_config(base: dict, section: DeepSpeedSection, index: int, model: Any) -> dict:
    """``base`` with this model's overrides (by prepare index or class name) merged in."""
    cfg = copy.deepcopy(base)
    for key in (str(index), type(model).__name__):
        for path, value in leaves(section.model_overrides.get(key, {})):
            set_path(cfg, path, value)
    return cfg


# --- filling "auto" -------------------------------------------------------------------------


# --- the device's own limits (checked before launch) -----------------------------------------


def fp16_unsupported_reason(torch_type: str, device_backend_cls: Any = None) -> Optional[str]:
    """Why DeepSpeed's accelerator for ``torch_type`` cannot run fp16 here (as DeepSpeed decides it), or None."""
    import os

    import torch

    if torch_type == "cpu":
        try:
            supported = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:
            supported = False
        return None if supported else "DeepSpeed's CPU accelerator supports fp16 only where oneDNN has fp16 kernels"
    capability = device_backend_cls.compute_capability(0) if device_backend_cls is not None else None
    if torch_type == "cuda" and capability is not None and capability[0] < 7 \
            and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") != "1":
        return f"DeepSpeed refuses fp16 on compute capability {capability[0]}.{capability[1]} (below 7.0)"
    return None


def device_problems(cfg: dict, device_backend_cls: Any) -> list[str]:
    """Settings of ``cfg`` the selected device cannot run, each as one line with the fix."""
    if not get_path(cfg, ("fp16", "enabled")):
        return []
    torch_type = device_backend_cls.torch_type()
    reason = fp16_unsupported_reason(torch_type, device_backend_cls)
    if reason is None:
        return []
    return [f"DeepSpeed fp16 cannot run on device '{device_backend_cls.name}': {reason}; use mixed_precision: bf16 "
            f"(\"bf16\": {{\"enabled\": true}} in the JSON) or no (fp32)"]


def checkpoint_writer_problems(cfg: dict) -> list[str]:
    """DeepSpeed settings that would make torchbay publish a checkpoint whose files are not all written yet."""
    writer = get_path(cfg, ("checkpoint", "writer"))
    if isinstance(writer, dict) and writer.get("decoupled"):
        return ["the DeepSpeed config's \"checkpoint\": {\"writer\": {\"decoupled\": true}} has another process "
                "finish the checkpoint files after the engine's save returns, so torchbay would publish a checkpoint "
                "before its files are written: remove \"decoupled\" from the DeepSpeed config (for saves that do not "
                "stop training use save_state(blocking=False) with strategy fsdp, docs/checkpoint-guarantees.md)"]
    return []
