"""Accelerate's DeepSpeedPlugin path of torchbay-deepspeed without transformers, in one process (real DeepSpeed on its
CPU accelerator): what transformers' Trainer does with it, done by hand. The script imports ``accelerate``: run it with
TORCHBAY_AS_ACCELERATE=1 for torchbay, without for Accelerate itself (``torchrun --nproc-per-node 1``).

The plugin's config has "auto" values; the Accelerator gets accumulation 1 (as Trainer gives it) while the config says
2; the scheduler's total steps are written into ``plugin.deepspeed_config`` after the Accelerator exists (Trainer's
``deepspeed_init`` does that). Then ``prepare(model, DummyOptim, DummyScheduler, loader)``, 8 micro-batches, the
engine's own ``save_checkpoint`` / ``load_checkpoint`` (as Trainer calls them), and a checkpoint file holding an object
of an arbitrary class, loaded through the engine. Writes ``result_plugin.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import types

import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=8)  # hidden-size "auto" values read it, as for HF models
        self.inp = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class Planted:
    """A class no checkpoint loader should build from a file."""

    def __reduce__(self):
        return (os.system, ("echo planted-code-ran",))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--from-torchbay-config", action="store_true",
                        help="no DeepSpeedPlugin: the JSON is torchbay's deepspeed.deepspeed_config_file and the "
                             "plugin is read from accelerator.state, as Trainer run under torchbay's config does")
    args = parser.parse_args()
    if args.from_torchbay_config:
        from_torchbay_config(args.out)
        return

    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler

    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto",
                                                                "total_num_steps": "auto"}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
              "gradient_accumulation_steps": 2, "gradient_clipping": "auto",
              "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    result: dict = {"user_config_untouched": config["gradient_clipping"] == "auto",
                    "served_by": "torchbay" if "torchbay" in repr(accelerate) else "accelerate"}
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=1)
    result["state_plugin_is_the_users"] = accelerator.state.deepspeed_plugin is plugin
    result["distributed_type"] = str(accelerator.distributed_type)
    result["selected"] = plugin.selected
    plugin.deepspeed_config["scheduler"]["params"]["total_num_steps"] = 7  # after the Accelerator, as Trainer does

    torch.manual_seed(0)
    model = Tiny()
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    optimizer = DummyOptim(model.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=2)
    engine, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    result["engine"] = type(engine).__name__
    result["scheduler_is_wrapper"] = isinstance(scheduler, DeepSpeedSchedulerWrapper)
    result["scheduler"] = type(scheduler.scheduler).__name__
    result["filled"] = plugin.deepspeed_config
    result["engine_ga"] = engine.gradient_accumulation_steps()
    result["checkpoint_loader"] = engine.checkpoint_engine.load.__qualname__
    losses, lrs = [], []
    for step, (x, y) in enumerate(loader):
        accelerator.gradient_state._set_sync_gradients(step % 2 == 1)  # Trainer decides the window itself
        loss = torch.nn.functional.mse_loss(engine(x), y)
        accelerator.backward(loss, scale_wrt_gas=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    result["losses"], result["lrs"] = losses, lrs
    result["global_steps"] = engine.global_steps

    checkpoint = os.path.join(args.out, "checkpoint")
    engine.save_checkpoint(checkpoint)  # as Trainer does
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    path, _ = engine.load_checkpoint(checkpoint, load_optimizer_states=True, load_lr_scheduler_states=True)
    result["loaded"] = path is not None
    result["restored_diff"] = max((p - weights[n]).abs().max().item() for n, p in engine.module.named_parameters())
    tag = open(os.path.join(checkpoint, "latest")).read().strip()
    states = os.path.join(checkpoint, tag, "mp_rank_00_model_states.pt")
    saved = torch.load(states, weights_only=False)  # the test's own file, just written
    saved["planted"] = Planted()
    torch.save(saved, states)
    try:
        engine.load_checkpoint(checkpoint)
        result["planted_error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["planted_error"] = f"{type(exc).__name__}: {exc}"
    accelerator.end_training()
    with open(os.path.join(args.out, "result_plugin.json"), "w") as handle:
        json.dump(result, handle, indent=1, default=str)


def from_torchbay_config(out: str) -> None:
    """strategy deepspeed with a JSON file in torchbay's config; the plugin Trainer reads from the state gets a new
    config object (transformers' propagate_args_to_deepspeed) whose "auto" values it fills before prepare."""
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler, HfDeepSpeedConfig

    path = os.path.join(out, "ds.json")
    with open(path, "w") as handle:
        json.dump({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 3}},
                   "zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}, handle)
    accelerator = Accelerator(config={"strategy": "deepspeed", "deepspeed": {"deepspeed_config_file": path}})
    plugin = accelerator.state.deepspeed_plugin
    result: dict = {"plugin": type(plugin).__name__, "stage": plugin.zero_stage,
                    "config_before": json.loads(json.dumps(plugin.deepspeed_config))}
    plugin.hf_ds_config = HfDeepSpeedConfig(plugin.hf_ds_config.config)  # a new object, as transformers makes
    plugin.deepspeed_config = plugin.hf_ds_config.config
    for key, value in (("optimizer.params.lr", 0.02), ("scheduler.params.warmup_max_lr", 0.02),
                       ("gradient_clipping", 0.7)):
        node, leaf = plugin.hf_ds_config.find_config_node(key)
        node[leaf] = value
    torch.manual_seed(0)
    model = Tiny()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)),
                                         batch_size=4)
    optimizer = DummyOptim(model.parameters())
    loader, engine, optimizer, scheduler = accelerator.prepare(loader, model, optimizer, DummyScheduler(optimizer))
    result["engine_lr"] = engine.optimizer.param_groups[0]["lr"]
    result["engine_clip"] = engine.gradient_clipping()
    result["warmup_max_lr"] = scheduler.scheduler.max_lrs[0]
    accelerator.end_training()
    with open(os.path.join(out, "result_from_config.json"), "w") as handle:
        json.dump(result, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
