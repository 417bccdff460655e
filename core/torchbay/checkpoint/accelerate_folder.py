"""``accelerator.load_state(dir)`` on a folder written by Accelerate's ``save_state`` (Accelerate 1.x layout).

A user moving mid-training resumes from the checkpoint Accelerate wrote: ``model.safetensors``
(``model_<i>.safetensors``; or ``pytorch_model[_<i>].bin``), ``optimizer[_<i>].bin``,
``scheduler[_<i>].bin``, ``custom_checkpoint_<i>.pkl``, ``scaler.pt`` and ``random_states_<rank>.pkl``.
:class:`~torchbay.checkpoint.checkpointer.StateCheckpointer` calls :func:`load_accelerate_state` when the folder
has no torchbay manifest and :func:`is_accelerate_state` recognises it.

Nothing is unpickled with arbitrary classes: weights come from safetensors (or ``torch.load`` with
``weights_only=True``), optimizer, scheduler, scaler and registered objects' states from
``torch.load(weights_only=True)``, and the RNG files through torchbay's allow-list
(:func:`torchbay.storage.safe_load.safe_load_with_numpy`: tensors, dicts, lists, tuples, numbers, strings,
bytes and NumPy arrays of numbers, nothing else). Every file is read and checked on every rank
before any object changes; a problem on one rank is an error on all. Accelerate's data-loader
files (``sampler.bin``, ``dl_state_dict.bin``) hold pickled sampler objects or another loader's
positions: they are refused, naming the file (docs/accelerate-compat.md).
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchbay.axes.strategy import Strategy
from torchbay.errors import CheckpointError
from torchbay.storage.publish import MANIFEST
from torchbay.storage.safe_load import safe_load_with_numpy, safe_torch_load

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.checkpoint.checkpointer import StateCheckpointer
    from torchbay.checkpoint.inputs import CheckpointServices, PreparedObjects

log = logging.getLogger("torchbay")

RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
#: prefixes of Accelerate's saved keys when it saved the wrapped model (DDP's module., torch.compile's _orig_mod.)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _indexed(name: str, i: int) -> str:
    """Accelerate's names: ``optimizer.bin``, ``optimizer_1.bin``... (the index before the first dot)."""
    return name if i == 0 else name.replace(".", f"_{i}.", 1)


def is_accelerate_state(directory: Path) -> bool:
    """A folder Accelerate's ``save_state`` wrote: an RNG file and weights or optimizer state, no manifest."""
    if not directory.is_dir() or (directory / MANIFEST).exists():
        return False
    names = {p.name for p in directory.iterdir()}
    has_rng = any(RNG_FILE.fullmatch(n) for n in names)
    return has_rng and bool(names & {"model.safetensors", "pytorch_model.bin", "optimizer.bin"})


def _model_file(directory: Path, i: int) -> Path | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = directory / _indexed(name, i)
        if path.is_file():
            return path
    return None


def _check(run: CheckpointServices, prepared: PreparedObjects, directory: Path) -> dict[str, Any]:
    """Which file holds what; raises for anything missing, extra or that torchbay cannot map."""
    problems = []
    if type(run.strategy).load_checkpoint is not Strategy.load_checkpoint:
        raise CheckpointError(
            f"load_state: {directory} was written by Accelerate's save_state (full weights, optimizer "
            f"state by parameter position); strategy '{run.strategy.name}' keeps its own sharded "
            f"state: load it with strategy single or ddp and save_state there to get a torchbay "
            f"checkpoint, or load the weights alone with load_checkpoint_in_model")
    counts = {"models": len(prepared.models), "optimizers": len(prepared.optimizers),
              "schedulers": len(prepared.schedulers), "registered objects": len(prepared.custom_objects)}
    plan: dict[str, Any] = {"models": [], "optimizers": [], "schedulers": [], "custom": []}
    for i in range(counts["models"]):
        path = _model_file(directory, i)
        if path is None:
            problems.append(f"model {i}: neither {_indexed('model.safetensors', i)} nor "
                            f"{_indexed('pytorch_model.bin', i)} is there")
        plan["models"].append(path)
    for key, pattern, count in (("optimizers", "optimizer.bin", counts["optimizers"]),
                                ("schedulers", "scheduler.bin", counts["schedulers"]),
                                ("custom", "custom_checkpoint_0.pkl", counts["registered objects"])):
        for i in range(count):
            name = f"custom_checkpoint_{i}.pkl" if key == "custom" else _indexed(pattern, i)
            if not (directory / name).is_file():
                problems.append(f"{name} is missing (this run prepared {count} "
                                f"{key.replace('custom', 'registered objects')})")
            plan[key].append(directory / name)
    # more saved than prepared: the objects would be matched to the wrong files
    extra = [n for n in ((_model_file(directory, counts["models"]) or Path("")).name,
                         _indexed("optimizer.bin", counts["optimizers"]),
                         _indexed("scheduler.bin", counts["schedulers"]),
                         f"custom_checkpoint_{counts['registered objects']}.pkl") if n and (directory / n).is_file()]
    if extra:
        problems.append(f"it holds more objects than this run prepared ({', '.join(extra)}); prepare and register the "
                        f"same objects in the same order as the run that saved it")
    for name in ("sampler.bin", "dl_state_dict.bin"):
        if (directory / name).exists():
            problems.append(f"{name} holds Accelerate's data-loader state (a pickled sampler object or a stateful "
                            f"loader's positions), which torchbay cannot read safely or map onto its loaders; move it "
                            f"out of the folder to resume with each loader at the start of its epoch (as Accelerate "
                            f"does for map-style datasets) and use accelerator.skip_first_batches")
    saved = sorted(int(m.group(1)) for p in directory.iterdir() if (m := RNG_FILE.fullmatch(p.name)))
    rank = run.process_index
    rng_rank = rank if rank in saved else (rank % len(saved) if saved and rank >= len(saved) else None)
    if rng_rank is None:
        problems.append(f"random_states_{rank}.pkl (the RNG state of rank {rank}) is missing")
    elif rng_rank != rank:
        log.warning("rank %d: the Accelerate checkpoint was written by %d process(es); this rank resumes with the "
                    "RNG state of rank %d", rank, len(saved), rng_rank)
    plan["rng"] = directory / f"random_states_{rng_rank}.pkl"
    scaler = getattr(run.precision, "scaler", None)
    plan["scaler"] = directory / "scaler.pt" if (directory / "scaler.pt").is_file() else None
    if scaler is not None and plan["scaler"] is None:
        problems.append("scaler.pt (the fp16 loss scaler) is missing, and this run scales its loss (fp16)")
    if scaler is None and plan["scaler"] is not None:
        problems.append("scaler.pt holds an fp16 loss scaler, and this run does not use one: resume with "
                        "mixed_precision: fp16")
    if problems:
        raise CheckpointError(f"load_state: {directory} (written by Accelerate's save_state) cannot be loaded: "
                              + "; ".join(problems))
    return plan


def _read_weights(path: Path, trusted: bool) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    return safe_torch_load(path, f"model weights {path.name}", trusted=trusted)


def _read(plan: dict[str, Any], trusted: bool, backend: Any) -> dict[str, Any]:
    """Every file this rank needs, read (nothing changed yet)."""
    return {"models": [_read_weights(p, trusted) for p in plan["models"]],
            "optimizers": [safe_torch_load(p, f"optimizer state {p.name}", trusted=trusted)
                           for p in plan["optimizers"]],
            "schedulers": [safe_torch_load(p, f"scheduler state {p.name}", trusted=trusted)
                           for p in plan["schedulers"]],
            "custom": [safe_torch_load(p, f"registered object {p.name}", trusted=trusted) for p in plan["custom"]],
            "scaler": safe_torch_load(plan["scaler"], "loss scaler", trusted=trusted) if plan["scaler"] else None,
            "rng": _checked_rng(safe_load_with_numpy(plan["rng"], f"RNG state {plan['rng'].name}", trusted=trusted),
                                plan["rng"], backend)}


def _checked_rng(state: Any, path: Path, backend: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(state):
        raise CheckpointError(f"{path} is not Accelerate's RNG state (random_state, numpy_random_seed, "
                              f"torch_manual_seed expected)")
    device_key = f"torch_{backend.torch_type()}_manual_seed"
    if backend.torch_type() != "cpu" and device_key not in state:
        saved = [k for k in state if k.endswith("_manual_seed") and k != "torch_manual_seed"]
        raise CheckpointError(f"{path} holds no RNG state for this run's device '{backend.torch_type()}' "
                              f"({device_key}; it has {saved or 'the CPU generators only'}): resume on the device "
                              f"the checkpoint was written on")
    return state


def _strip_wrapper_prefix(state: dict[str, torch.Tensor], own: set[str]) -> dict[str, torch.Tensor]:
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state) and not any(k.startswith(prefix) for k in own):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _load_model(i: int, module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    own = module.state_dict()
    state = _strip_wrapper_prefix(state, set(own))
    missing, unexpected = module.load_state_dict(state, strict=False)
    # a weight tied to a saved one (Accelerate's safetensors keep one name per storage) is loaded through it
    loaded_storages = {own[k].untyped_storage().data_ptr() for k in state if k in own}
    missing = [k for k in missing if not k.endswith("_extra_state")
               and own[k].untyped_storage().data_ptr() not in loaded_storages]
    if missing or unexpected:
        raise CheckpointError(f"model {i}: {path} does not fit the prepared model: missing keys {missing[:10]}, "
                              f"unexpected keys {unexpected[:10]}")


def _restore_rng(state: dict[str, Any], backend: Any) -> None:
    import numpy as np

    part = "random_state"
    try:
        random.setstate(state["random_state"])
        part = "numpy_random_seed"
        np.random.set_state(state["numpy_random_seed"])
        part = "torch_manual_seed"
        torch.set_rng_state(state["torch_manual_seed"])
        if backend.torch_type() != "cpu":
            part = f"torch_{backend.torch_type()}_manual_seed"
            backend.set_rng_state(list(state[part]))
    except Exception as exc:
        raise CheckpointError(f"RNG state part '{part}' of the Accelerate checkpoint could not be restored: "
                              f"{type(exc).__name__}: {exc}") from exc


def load_accelerate_state(checkpointer: StateCheckpointer, directory: Path) -> None:
    """Restore the prepared objects from Accelerate's ``save_state`` folder (every rank calls it)."""
    run, prepared = checkpointer.run, checkpointer.prepared
    trusted = checkpointer.trusted
    plan = checkpointer.on_every_rank("load_state", lambda: _check(run, prepared, directory))
    read = checkpointer.on_every_rank("load_state", lambda: _read(plan, trusted, run.device_backend))

    def apply() -> None:
        restore = checkpointer.restore_part
        for i, (model, state) in enumerate(zip(prepared.models, read["models"])):
            _load_model(i, run.strategy.unwrap_model(model), state, plan["models"][i])
        for i, (opt, state) in enumerate(zip(prepared.optimizers, read["optimizers"])):
            restore(f"optimizer {i}", opt.load_state_dict, state)
        for i, (scheduler, state) in enumerate(zip(prepared.schedulers, read["schedulers"])):
            restore(f"scheduler {i}", scheduler.load_state_dict, state)
        for i, (obj, state) in enumerate(zip(prepared.custom_objects, read["custom"])):
            restore(f"registered object {i}", obj.load_state_dict, state)
        if read["scaler"] is not None:
            restore("loss scaler", run.precision.load_state_dict, {"scaler": read["scaler"]})
        _restore_rng(read["rng"], run.device_backend)
        if "step" in read["rng"]:
            checkpointer.training.gradient_step = int(read["rng"]["step"])

    checkpointer.on_every_rank("load_state", apply)
