"""Worker (2 processes, .venv-hf): a tiny Hugging Face Llama (LlamaForCausalLM, built locally from a config)
at pp 2 with 1F1B against the same model in one process. Writes ``result_hf.json`` (rank 0): losses, the
reference's, the largest weight difference and each rank's parameter names."""

from __future__ import annotations

import os
import sys

import torch
from parallel_common import write_json
from transformers import LlamaConfig, LlamaForCausalLM

from torchbay import Accelerator, ParallelismConfig

VOCAB, BATCH, SEQ, STEPS, LR = 64, 4, 8, 3, 1e-2


def make_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config)


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batches():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)


def reference():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in batches():
        loss = loss_fn(model(tokens[:, :-1]).logits, tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main():
    out = sys.argv[sys.argv.index("--out") + 1]
    ref_losses, ref_state = reference()
    acc = Accelerator(strategy="fsdp", seed=0,
                      parallelism_config=ParallelismConfig(pp_size=2, pp_schedule="1F1B", pp_microbatches=2))
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    losses = []
    for tokens in batches():
        loss = acc.pipeline_loss(model, tokens[:, :-1], tokens[:, 1:], loss_fn)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    names = acc.strategy.all_gather_object(sorted(n for n, _ in model.named_parameters()))
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) if set(state) == set(
            ref_state) else float("inf")
        write_json(os.path.join(out, "result_hf.json"), {"losses": losses, "reference_losses": ref_losses,
                                                         "weights_max_diff": diff, "names": names})
    acc.end_training()


if __name__ == "__main__":
    main()
