"""Probe (not a test): does DeepSpeed's DecoupledCheckpointEngine take the state at the call? One process, CPU,
gloo: ``python plugins/deepspeed/tests/scripts/decoupled_engine_probe.py OUT_DIR``. Findings in
docs/checkpoint-guarantees.md, section 6 (DeepSpeed)."""

import multiprocessing
import os
import sys

# CROSS_*: only DeepSpeed's own launcher sets them; DeepSpeed 0.19.8 reads them when checkpoint.writer is set
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29561", CROSS_SIZE="1", CROSS_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402

if __name__ == "__main__":
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    print("start method before:", multiprocessing.get_start_method(allow_none=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # without data_parallel: AttributeError 'UniversalParallelInfo' object has no attribute 'dp_rank' (0.19.8)
    cfg = {"train_batch_size": 1,
           "checkpoint": {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    print("engine:", engine.checkpoint_engine.name, "| start method after:", multiprocessing.get_start_method())
    engine.backward(engine(torch.randn(1, 2048)).pow(2).mean())
    engine.step()
    at_call = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.save_checkpoint(out, tag="t", save_latest=False)
    print("after save_checkpoint: the live weight is in shared memory:", engine.module[0].weight.is_shared())
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)  # the live tensors change while the checkpoint process writes
    engine._commit_decoupled_checkpoint()
    saved = torch.load(os.path.join(out, "t", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    print("file == state at the call:", all(torch.equal(saved[k], at_call[k]) for k in at_call),
          "| file == state after the change:",
          all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items()))
    engine.destroy()
