"""Worker: transformers' Trainer, then trl's SFTTrainer, on a tiny Llama (a local config, no download) with
Accelerate's ``sp_size`` spelling, under torchbay's switch (``TORCHBAY_AS_ACCELERATE=1``).

``python ulysses_trainer.py OUT --sp N``: 1 process with ``--sp 1`` (the unsharded reference), N processes under
torchrun otherwise, where ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N,
sp_backend="deepspeed"))`` (no ``fsdp=``: strategy auto selects the strategy that builds sp, torchbay's fsdp)
runs its Ulysses. Trainer: 2 epochs of 8
batches of 2 with gradient accumulation 2 and rows whose labelled tokens differ (num_items_in_batch, the linear
learning-rate schedule and the epoch count all depend on counting right). Writes ``OUT/result_sp<N>.json``
(per trainer: the logged losses and learning rates, the optimizer steps, the epoch; Trainer's evaluation loss)
and ``OUT/weights_sp<N>.pt`` (the Trainer's trained weights), rank 0. SFTTrainer runs in fp32 (``bf16=False``:
its default bf16 rounds differently under FSDP's parameter cast than under the single process's autocast).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB, SEQ, SAMPLES = 64, 8, 16


class Tokens(torch.utils.data.Dataset):
    """Rows with ignored labels at unequal places: the sp ranks' halves hold unequal label counts."""

    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[::2, -3:] = -100
        self.labels[1::4, :2] = -100

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def tokenizer():
    """A word-level tokenizer over the model's vocabulary, built here (trl's SFTTrainer needs one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
                                   pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def summary(trainer, log) -> dict:
    return {"losses": log.losses, "lrs": log.lrs, "steps": trainer.state.global_step, "epoch": trainer.state.epoch,
            "attn": trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation}


def main() -> None:
    from accelerate import ParallelismConfig
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sp", type=int, default=1)
    args = parser.parse_args()

    class Log(TrainerCallback):
        def __init__(self):
            self.losses, self.lrs = [], []

        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.lrs.append(float(logs["learning_rate"]))

    training = dict(output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_train_epochs=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                    seed=7, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, eval_strategy="no")
    if args.sp > 1:
        # no fsdp=...: strategy auto selects the strategy that builds sp (torchbay's fsdp)
        training["parallelism_config"] = ParallelismConfig(sp_size=args.sp, sp_backend="deepspeed")
    log = Log()
    trainer = Trainer(model=model(), args=TrainingArguments(**training), train_dataset=Tokens(), callbacks=[log])
    trainer.train()
    result = {"trainer": {**summary(trainer, log), "eval_loss": trainer.evaluate(Tokens())["eval_loss"]}}
    state = trainer.accelerator.get_state_dict(trainer.model)

    # trl's SFTTrainer (it turns on its collator's position ids under sp): pre-tokenized rows of SEQ tokens
    log = Log()
    rows = Dataset.from_dict({"input_ids": Tokens().ids.tolist()})
    sft = SFTTrainer(model=model(), args=SFTConfig(**training, max_length=SEQ, bf16=False), train_dataset=rows,
                     processing_class=tokenizer(), callbacks=[log])
    sft.train()
    result["sft"] = summary(sft, log)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, os.path.join(args.out, f"weights_sp{args.sp}.pt"))
        with open(os.path.join(args.out, f"result_sp{args.sp}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
