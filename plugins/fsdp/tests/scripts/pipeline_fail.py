"""Worker (``torchbay launch``, 2 processes, pp 2): the rank holding the last stage raises inside the
schedule (in the loss function) at the second step; the other waits for its activations' gradients."""

from __future__ import annotations

import torch
from pipeline_common import GLOBAL_BATCH, LR, dataset, loss_fn, make_model

from torchbay import Accelerator, ParallelismConfig

STEP = [0]


def failing_loss(logits, target):
    if STEP[0] == 1:
        raise ValueError("deliberate failure inside the pipeline schedule")
    return loss_fn(logits, target)


def main():
    acc = Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=2))
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    tokens = dataset(3).tensors[1]
    for step in range(3):
        STEP[0] = step
        batch = tokens[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        acc.backward(acc.pipeline_loss(model, batch[:, :-1], batch[:, 1:], failing_loss))
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
