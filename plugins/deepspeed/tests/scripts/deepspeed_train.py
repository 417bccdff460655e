"""Worker (2 processes): DDP against DeepSpeed ZeRO-1/2/3 with and without gradient
accumulation, ZeRO-2 with optimizer offload, a DeepSpeed JSON with "auto" values against
the same settings in torchbay's config, and DeepSpeed's own optimizer/scheduler from JSON.
One launch; every run shares the process group the script starts."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch.distributed as dist  # noqa: E402
from deepspeed_common import init_group, train, write  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
init_group()
K = 8          # micro-batches per run
CLIP = 0.5
result = {}
t0 = time.perf_counter()
for ga in (1, 2):
    result[f"ddp_ga{ga}"] = train("ddp", ga, K, clip=CLIP)
    for stage in (0, 1, 2, 3):
        cfg = {"deepspeed": {"zero_stage": stage, "gradient_clipping": CLIP}}
        if stage == 3:  # partition even these small tensors
            cfg["deepspeed"]["config"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        result[f"zero{stage}_ga{ga}"] = train("deepspeed", ga, K, cfg, clip=CLIP)
result["zero2_offload_ga2"] = train("deepspeed", 2, K, {"deepspeed": {
    "zero_stage": 2, "gradient_clipping": CLIP, "offload_optimizer_device": "cpu"}}, clip=CLIP)

# the same ZeRO-2 run from a DeepSpeed JSON whose values are "auto"
json_path = os.path.join(args.out, "ds_auto.json")
if dist.get_rank() == 0:
    with open(json_path, "w") as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                   "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                   "zero_optimization": {"stage": 2}}, f)
dist.barrier()
result["json_auto_ga2"] = train("deepspeed", 2, K, {"deepspeed": {"deepspeed_config_file": json_path,
                                                                 "gradient_clipping": CLIP}}, clip=CLIP)
result["section_ga2"] = train("deepspeed", 2, K, {"deepspeed": {"zero_stage": 2, "gradient_clipping": CLIP}},
                              clip=CLIP)

# DeepSpeed's own optimizer and scheduler, from the JSON, with "auto" params
json_opt = os.path.join(args.out, "ds_opt.json")
if dist.get_rank() == 0:
    with open(json_opt, "w") as f:
        json.dump({"zero_optimization": {"stage": 2},
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto"}}}, f)
dist.barrier()
result["json_optimizer"] = train("deepspeed", 1, K, {"deepspeed": {"deepspeed_config_file": json_opt}},
                                 json_optimizer=True)
# torchbay's mixed_precision becomes DeepSpeed's bf16 section (bf16 weights, fp32 master copy)
result["zero2_bf16"] = train("deepspeed", 1, K, {"mixed_precision": "bf16", "deepspeed": {
    "zero_stage": 2, "gradient_clipping": CLIP}}, clip=CLIP)
result["elapsed_s"] = time.perf_counter() - t0
write(os.path.join(args.out, "result_train.json"), result)
dist.destroy_process_group()
