"""``torchbay merge-weights CHECKPOINT_DIR OUTPUT_DIR``: a sharded fsdp checkpoint -> one safetensors model.

Runs offline in one process, with no process group: torch.distributed.checkpoint reads
every rank's shards and assembles full tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchbay.errors import CheckpointError


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
    from torchbay_fsdp.strategy import INFO_FILE, model_dir

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
    import torch

    path = find_model_dir(checkpoint_dir, model_index)
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        state = _load_state_dict_from_keys(checkpoint_id=str(path))
    except ImportError:  # older torch: go through a temporary torch.save file
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path), f"{tmp}/full.pt")
            state = torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def merge_weights(checkpoint_dir: str | Path, output_dir: str | Path, model_index: int = 0,
                  max_shard_size: str = "5GB") -> list[str]:
    from torchbay.builtin.checkpoint_io import SafetensorsCheckpointIO

    state = load_full_state_dict(checkpoint_dir, model_index)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return SafetensorsCheckpointIO(max_shard_size=max_shard_size).save_state_dict(state, out, "model")
