"""Worker (2 processes): ZeRO-3 student/teacher training with models built under zero.Init,
prepared in separate calls; save_state mid-run, then a fresh Accelerator load_state's it and
must continue exactly as the uninterrupted run; save_model must write the gathered weights.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed_common import BATCH, Net, dataset, init_group, write  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--resume-elsewhere", action="store_true",
                    help="one process: load the 2-process checkpoint (universal checkpoint)")
args = parser.parse_args()
if not args.resume_elsewhere:
    init_group()
MICRO, SAVE_AT, GA = 8, 4, 2
CKPT = os.path.join(args.out, f"state_zero{args.stage}")


def build(teacher_seed: int, stage: int = args.stage, **section):
    from torchbay import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator(strategy="deepspeed", gradient_accumulation_steps=GA, config={"deepspeed": {
        "zero_stage": stage, "zero3_init": stage == 3, **section,
        "config": {"zero_optimization": {"stage3_param_persistence_threshold": "auto",
                                         "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"}}
        if stage == 3 else {}}})
    with acc.strategy.zero_init():
        torch.manual_seed(0)
        student = Net()
        torch.manual_seed(teacher_seed)
        teacher = Net(width=16).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    torch.manual_seed(0)  # the loader's shuffle seed comes from torch.initial_seed()
    # separate prepare calls, the optimizer after its model, the data loader last
    student = acc.prepare(student)
    opt = acc.prepare(opt)
    teacher = acc.prepare(teacher)
    loader = acc.prepare(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    return acc, student, teacher, opt, loader


def step(acc, student, teacher, opt, x, y):
    with acc.accumulate(student):
        with torch.no_grad():
            target = teacher(x)
        out = student(x)
        loss = nn.functional.mse_loss(out, y) + 0.5 * nn.functional.mse_loss(out, target)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return acc.gather(loss.detach()[None]).mean().item()


def gathered(acc, model):
    """Every full parameter, gathered with DeepSpeed's GatheredParameters (ZeRO-3) on all ranks."""
    import deepspeed

    inner = acc.unwrap_model(model)
    params = dict(inner.named_parameters())
    if args.stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: v.detach().clone() for k, v in params.items()}
    return {k: v.detach().clone() for k, v in params.items()}


if args.resume_elsewhere:
    from safetensors.torch import load_file

    from torchbay.errors import CheckpointError

    out = {}
    acc, student, teacher, opt, loader = build(teacher_seed=7)
    try:
        acc.load_state(CKPT)
        out["plain_error"] = ""
    except CheckpointError as exc:
        out["plain_error"] = str(exc)
    acc.end_training()
    acc, student, teacher, opt, loader = build(teacher_seed=7, load_universal=True)
    acc.load_state(CKPT)
    expected = load_file(os.path.join(args.out, f"at_save_zero{args.stage}.safetensors"))
    got = gathered(acc, student)
    out["student_vs_saved"] = max((got[k] - expected[k]).abs().max().item() for k in expected)
    out["world_size"] = acc.num_processes
    out["losses"] = [step(acc, student, teacher, opt, x, y) for _, (x, y) in zip(range(2), loader)]
    out["engine_dir_after_load"] = sorted(os.listdir(os.path.join(CKPT, "deepspeed_model_0")))
    out["beside_checkpoint"] = sorted(os.listdir(os.path.dirname(CKPT)))
    acc.end_training()
    with open(os.path.join(args.out, f"result_universal_zero{args.stage}.json"), "w") as f:
        import json

        json.dump(out, f)
    sys.exit(0)

result = {}
acc, student, teacher, opt, loader = build(teacher_seed=1)
initial_student, initial_teacher = gathered(acc, student), gathered(acc, teacher)
losses, batches = [], []
for i, (x, y) in enumerate(loader):
    losses.append(step(acc, student, teacher, opt, x, y))
    if i + 1 == SAVE_AT:
        import logging

        warned: list[str] = []
        logging.getLogger("torchbay").addFilter(lambda record: warned.append(record.getMessage()) or True)
        handle = acc.save_state(CKPT, blocking=False)  # DeepSpeed: synchronous, with the one-line warning
        result["async_done_at_return"] = handle.done() and handle.wait() == CKPT
        result["async_warnings"] = [m for m in warned if "saves synchronously here" in m]
        at_save = gathered(acc, student)
        if acc.is_main_process:
            from safetensors.torch import save_file

            save_file(at_save, os.path.join(args.out, f"at_save_zero{args.stage}.safetensors"))
    if i + 1 > SAVE_AT:
        batches.append(float(x.sum()))
    if i + 1 == MICRO:
        break
result["losses"] = losses
result["report"] = [r.report for r in acc.strategy.records]
result["engines"] = len(acc.strategy.records)
result["trains"] = [r.trains for r in acc.strategy.records]
raw = acc.unwrap_model(student).state_dict()
result["raw_state_numel"] = sum(v.numel() for v in raw.values())
full = gathered(acc, student)
result["param_numel"] = sum(v.numel() for v in full.values())
model_dir = os.path.join(args.out, f"model_zero{args.stage}")
acc.save_model(student, model_dir)
teacher_full = gathered(acc, teacher)
result["student_moved"] = max((full[k] - initial_student[k]).abs().max().item() for k in full)
result["teacher_moved"] = max((teacher_full[k] - initial_teacher[k]).abs().max().item() for k in teacher_full)
state_dict = acc.get_state_dict(student)
if acc.is_main_process:
    from safetensors.torch import load_file

    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    plain = Net()
    missing = plain.load_state_dict(saved, strict=True)
    result["saved_numel"] = sum(v.numel() for v in saved.values())
    result["saved_vs_gathered"] = max((saved[k] - full[k]).abs().max().item() for k in full)
    result["state_dict_vs_gathered"] = max((state_dict[k] - full[k]).abs().max().item() for k in full)
    result["empty_saved"] = [k for k, v in saved.items() if v.numel() == 0]
    result["files"] = sorted(os.listdir(CKPT))
    result["ds_files"] = sorted(os.listdir(os.path.join(CKPT, "deepspeed_model_0", "ds")))
acc.end_training()

# resume in fresh objects (the teacher built from another seed: load_state must restore it)
acc, student, teacher, opt, loader = build(teacher_seed=7)
before = gathered(acc, teacher)
result["teacher_differs_before_load"] = max((before[k] - teacher_full[k]).abs().max().item() for k in before)
acc.load_state(CKPT)
after = gathered(acc, teacher)
result["teacher_after_load"] = max((after[k] - teacher_full[k]).abs().max().item() for k in after)
result["student_after_load"] = max((v - at_save[k]).abs().max().item() for k, v in gathered(acc, student).items())
resumed, resumed_batches = [], []
for x, y in acc.skip_first_batches(loader, SAVE_AT):
    resumed_batches.append(float(x.sum()))
    resumed.append(step(acc, student, teacher, opt, x, y))
    if len(resumed) == MICRO - SAVE_AT:
        break
result["resumed_losses"] = resumed
result["batches_match"] = resumed_batches == batches
final = gathered(acc, student)
result["final_vs_uninterrupted"] = max((final[k] - full[k]).abs().max().item() for k in full)
acc.end_training()
write(os.path.join(args.out, f"result_state_zero{args.stage}.json"), result)
dist.destroy_process_group()
