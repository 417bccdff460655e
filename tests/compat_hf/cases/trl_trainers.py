"""trl's SFTTrainer and DPOTrainer on a tiny Llama with a tokenizer built here (no download).

``python trl_trainers.py sft|dpo OUT_DIR RESULT.json``
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import counting_text, tiny_causal_lm, tiny_tokenizer, write_result  # noqa: E402
from datasets import Dataset  # noqa: E402

COMMON = dict(per_device_train_batch_size=4, num_train_epochs=1, learning_rate=1e-3, logging_steps=1,
              save_strategy="no", report_to=[], seed=7, use_cpu=True, disable_tqdm=True)


def sft(out_dir: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": counting_text(32, seed=1)})
    trainer = SFTTrainer(model=tiny_causal_lm(), args=SFTConfig(output_dir=out_dir, max_length=16, **COMMON),
                         train_dataset=data, processing_class=tiny_tokenizer())
    trainer.train()
    return {"losses": [round(e["loss"], 6) for e in trainer.state.log_history if "loss" in e]}


def dpo(out_dir: str) -> dict:
    from trl import DPOConfig, DPOTrainer

    prompts = counting_text(24, seed=3, length=4)
    chosen = [" " + " ".join(f"w{int(p.split()[-1][1:]) + i}" for i in range(1, 4)) for p in prompts]
    rejected = [" w0 w0 w0" for _ in prompts]
    data = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    trainer = DPOTrainer(model=tiny_causal_lm(), ref_model=tiny_causal_lm(),
                         args=DPOConfig(output_dir=out_dir, max_length=16, beta=0.1, **COMMON),
                         train_dataset=data, processing_class=tiny_tokenizer())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"losses": [round(e["loss"], 6) for e in logs],
            "reward_margins": [round(e.get("rewards/margins", 0.0), 6) for e in logs]}


def main() -> None:
    which, out_dir, result = sys.argv[1:4]
    write_result(result, **{"sft": sft, "dpo": dpo}[which](out_dir))


if __name__ == "__main__":
    main()
