"""The FSDP asynchronous save's host staging (torchbay_fsdp.async_checkpoint.ShardStaging) on its own: a DTensor's and a
ShardedTensor's local shards are copied into buffers kept from one save to the next, the copies keep their sharding.
One gloo process in a subprocess (a real process group, no mocks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed.tensor import DTensor, Replicate, Shard as DShard, distribute_tensor, init_device_mesh
    from torchbay_fsdp.async_checkpoint import ShardStaging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    weight = distribute_tensor(torch.randn(6, 4), mesh, [DShard(0)])
    bias = distribute_tensor(torch.randn(4), mesh, [Replicate()])
    meta = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[3, 2], placement="rank:0/cpu")
    sharded = ShardedTensor._init_from_local_shards([Shard(torch.randn(3, 2), meta)], 3, 2)
    state = {"w": weight, "b": bias, "s": sharded, "step": torch.tensor(3.0), "lr": 0.1}

    def stage():
        buffer = stage.buffer
        buffer.begin()
        out = buffer.copy(state, "model")
        buffer.finish(lambda: None)
        return out

    stage.buffer = ShardStaging(pin_memory=True)  # on cpu tensors: plain memory (nothing to pin for)
    first = stage()
    assert isinstance(first["w"], DTensor) and first["w"].placements == weight.placements
    assert first["w"].device_mesh == mesh and first["w"].shape == weight.shape and not first["w"].requires_grad
    assert torch.equal(first["w"].to_local(), weight.to_local())
    assert first["w"].to_local().data_ptr() != weight.to_local().data_ptr()  # a copy, never the live shard
    assert isinstance(first["s"], ShardedTensor) and first["s"].metadata() == sharded.metadata()
    assert torch.equal(first["s"].local_shards()[0].tensor, sharded.local_shards()[0].tensor)
    assert first["s"].local_shards()[0].tensor.data_ptr() != sharded.local_shards()[0].tensor.data_ptr()
    assert first["lr"] == 0.1 and torch.equal(first["step"], state["step"])
    ptrs = {k: v.to_local().data_ptr() if isinstance(v, DTensor) else v.local_shards()[0].tensor.data_ptr()
            for k, v in first.items() if k in ("w", "b", "s")}
    nbytes = stage.buffer.nbytes()
    with torch.no_grad():  # training changes every shard
        weight.to_local().add_(1)
        sharded.local_shards()[0].tensor.add_(1)
    second = stage()
    assert {k: v.to_local().data_ptr() if isinstance(v, DTensor) else v.local_shards()[0].tensor.data_ptr()
            for k, v in second.items() if k in ("w", "b", "s")} == ptrs  # the same memory, refreshed
    assert stage.buffer.nbytes() == nbytes
    assert torch.equal(second["w"].to_local(), weight.to_local())
    assert torch.equal(second["s"].local_shards()[0].tensor, sharded.local_shards()[0].tensor)
    dist.destroy_process_group()
    print("ok")
""")


def test_shard_staging_reuses_its_buffers_and_keeps_the_sharding(tmp_path):
    pytest.importorskip("torchbay_fsdp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PORT": str(port)}, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
