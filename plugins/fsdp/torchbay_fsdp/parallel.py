"""The N-D device mesh of ``strategy: fsdp``: sizes from the ``parallelism`` section, checks
before any process group, and one named ``DeviceMesh`` built on the selected device.

Mesh dimensions, outermost first: ``pp`` (pipeline stages), ``dp_replicate``, ``dp_shard``, ``cp``, ``sp``,
``tp`` (only those of size > 1; a one-process run, or a pipeline without data parallel, has ``dp_shard``
of size 1). Flattened, as Accelerate builds them:
``dp`` (dp_replicate x dp_shard: ranks that read different data), ``dp_shard_cp`` (what
FSDP shards over), ``dp_cp`` (what the loss is averaged over). The ranks of an ``sp`` group hold the
same weights and split the sequence, as those of ``cp`` do: ``sp`` joins ``dp_shard_cp`` and ``dp_cp``
(cp and sp are never both on).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from torchbay.plugin import MESH_ORDER, check_pipeline
from torchbay_fsdp.experts.checks import check_expert_parallel
from torchbay_fsdp.tensor_parallel import check_styles
from torchbay_fsdp.ulysses.checks import check_sequence_parallel

WHERE = "parallelism"


def sizes_of(section: Any, world_size: int) -> dict[str, int]:
    """Each dimension's size; all 1 means FSDP over every process (``dp_shard`` = world size), and with
    ``pp_size`` alone, over the processes of each stage (``dp_shard`` = world size / pp_size)."""
    sizes = {name: int(getattr(section, f"{name}_size", 1) or 1) for name in MESH_ORDER}
    if all(size == 1 for name, size in sizes.items() if name != "pp"):
        sizes["dp_shard"] = max(world_size // sizes["pp"], 1)
    return sizes


def check(config: Any, world_size: int, device_type: str) -> list[str]:
    """Problems with the ``parallelism`` section for ``strategy: fsdp`` (no process group, no model)."""
    section = getattr(config, WHERE)
    explicit = any(getattr(section, f"{n}_size") > 1 for n in MESH_ORDER if n != "pp")
    sizes = sizes_of(section, world_size)
    problems: list[str] = []  # that the sizes multiply to the world size: Strategy.check_parallel_dims
    s = config.fsdp
    if explicit and sizes["dp_shard"] == 1 and sizes["cp"] == 1 and sizes["sp"] == 1 and sizes["pp"] == 1:
        problems.append(f"{WHERE}: strategy fsdp shards over dp_shard x cp, but dp_shard_size and cp_size are both 1 "
                        f"({' x '.join(f'{n}_size {v}' for n, v in sizes.items() if v > 1)}); set dp_shard_size > 1"
                        + (" (use strategy: ddp for replicas only)" if sizes["dp_replicate"] > 1 else ""))
    if s.version == 1 and (sizes["dp_replicate"] > 1 or sizes["tp"] > 1 or sizes["cp"] > 1 or sizes["sp"] > 1):
        problems.append(f"{WHERE}: dp_replicate/tp/cp/sp sizes > 1 need fsdp.version 2 (fully_shard on a DeviceMesh); "
                        f"FullyShardedDataParallel (version 1) shards over one process group")
    if sizes["cp"] > 1 and device_type == "cpu":
        problems.append(f"{WHERE}.cp_size {sizes['cp']}: context parallel is unavailable on device 'cpu' (torch "
                        f"{_torch_version()} has no CPU sharding rule for scaled_dot_product_attention); use an "
                        f"accelerator's device plugin, or set cp_size 1")
    if section.tp_plan and sizes["tp"] == 1:
        problems.append(f"{WHERE}.tp_plan is set but {WHERE}.tp_size is 1, so no layer would be split; set tp_size "
                        f"or remove tp_plan")
    if sizes["tp"] > 1 and s.cpu_ram_efficient_loading:
        problems.append(f"fsdp.cpu_ram_efficient_loading with {WHERE}.tp_size {sizes['tp']} is not supported; build "
                        f"the model on every rank (set cpu_ram_efficient_loading: false)")
    problems += check_styles(section.tp_plan, f"{WHERE}.tp_plan")
    problems += check_sequence_parallel(section, sizes)
    problems += check_expert_parallel(section, sizes)
    problems += check_pipeline(sizes["pp"], section.pp_schedule, section.pp_microbatches, section.pp_virtual_stages,
                               WHERE)
    if sizes["pp"] > 1 and world_size % sizes["pp"]:
        problems.append(f"{WHERE}.pp_size {sizes['pp']} does not divide the {world_size} processes; launch a multiple "
                        f"of pp_size processes")
    return problems


def _torch_version() -> str:
    return torch.__version__.split("+")[0]


def mesh_dims(sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh's own dimensions: those of size > 1, in mesh order (``dp_shard`` of one process alone)."""
    pipeline = sizes.get("pp", 1) > 1  # FSDP shards each stage over dp_shard, even of size 1
    return tuple(n for n in MESH_ORDER if sizes[n] > 1 or (pipeline and n == "dp_shard")) or ("dp_shard",)


def flattened(sizes: dict[str, int]) -> dict[str, list[str]]:
    """The flattened dimensions and the dimensions each joins (only those with a dimension to join)."""
    enabled = set(mesh_dims(sizes))
    out = {"dp": [n for n in ("dp_replicate", "dp_shard") if n in enabled],
           "dp_shard_cp": [n for n in ("dp_shard", "cp", "sp") if n in enabled],
           "dp_cp": [n for n in ("dp_replicate", "dp_shard", "cp", "sp") if n in enabled]}
    return {name: dims for name, dims in out.items() if dims}


def build_mesh(device_type: str, sizes: dict[str, int]):
    """One named mesh on ``device_type`` (the selected device plugin's torch type), and its
    flattened dimensions by name (torch asks callers to keep those rather than slice them
    from the root mesh again)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = mesh_dims(sizes)
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    flat = {name: sub_mesh(mesh, dims)._flatten(name) for name, dims in flattened(sizes).items()}
    return mesh, flat


def sub_mesh(mesh: Any, names: list[str] | tuple[str, ...]):
    """``mesh[names]`` (one name or several), without torch's slicing warning."""
    with warnings.catch_warnings():  # slicing by a flattened name warns in torch 2.13 (still supported)
        warnings.simplefilter("ignore")
        return mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]
