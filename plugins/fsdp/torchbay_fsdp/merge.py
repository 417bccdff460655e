"""``torchbay merge-weights CHECKPOINT_DIR OUTPUT_DIR``: a sharded fsdp checkpoint -> one safetensors model.

Runs offline in one process, with no process group: torch.distributed.checkpoint reads
every rank's shards and assembles full tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchbay.errors import CheckpointError
from torchbay.plugin import dcp_load_full, publish_model
from torchbay_fsdp.layout import INFO_FILE, model_dir


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "merge-weights", help="merge a sharded fsdp checkpoint (save_state) into one safetensors model",
        description="Merge the model shards of an fsdp save_state directory (or of one DCP directory) into "
                    "safetensors files that load into the plain model.")
    parser.add_argument("checkpoint_dir", help="a save_state directory, or one fsdp_model_<i> DCP directory")
    parser.add_argument("output_dir", help="where model.safetensors (or its shards and index) are written")
    parser.add_argument("--model-index", type=int, default=0, help="which prepared model (default 0)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    written = merge_weights(args.checkpoint_dir, args.output_dir, model_index=args.model_index,
                            max_shard_size=args.max_shard_size)
    print(f"wrote {', '.join(written)} to {args.output_dir}")
    return 0


def find_model_dir(checkpoint_dir: str | Path, model_index: int = 0) -> Path:
    root = Path(checkpoint_dir)
    if (root / ".metadata").exists():
        return root
    candidate = root / model_dir(model_index)
    if (candidate / ".metadata").exists():
        return candidate
    info = root / INFO_FILE
    known = json.loads(info.read_text()).get("models", []) if info.exists() else []
    raise CheckpointError(f"{root} holds no sharded fsdp model {model_index} (expected {candidate}/.metadata"
                          + (f"; the checkpoint has {', '.join(known)}" if known else "") + ")")


def load_full_state_dict(checkpoint_dir: str | Path, model_index: int = 0) -> dict:
    """The full model state dict of a sharded checkpoint, read in this one process."""
    state = dcp_load_full(find_model_dir(checkpoint_dir, model_index))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def merge_weights(checkpoint_dir: str | Path, output_dir: str | Path, model_index: int = 0,
                  max_shard_size: str = "5GB") -> list[str]:
    state = load_full_state_dict(checkpoint_dir, model_index)
    fields = {"merged_from": str(Path(checkpoint_dir).absolute()), "torch_version": torch.__version__}
    return publish_model(state, Path(output_dir), max_shard_size, fields, "merge-weights")
