"""Big-model inference (Accelerate's ``accelerate.big_modeling`` path): empty-weight init, device maps, dispatch,
cpu/disk offload. ``modeling`` holds the user-facing functions; ``device_map``/``infer`` place modules,
``hooks`` are Accelerate's module hooks, ``loading``/``files`` read checkpoints, ``dispatch`` places a model and
attaches its hooks, both on ``slots``; ``offload``/``offload_index`` keep offloaded weights.
"""

from torchbay._lazy import serve_names

__all__ = ['cpu_offload', 'cpu_offload_with_hook', 'disk_offload', 'dispatch_model', 'init_empty_weights',
           'init_on_device', 'load_checkpoint_and_dispatch', 'load_checkpoint_in_model', 'infer_auto_device_map',
           'get_balanced_memory', 'attach_layerwise_casting_hooks', 'check_device_map']
_IMPLEMENTATION = "torchbay.big_modeling.modeling"
__getattr__, __dir__ = serve_names(__name__, {_IMPLEMENTATION: __all__}, fallback=(_IMPLEMENTATION,))
