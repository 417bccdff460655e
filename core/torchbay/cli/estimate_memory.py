"""``torchbay estimate-memory MODEL``: parameter, gradient and optimizer memory per process.

MODEL is a Python path ``package.module:factory`` (a callable returning an ``nn.Module``,
built on the meta device so no memory is used, or an ``nn.Module`` instance) or a
safetensors checkpoint (a file, or a folder of ``*.safetensors`` shards; only the headers
are read). Each installed strategy reports its own per-process numbers
(``Strategy.estimate_memory``); activations are not included. Last comes the device map
that ``device_map="auto"`` would choose on this machine (big-model inference: the device
plugins give each device's budget).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from torchbay.errors import IncompatibleSetupError

#: the core settings the estimate reads (every strategy and precision is estimated; other keys: --set)
ESTIMATE_KEYS = ("launch.num_processes", "launch.nproc_per_node", "launch.num_machines")


def register(subparsers) -> None:
    from torchbay.cli.options import add_config_options

    parser = subparsers.add_parser("estimate-memory", help="per-process memory of a model for each strategy "
                                   "and precision (no activations)", description=__doc__.split("\n\n", 1)[1])
    parser.add_argument("model", metavar="MODEL", help="pkg.module:factory, or a .safetensors file or folder")
    add_config_options(parser, "estimate-memory", core_keys=ESTIMATE_KEYS)
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.set_defaults(func=estimate_command)


def _error(message: str):
    from torchbay.errors import ConfigError

    return ConfigError(message, header="cannot read the model")


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files that make up the model in ``folder``: those its index (or torchbay
    manifest) names, else ``model.safetensors`` when there is one, so that stray files of another
    save are not counted."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    try:
        if indexes:
            names = {n for index in indexes for n in json.loads(index.read_text())["weight_map"].values()}
            return sorted(folder / n for n in names)
        manifest = folder / "torchbay_manifest.json"
        if manifest.is_file():
            return sorted(folder / n for n in json.loads(manifest.read_text())["files"] if n.endswith(".safetensors"))
        if (folder / "model.safetensors").is_file():  # save_model's single file (Accelerate's name)
            return [folder / "model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _error(f"'{folder}' has an unreadable index or manifest ({exc})") from None
    return sorted(folder.glob("*.safetensors"))


def count_safetensors(path: Path) -> dict[str, int]:
    total = sum(_numel(meta["shape"]) for meta in safetensors_shapes(path).values())
    return {"parameters": total, "trainable": total}


def _numel(shape) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel


def safetensors_shapes(path: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"shape": [...], "dtype": "F32"...}}`` from the headers of the model's files."""
    files = _weight_files(path) if path.is_dir() else [path]
    if not files:
        raise _error(f"'{path}' holds no *.safetensors file")
    from torchbay.storage.inplace import read_header_json

    out = {}
    for file in files:
        try:
            with open(file, "rb") as fp:
                _, header = read_header_json(fp)
        except (OSError, ValueError) as exc:
            raise _error(f"'{file}' is not a safetensors file ({exc})") from None
        out.update({name: meta for name, meta in header.items() if name != "__metadata__"})
    return out


def meta_model(shapes: dict[str, dict[str, Any]]):
    """A module tree on the meta device with one parameter per checkpoint tensor (for placement)."""
    import torch

    from torchbay.storage.inplace import SAFETENSORS_DTYPES

    root = torch.nn.Module()
    for name, meta in shapes.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not isinstance(getattr(owner, part, None), torch.nn.Module):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"), torch.float32)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(meta["shape"], dtype=dtype, device="meta"),
                                                          requires_grad=False))
    return root


def auto_device_map(model) -> dict[str, Any]:
    """What ``device_map="auto"`` chooses here: the budgets, the map, and bytes per device."""
    from torchbay.big_modeling.device_map import compute_module_sizes, get_max_memory
    from torchbay.big_modeling.infer import get_balanced_memory, infer_auto_device_map

    budgets = get_max_memory()
    device_map = infer_auto_device_map(model, max_memory=get_balanced_memory(model, budgets))
    sizes = compute_module_sizes(model)
    placed: dict[str, int] = {}
    for name, device in device_map.items():
        placed[str(device)] = placed.get(str(device), 0) + sizes.get(name, 0)
    return {"max_memory": {str(k): v for k, v in budgets.items()}, "device_map": device_map, "placed": placed}


def build_module(spec: str):
    """The module of ``pkg.module:factory`` (called on the meta device)."""
    import torch

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _error(f"'{spec}' is neither an existing safetensors file nor a Python path 'package.module:factory'")
    sys.path.insert(0, os.getcwd())  # absolute: a finder cached for "." may describe another directory
    importlib.invalidate_caches()  # the module may have been written a moment ago
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _error(f"cannot import '{module_name}': {exc}") from None
    finally:
        sys.path.pop(0)
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise _error(f"'{module_name}' has no attribute '{attr}'") from None
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise _error(f"'{spec}' is neither an nn.Module nor a callable returning one")
        _refuse_arguments(spec, obj)
        try:
            with torch.device("meta"):
                obj = obj()
        except Exception as exc:
            raise _error(f"calling '{spec}' raised {type(exc).__name__}: {exc}; give a factory that builds the "
                         f"model without arguments") from None
        if not isinstance(obj, torch.nn.Module):
            raise _error(f"'{spec}' returned {type(obj).__name__}, not an nn.Module")
    return obj


def _refuse_arguments(spec: str, factory) -> None:
    """A factory with required parameters cannot be called here: say which, and what to give instead."""
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise _error(f"'{spec}' needs arguments ({', '.join(required)}); estimate-memory calls it without any: give "
                     f"a function that takes none, e.g. def build(): return {spec.rpartition(':')[2]}(...)")


def estimate(counts: dict[str, int], resolved, pm, world_size: int, module: Any = None) -> list[dict[str, Any]]:
    from torchbay.axes.precision import by_mode
    from torchbay.distributed.parallelism_config import parallel_sizes, validate_sizes

    registries = pm.registries()
    modes = list(by_mode(registries["precisions"]))  # every registered mode, once (engines share a row)
    sizes = parallel_sizes(resolved.config)
    active = [dim for dim, size in sizes.items() if size > 1]
    rows = []
    for name, cls in sorted(registries["strategies"].items()):
        if (world_size > 1 and not cls.multi_process) or (world_size == 1 and not cls.single_process):
            continue
        missing = [dim for dim in active if dim not in getattr(cls, "parallel_dims", ())]
        if missing:  # the parallel sizes given (--tp-size...) are not something this strategy builds
            rows.append({"strategy": name, "precision": "-", "estimate": None,
                         "note": f"cannot build the parallel dimension(s) {', '.join(missing)}"})
            continue
        wrong = validate_sizes(cls.built_sizes(resolved.config, world_size), world_size) if active else []
        if wrong:
            rows.append({"strategy": name, "precision": "-", "estimate": None, "note": wrong[0]})
            continue
        strategy_counts = dict(counts)
        if module is not None:
            try:
                strategy_counts.update(cls.memory_counts(resolved.config, module))
            except Exception as exc:  # e.g. a tensor-parallel plan that does not fit the model
                rows.append({"strategy": name, "precision": "-", "estimate": None, "note": str(exc)})
                continue
        for mode in modes:
            config = resolved.config.model_copy(update={"strategy": name, "mixed_precision": mode})
            try:
                found = cls.estimate_memory(config, world_size, strategy_counts)
            except IncompatibleSetupError as refused:  # a combination the strategy would refuse to run
                rows.append({"strategy": name, "precision": mode, "estimate": None,
                             "note": "refused: " + "; ".join(refused.problems)})
                continue
            if found is None:
                rows.append({"strategy": name, "precision": mode, "estimate": None,
                             "note": f"plugin '{getattr(cls, '_torchbay_plugin', '?')}' gives no estimate"})
                continue
            rows.append({"strategy": name, "precision": mode, "parameters": found.parameters,
                         "gradients": found.gradients, "optimizer": found.optimizer, "total": found.total,
                         "sharding_factor": found.sharding_factor, "note": found.note})
    return rows


#: a strategy's note up to this length goes next to its name in the table; a longer one under it
SHORT_NOTE = 24


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def estimate_command(args: argparse.Namespace) -> int:
    from torchbay.cli.options import resolve_from_args
    from torchbay.distributed.parallelism_config import parallel_sizes
    from torchbay.registry.manager import get_plugin_manager

    pm = get_plugin_manager()
    resolved = resolve_from_args(args, pm=pm)
    path = Path(args.model)
    module = meta_model(safetensors_shapes(path)) if path.exists() else build_module(args.model)
    params = list(module.parameters())
    counts = {"parameters": sum(p.numel() for p in params),
              "trainable": sum(p.numel() for p in params if p.requires_grad)}
    if path.exists():
        counts["trainable"] = counts["parameters"]
    launch = resolved.config.launch
    world = launch.num_processes or (launch.nproc_per_node or 1) * launch.num_machines
    rows = estimate(counts, resolved, pm, world, module)
    placement = auto_device_map(module)
    if args.format == "json":
        print(json.dumps({"counts": counts, "world_size": world, "rows": rows, "big_model_inference": placement,
                          "parallelism": parallel_sizes(resolved.config)}, indent=2))
        return 0
    parallel = " x ".join(f"{dim} {size}" for dim, size in parallel_sizes(resolved.config).items() if size > 1)
    print(f"{args.model}: {counts['parameters']:,} parameters ({counts['trainable']:,} trainable); "
          f"{world} process(es){f' as {parallel}' if parallel else ''}; per process, without activations")
    headers = ("STRATEGY", "PRECISION", "PARAMETERS", "GRADIENTS", "OPTIMIZER", "TOTAL")
    cells, footnotes = [], []
    for r in rows:
        if r.get("total") is None:
            cells.append((r["strategy"], r["precision"], r["note"], "", "", ""))
            continue
        label = r["strategy"]
        if r.get("note") and len(r["note"]) <= SHORT_NOTE:
            label += f" ({r['note']})"
        elif r.get("note"):  # a long note once under the table, not in every row's first column
            if r["note"] not in footnotes:
                footnotes.append(r["note"])
            label += f" [{footnotes.index(r['note']) + 1}]"
        cells.append((label, r["precision"], _gib(r["parameters"]), _gib(r["gradients"]),
                      _gib(r["optimizer"]), _gib(r["total"])))
    measured = [c for c in cells if c[3]]
    widths = [max(len(h), *(len(c[i]) for c in (cells if i < 2 else measured))) if measured or i < 2 and cells
              else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for c in cells:
        if not c[3]:
            print(f"{c[0].ljust(widths[0])}  {c[1].ljust(widths[1])}  {c[2]}")
        else:
            print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    for number, note in enumerate(footnotes, 1):
        print(f"[{number}] {note}")
    print("optimizer assumes Adam (two fp32 states per trainable parameter) unless a strategy says otherwise")
    _print_placement(placement)
    return 0


def _print_placement(placement: dict[str, Any]) -> None:
    print('\nbig-model inference: device_map="auto" on this machine (load_checkpoint_and_dispatch)')
    for device, budget in placement["max_memory"].items():
        print(f"  {device:<6} budget {_gib(budget):>11}  placed {_gib(placement['placed'].get(device, 0)):>11}")
    if "disk" in placement["placed"]:
        print(f"  disk   placed {_gib(placement['placed']['disk'])} (needs offload_folder=)")
    entries = list(placement["device_map"].items())
    shown = ", ".join(f"{name or '<model>'}: {device}" for name, device in entries[:8])
    print(f"  map: {shown}" + (f", ... ({len(entries)} entries)" if len(entries) > 8 else ""))
