"""Hugging Face Accelerate's own ``save_model`` on the model of tests/checkpoint/test_save_model_layout.py,
run in a subprocess (the real library, without torchbay's switch): one call per
``FOLDER SHARD_SIZE`` pair of the command line, in order (``SHARD_SIZE:bin``: ``safe_serialization=False``)."""
import sys

import torch


def build_model() -> torch.nn.Module:
    """Four 64x64 layers (about 66 KB: 20KB shards give four files) and a tied alias of the first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    model.tied = model[0]  # shared weights: written once, under the first name
    return model


if __name__ == "__main__":
    import accelerate
    from accelerate import Accelerator

    assert "torchbay" not in accelerate.__file__, accelerate.__file__
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(build_model())
    pairs = sys.argv[1:]
    for folder, shard_size in zip(pairs[::2], pairs[1::2]):
        size, _, form = shard_size.partition(":")
        accelerator.save_model(model, folder, max_shard_size=size, safe_serialization=form != "bin")
    print("saved with accelerate", accelerate.__version__)
