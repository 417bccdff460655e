"""Big-model inference (Accelerate's ``accelerate.big_modeling`` path): empty-weight init, device maps, dispatch,
cpu/disk offload. ``modeling`` holds the user-facing functions; ``device_map``/``infer`` place modules,
``hooks`` are Accelerate's module hooks, ``loading``/``files`` read checkpoints, ``dispatch`` places a model and
attaches its hooks, both on ``slots``; ``offload``/``offload_index`` keep offloaded weights.
"""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "cpu_offload": "torchbay.big_modeling.modeling",
    "cpu_offload_with_hook": "torchbay.big_modeling.modeling",
    "disk_offload": "torchbay.big_modeling.modeling",
    "dispatch_model": "torchbay.big_modeling.modeling",
    "init_empty_weights": "torchbay.big_modeling.modeling",
    "init_on_device": "torchbay.big_modeling.modeling",
    "load_checkpoint_and_dispatch": "torchbay.big_modeling.modeling",
    "load_checkpoint_in_model": "torchbay.big_modeling.modeling",
    "infer_auto_device_map": "torchbay.big_modeling.modeling",
    "get_balanced_memory": "torchbay.big_modeling.modeling",
    "attach_layerwise_casting_hooks": "torchbay.big_modeling.modeling",
    "check_device_map": "torchbay.big_modeling.modeling",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["attach_layerwise_casting_hooks", "check_device_map", "cpu_offload", "cpu_offload_with_hook", "disk_offload",
           "dispatch_model", "get_balanced_memory", "infer_auto_device_map", "init_empty_weights", "init_on_device",
           "load_checkpoint_and_dispatch", "load_checkpoint_in_model"]

if TYPE_CHECKING:
    from torchbay.big_modeling.modeling import (
        attach_layerwise_casting_hooks,
        check_device_map,
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        get_balanced_memory,
        infer_auto_device_map,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
    )
# -- end of the names written by scripts/public_names.py --
