"""``accelerate.hooks`` served by torchbay: the hook objects transformers, peft and diffusers build.

They are torchbay's own module hooks (:mod:`torchbay.big_modeling.hooks`, placed by
:mod:`torchbay.big_modeling.hook_placement`), the ones ``dispatch_model``,
``cpu_offload``, ``disk_offload`` and ``cpu_offload_with_hook`` attach: one machinery, with Accelerate's
classes, keyword arguments and ``module._hf_hook`` / ``module._old_forward`` attributes
(docs/big-model-inference.md says where torchbay's differ).
"""

from torchbay.big_modeling.align_hook import AlignDevicesHook
from torchbay.big_modeling.hook_placement import (
                                     attach_align_device_hook,
                                     attach_align_device_hook_on_blocks,
                                     attach_execution_device_hook,
)
from torchbay.big_modeling.hooks import (
                                     CpuOffload,
                                     LayerwiseCastingHook,
                                     ModelHook,
                                     SequentialHook,
                                     UserCpuOffloadHook,
                                     add_hook_to_module,
                                     remove_hook_from_module,
                                     remove_hook_from_submodules,
)

__all__ = ["AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook", "ModelHook", "SequentialHook",
           "UserCpuOffloadHook", "add_hook_to_module", "attach_align_device_hook", "attach_align_device_hook_on_blocks",
           "attach_execution_device_hook", "remove_hook_from_module", "remove_hook_from_submodules"]
