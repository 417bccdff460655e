"""trl's own command line, `trl sft ...`, which starts its training script through `accelerate launch`
(on torchbay: `torchbay launch --as-accelerate`), on a tiny model and dataset saved here first.

``python trl_cli.py OUT_DIR RESULT.json [launch args...]``
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import counting_text, tiny_causal_lm, tiny_tokenizer, write_result  # noqa: E402


def main() -> None:
    out_dir, result, *launch_args = sys.argv[1:]
    model_dir, data_dir = os.path.join(out_dir, "model"), os.path.join(out_dir, "data")
    tiny_causal_lm().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "train.jsonl"), "w", encoding="utf-8") as handle:
        for text in counting_text(32, seed=1):
            handle.write(json.dumps({"text": text}) + "\n")
    trl = os.path.join(os.path.dirname(sys.executable), "trl")
    run_dir = os.path.join(out_dir, "run")
    subprocess.run([trl, "sft", "--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", run_dir,
                    "--per_device_train_batch_size", "4", "--num_train_epochs", "1", "--learning_rate", "1e-3",
                    "--logging_steps", "1", "--save_strategy", "epoch", "--report_to", "none", "--seed", "7",
                    "--max_length", "16", "--use_cpu", "True", "--disable_tqdm", "True", *launch_args], check=True)
    checkpoint = max((n for n in os.listdir(run_dir) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))
    state = json.load(open(os.path.join(run_dir, checkpoint, "trainer_state.json"), encoding="utf-8"))
    losses = [round(e["loss"], 6) for e in state["log_history"] if "loss" in e]
    write_result(result, losses=losses, saved=sorted(n for n in os.listdir(run_dir) if n.endswith(".safetensors")))


if __name__ == "__main__":
    main()
