"""ParallelismConfig.build_device_mesh on 4 gloo processes, torchbay's beside Accelerate's (same sizes, same
process group); writes <out>/mesh_rank<r>.json: per side and per sizes, each dimension's size and the ranks of
this process's group along it (the flattened dp, dp_shard_cp and dp_cp included)."""

import json
import sys
from types import SimpleNamespace

import torch.distributed as dist
from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig

from torchbay.distributed.parallelism_config import ParallelismConfig as TorchbayConfig

CASES = [dict(dp_replicate_size=4), dict(dp_shard_size=4), dict(dp_replicate_size=2, dp_shard_size=2),
         dict(dp_shard_size=2, tp_size=2), dict(dp_shard_size=2, cp_size=2), dict(cp_size=2, tp_size=2)]
FLAT = ("dp", "dp_shard_cp", "dp_cp")


def describe(mesh) -> dict:
    """What a mesh is, in plain values: its dimension names and sizes, and every named dimension's group."""
    names = list(mesh.mesh_dim_names) + [n for n in FLAT if _has(mesh, n)]
    return {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "device": mesh.device_type,
            "groups": {n: sorted(dist.get_process_group_ranks(mesh[n].get_group())) for n in names}}


def _has(mesh, name):
    try:
        mesh[name]
        return True
    except (KeyError, RuntimeError):
        return False


dist.init_process_group("gloo")
results = {}
for sizes in CASES:
    key = ",".join(f"{k}={v}" for k, v in sizes.items())
    # (Accelerate's TorchTensorParallelConfig checks the transformers version; the mesh never reads the handler)
    theirs = AccelerateConfig(tp_handler=SimpleNamespace(), **sizes)
    results[key] = {side: describe(config.build_device_mesh("cpu"))
                    for side, config in (("accelerate", theirs), ("torchbay", TorchbayConfig(**sizes)))}
with open(f"{sys.argv[1]}/mesh_rank{dist.get_rank()}.json", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
