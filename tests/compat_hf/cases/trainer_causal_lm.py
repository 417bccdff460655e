"""transformers' Trainer on a tiny Llama: train, evaluate on an uneven last batch, save and resume.

``python trainer_causal_lm.py OUT_DIR RESULT.json [--grad-accum N] [--bf16] [--resume]``; run under `accelerate launch`,
`torchbay launch --as-accelerate` or plain python, with the switch on or off: the script is the same.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import TokenDataset, TokenStream, tiny_causal_lm, write_result  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(round(float(logs["loss"]), 6))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("result")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--resume", action="store_true", help="train 4 steps, save, then resume to the end")
    parser.add_argument("--fsdp", action="store_true", help="TrainingArguments(fsdp=...): FSDP2, full shard")
    parser.add_argument("--fsdp-sharded", action="store_true",
                        help="with --fsdp: fsdp_config state_dict_type SHARDED_STATE_DICT (DCP checkpoints)")
    parser.add_argument("--deepspeed", metavar="JSON", help="TrainingArguments(deepspeed=JSON)")
    parser.add_argument("--best", action="store_true",
                        help="evaluate every 4 steps, keep the best checkpoint, report to TensorBoard")
    parser.add_argument("--streaming", action="store_true",
                        help="iterable datasets (no length): train 5 steps, evaluate and predict 66 samples")
    parser.add_argument("--auto-batch", action="store_true",
                        help="auto_find_batch_size: the first batch size runs out of memory, the retry trains")
    args = parser.parse_args()
    training = dict(output_dir=args.out_dir, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                    gradient_accumulation_steps=args.grad_accum, num_train_epochs=2, learning_rate=1e-3,
                    logging_steps=1, save_strategy="steps", save_steps=4, report_to=[], seed=7, bf16=args.bf16,
                    use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, eval_strategy="no")
    if args.best:
        training.update(eval_strategy="steps", eval_steps=4, load_best_model_at_end=True, metric_for_best_model="loss",
                        save_total_limit=2, report_to=["tensorboard"])
    if args.fsdp:
        training.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2,
                                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
        if args.fsdp_sharded:
            training["fsdp_config"]["state_dict_type"] = "SHARDED_STATE_DICT"
    if args.deepspeed:
        training.update(deepspeed=args.deepspeed)  # use_cpu kept: else Accelerate's state counts 1 CPU process
    if args.streaming:
        run_streaming(training)
        return
    if args.auto_batch:
        run_auto_batch(training)
        return
    log = LossLog()
    trainer = Trainer(model=tiny_causal_lm(), args=TrainingArguments(**training), train_dataset=TokenDataset(40),
                      eval_dataset=TokenDataset(66, seed=2), callbacks=[log])
    if args.resume:
        trainer.train()
        first = list(log.losses)
        checkpoint = os.path.join(args.out_dir, "checkpoint-4")
        log.losses.clear()
        trainer = Trainer(model=tiny_causal_lm(seed=3), args=TrainingArguments(**training),
                          train_dataset=TokenDataset(40), eval_dataset=TokenDataset(66, seed=2), callbacks=[log])
        trainer.train(resume_from_checkpoint=checkpoint)
        resumed = list(log.losses)
        metrics = trainer.evaluate()
        write_result(args.result, losses=first, resumed_losses=resumed, eval_loss=round(metrics["eval_loss"], 6))
        return
    trainer.train()
    metrics = trainer.evaluate()
    predictions = trainer.predict(TokenDataset(66, seed=2))
    extra = {}
    if args.best:
        evals = [round(e["eval_loss"], 6) for e in trainer.state.log_history if "eval_loss" in e]
        extra = {"eval_losses": evals, "best_checkpoint": os.path.basename(trainer.state.best_model_checkpoint or ""),
                 "checkpoints_kept": sorted(n for n in os.listdir(args.out_dir) if n.startswith("checkpoint-")),
                 "tensorboard_files": int(any(n.startswith("events.out.tfevents") for _, _, files in
                                              os.walk(args.out_dir) for n in files))}
    write_result(args.result, losses=log.losses, eval_loss=round(metrics["eval_loss"], 6),
                 predict_rows=int(predictions.predictions.shape[0]), **extra)


def run_streaming(training: dict) -> None:
    """Streaming data: Trainer needs max_steps; the evaluation's last batch is uneven (66 samples, 8 a process)."""
    log = LossLog()
    trainer = Trainer(model=tiny_causal_lm(), args=TrainingArguments(**{**training, "max_steps": 5}),
                      train_dataset=TokenStream(40), eval_dataset=TokenStream(66, seed=2), callbacks=[log])
    trainer.train()
    metrics = trainer.evaluate()
    predictions = trainer.predict(TokenStream(66, seed=2))
    write_result(sys.argv[2], losses=log.losses, eval_loss=round(metrics["eval_loss"], 6),
                 predict_rows=int(predictions.predictions.shape[0]),
                 predict_loss=round(float(predictions.metrics["test_loss"]), 6))


class OutOfMemoryAbove(TrainerCallback):
    """Fails a step whose batch holds more than ``limit`` samples with the CPU allocator's out-of-memory error, as a
    too large batch does: Trainer's auto_find_batch_size then retries with a smaller batch."""

    def __init__(self, limit: int):
        self.limit = limit
        self.sizes: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        size = args.per_device_train_batch_size if not hasattr(state, "train_batch_size") else \
            (state.train_batch_size or args.per_device_train_batch_size)
        if not self.sizes or self.sizes[-1] != size:
            self.sizes.append(size)
        if size > self.limit:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")


def run_auto_batch(training: dict) -> None:
    log, memory = LossLog(), OutOfMemoryAbove(limit=3)
    trainer = Trainer(model=tiny_causal_lm(), args=TrainingArguments(**{**training, "auto_find_batch_size": True,
                                                                        "save_strategy": "no"}),
                      train_dataset=TokenDataset(40), callbacks=[log, memory])
    trainer.train()
    write_result(sys.argv[2], losses=log.losses, batch_sizes_tried=memory.sizes)


if __name__ == "__main__":
    main()
