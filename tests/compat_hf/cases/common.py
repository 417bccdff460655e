"""What the Hugging Face cases share: a tiny causal LM built from a config (never downloaded), made-up data,
and one JSON result per run (losses and metrics), which tests/compat_hf compares between Accelerate and torchbay."""

from __future__ import annotations

import json
import os
import sys

import torch


def which_accelerate() -> str:
    import accelerate

    return "torchbay" if "torchbay" in repr(accelerate) else "accelerate"


def tiny_causal_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset):
    """``size`` sequences of ``length`` tokens that follow a simple rule (so the loss goes down)."""

    def __init__(self, size: int, length: int = 16, seed: int = 1):
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, 64, (size, 1), generator=generator)
        self.ids = (starts + torch.arange(length)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


class TokenStream(torch.utils.data.IterableDataset):
    """:class:`TokenDataset`'s samples as a stream with no length (what ``datasets``' streaming mode gives)."""

    def __init__(self, size: int, seed: int = 1):
        self.samples = TokenDataset(size, seed=seed)

    def __iter__(self):
        return (self.samples[index] for index in range(len(self.samples)))


def write_result(path: str, **fields) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        fields["served_by"] = which_accelerate()
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(fields, handle, indent=1)
    print(f"[rank {rank}] {fields}", file=sys.stderr)


def tiny_tokenizer():
    """A word-level tokenizer over a 60-word vocabulary, built here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(60)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def counting_text(size: int, seed: int, length: int = 8) -> list[str]:
    """Sentences of consecutive words (w3 w4 w5 ...), so a model can learn them."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 60 - length, (size,), generator=generator).tolist()
    return [" ".join(f"w{s + i}" for i in range(length)) for s in starts]
