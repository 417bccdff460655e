"""The current run's one home (process/current.py) and Accelerate's state views over it (issue 37, item 2)."""

import torch

from torchbay import Accelerator
from torchbay.data.gradient_state import GradientState
from torchbay.process import current
from torchbay.state import AcceleratorState, PartialState


def test_the_accelerator_sets_the_run_and_the_state_views_show_it():
    AcceleratorState._reset_state(True)
    assert current.peek() is None and PartialState._shared_state == {}
    acc = Accelerator(cpu=True, mixed_precision="no")
    run = current.peek()
    assert run is not None and run.strategy is acc.strategy and run.gradient_state is acc.gradient_state
    assert (run.device, run.num_processes, run.process_index) == (acc.device, 1, 0)
    state = PartialState()
    assert (state.device, state.process_index, state.distributed_type) == (run.device, 0, run.distributed_type)
    assert AcceleratorState().mixed_precision == run.mixed_precision == "no"
    assert GradientState() is acc.gradient_state

    PartialState().debug = True  # Accelerate's way to turn on the shape checks: the services read the record
    assert run.debug is True and PartialState().debug is True

    AcceleratorState._reset_state(True)
    assert current.peek() is None and PartialState._shared_state == {}


def test_without_an_accelerator_the_first_service_starts_a_run_as_partial_state_does():
    AcceleratorState._reset_state(True)
    from torchbay.utils import gather

    assert torch.equal(gather(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    run = current.peek()
    assert run is not None and run.num_processes == 1  # the views show it at once, as after Accelerate's PartialState()
    assert PartialState._shared_state["device"] == run.device and PartialState().process_index == 0
    AcceleratorState._reset_state(True)


def test_a_newer_accelerator_replaces_the_run_and_a_dropped_ones_gradient_state_is_not_kept():
    AcceleratorState._reset_state(True)
    first = Accelerator(cpu=True)
    first_gradient_state = first.gradient_state
    second = Accelerator(cpu=True)
    assert current.peek().strategy is second.strategy and GradientState() is second.gradient_state
    assert GradientState() is not first_gradient_state
    AcceleratorState._reset_state(True)
