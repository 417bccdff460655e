"""Gradient accumulation under pipeline parallel: one reduction per accumulation window.

torch's schedules end every training step with each stage's ``perform_reduce_grad``, which turns
FSDP2's gradient sync back on and reduce-scatters the step's gradients. Inside
``accelerator.accumulate``, every step of a window but the last runs under the strategy's
``no_sync``; there :func:`reduction_deferred` gives each FSDP2 stage, for that one step, the same
end-of-backward bookkeeping with gradient sync left off. FSDP2 then keeps each parameter's
unsharded gradient and adds the next step's to it (its own ``no_sync`` path), and the window's
last step reduces the sum once: one reduce-scatter (or all-reduce) per window instead of one per
step, as without pp.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

from torchbay.errors import TorchbayError


@contextlib.contextmanager
def reduction_deferred(torch_stages: list) -> Iterator[None]:
    """Within: the schedule's end-of-step reduction of each stage keeps the gradients to accumulate."""
    for stage in torch_stages:
        stage.perform_reduce_grad = functools.partial(_finish_backward_without_reduction, stage)
    try:
        yield
    finally:
        for stage in torch_stages:
            del stage.perform_reduce_grad  # the class's own method again


def _finish_backward_without_reduction(stage: Any, grad_scale_factor: int) -> None:
    """What torch's ``perform_reduce_grad`` does for an FSDP2 stage, with gradient sync off: reshard the
    parameters, keep each unsharded gradient accumulated, close the backward."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if grad_scale_factor != 1:  # torchbay builds its schedules with scale_grads=False (the loss is scaled)
        raise TorchbayError("a pipeline schedule that scales gradients cannot defer their reduction")
    module = stage.submod
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(False)
    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
