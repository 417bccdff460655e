"""peft LoRA on a tiny causal LM through transformers' Trainer; the adapter saved, reloaded, and its logits compared.

``python peft_lora.py OUT_DIR RESULT.json``
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from common import TokenDataset, tiny_causal_lm, write_result  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402


def main() -> None:
    out_dir, result = sys.argv[1:3]
    model = get_peft_model(tiny_causal_lm(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0, task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                             num_train_epochs=2, learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to=[],
                             seed=7, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(40), eval_dataset=TokenDataset(66, seed=2))
    output = trainer.train()
    metrics = trainer.evaluate()
    losses = [round(e["loss"], 6) for e in trainer.state.log_history if "loss" in e]
    adapter_dir = os.path.join(out_dir, "adapter")
    trainer.save_model(adapter_dir)
    trainer.accelerator.wait_for_everyone()  # the main process writes it; every rank reads it back below
    probe = TokenDataset(4, seed=5).ids
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=probe).logits
        reloaded = PeftModel.from_pretrained(tiny_causal_lm(), adapter_dir).eval()(input_ids=probe).logits
    write_result(result, losses=losses, train_loss=round(output.training_loss, 6),
                 eval_loss=round(metrics["eval_loss"], 6), reload_max_diff=float((trained - reloaded).abs().max()),
                 saved=sorted(os.listdir(adapter_dir)))


if __name__ == "__main__":
    main()
