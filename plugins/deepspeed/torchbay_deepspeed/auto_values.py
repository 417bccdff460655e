"""Filling a DeepSpeed config's ``"auto"`` values as Accelerate and transformers do (batch sizes, gradient accumulation,
clipping, bucket sizes from the model's hidden size, optimizer and scheduler settings) and writing them back into the
user's live config."""

from __future__ import annotations

import copy
from typing import Any, Optional

from torchbay_deepspeed.config import AUTO, HIDDEN_SIZE_KEYS, dotted, get_path, has_path, leaves, set_path


def hidden_size_of(model: Any) -> Optional[int]:
    """``model.config.hidden_size`` (Hugging Face style), else the widest Linear/Embedding."""
    cfg = getattr(model, "config", None)
    for attr in ("hidden_size", "d_model", "n_embd"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int):
            return value
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes:
        return max(sizes)
    import torch

    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widths += [m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(widths) if widths else None


def fill_auto(cfg: dict, *, micro_batch: Optional[tuple[int, str]], world_size: int, model: Any,
              optimizer_hint: Optional[dict] = None, scheduler_hint: Optional[dict] = None,
              has_optimizer: bool) -> tuple[dict, list[str], list[str]]:
    """Replace every "auto" in ``cfg``; return ``(config, report_lines, problems)``."""
    cfg = copy.deepcopy(cfg)
    report: list[str] = []
    problems: list[str] = []

    def fill(path: tuple[str, ...], value: Any, why: str) -> None:
        if get_path(cfg, path) == AUTO:
            if value is None:
                parent = get_path(cfg, path[:-1]) if len(path) > 1 else cfg
                parent.pop(path[-1], None)
                report.append(f"{dotted(path)}: auto -> (DeepSpeed's default) ({why})")
            else:
                set_path(cfg, path, value)
                report.append(f"{dotted(path)}: auto -> {value!r} ({why})")

    ga = cfg["gradient_accumulation_steps"]
    mbs = get_path(cfg, ("train_micro_batch_size_per_gpu",))
    if mbs in (None, AUTO):
        size, why = micro_batch or (1, "no data loader was prepared before the model; set "
                                       "deepspeed.train_micro_batch_size_per_gpu to silence this")
        if mbs is None:
            cfg["train_micro_batch_size_per_gpu"] = size
            report.append(f"train_micro_batch_size_per_gpu: {size} ({why})")
        else:
            fill(("train_micro_batch_size_per_gpu",), size, why)
        mbs = size
    tbs = mbs * ga * world_size
    if cfg.get("train_batch_size") in (None, AUTO):
        if cfg.get("train_batch_size") is None:
            cfg["train_batch_size"] = tbs
        else:
            fill(("train_batch_size",), tbs, f"micro batch {mbs} x accumulation {ga} x {world_size} processes")
    fill(("gradient_clipping",), None, "deepspeed.gradient_clipping is not set: no clipping")
    zero = cfg.get("zero_optimization", {})
    if isinstance(zero, dict) and any(zero.get(k) == AUTO for k in HIDDEN_SIZE_KEYS):
        hidden = hidden_size_of(model)
        why = f"hidden size {hidden}" if hidden else "no hidden size found on the model"
        for key, value in (("reduce_bucket_size", hidden and hidden * hidden),
                           ("stage3_prefetch_bucket_size", hidden and int(0.9 * hidden * hidden)),
                           ("stage3_param_persistence_threshold", hidden and 10 * hidden)):
            fill(("zero_optimization", key), value, why)
    for path, value in leaves(cfg.get("optimizer", {}).get("params", {}) if isinstance(cfg.get("optimizer"), dict)
                              else {}, ("optimizer", "params")):
        if value == AUTO:
            fill(path, (optimizer_hint or {}).get(path[-1]), "from DummyOptim" if optimizer_hint else
                 "no DummyOptim was prepared")
    sched_params = get_path(cfg, ("scheduler", "params"))
    if isinstance(sched_params, dict):
        hint = dict(scheduler_hint or {})
        for path, value in leaves(sched_params, ("scheduler", "params")):
            if value == AUTO:
                key = path[-1]
                fill(path, hint.get(key), "from DummyScheduler" if key in hint else
                     "not given to DummyScheduler")
    if not has_optimizer:
        for key in ("optimizer", "scheduler"):
            cfg.pop(key, None)
        if isinstance(zero, dict):
            zero.pop("offload_optimizer", None)
    left = [dotted(p) for p, v in leaves(cfg) if v == AUTO]
    if left:
        problems.append(f"DeepSpeed keys left \"auto\" that torchbay cannot fill: {', '.join(left)}; "
                        f"write values there")
    return cfg, report, problems


def accelerate_fills(cfg: dict, *, optimizer: Any, scheduler: Any, num_processes: int, split_batches: bool
                     ) -> list[str]:
    """Fill in place the "auto" values Accelerate fills itself for a ``DeepSpeedPlugin``'s config (its
    ``prepare``), where torchbay's own choice differs: clipping 1.0, no 16-bit gathering on save,
    ``DummyOptim``'s lr / weight decay, and for a ``DummyScheduler`` of the config's scheduler: warm-up
    from 0 to the optimizer's lr in at least one step, its total steps per process. The other "auto"
    values are then filled by :func:`fill_auto`, as Accelerate fills them. Returns report lines."""
    import math

    values: dict[tuple[str, ...], tuple[Any, str]] = {
        ("gradient_clipping",): (1.0, "Accelerate's default for a DeepSpeedPlugin"),
        ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): (False, "Accelerate's default"),
    }
    if optimizer is not None and hasattr(optimizer, "lr") and hasattr(optimizer, "weight_decay"):  # DummyOptim
        values[("optimizer", "params", "lr")] = (optimizer.lr, "from DummyOptim")
        values[("optimizer", "params", "weight_decay")] = (optimizer.weight_decay, "from DummyOptim")
    if scheduler is not None and getattr(scheduler, "lr_scheduler_callable", None) is None:
        owner = scheduler.optimizer
        max_lr = owner.defaults["lr"] if getattr(owner, "defaults", None) else getattr(owner, "lr", None)
        values[("scheduler", "params", "warmup_min_lr")] = (0, "from DummyScheduler")
        values[("scheduler", "params", "warmup_max_lr")] = (max_lr, "the optimizer's lr")
        values[("scheduler", "params", "warmup_num_steps")] = (max(1, scheduler.warmup_num_steps or 0),
                                                                "from DummyScheduler (at least 1)")
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps if split_batches else math.ceil(scheduler.total_num_steps / num_processes)
            values[("scheduler", "params", "total_num_steps")] = (total, f"DummyScheduler's total over "
                                                                         f"{1 if split_batches else num_processes} "
                                                                         f"process(es)")
    report = []
    for path, (value, why) in values.items():
        if get_path(cfg, path) == AUTO and value is not None:
            set_path(cfg, path, value)
            report.append(f"{dotted(path)}: auto -> {value!r} ({why})")
    return report


def write_back(live: dict, filled: dict) -> None:
    """Put the values torchbay filled into the "auto" places of ``live`` (the plugin's config, as Accelerate
    fills it in place); an "auto" that DeepSpeed's default replaced is removed."""
    for path, value in leaves(live):
        if value == AUTO:
            parent = get_path(live, path[:-1]) if len(path) > 1 else live
            if has_path(filled, path):
                parent[path[-1]] = get_path(filled, path)
            else:
                parent.pop(path[-1], None)
