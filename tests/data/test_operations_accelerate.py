"""The nested-structure helpers of torchbay.data.operations as Accelerate's users see them (issue 36).

Each check runs on torchbay; where the real Accelerate is installed (the HF environment) the same call is
made on it too and the answers compared.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from torchbay.data import operations as ours

HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None


def _implementations():
    yield ours
    if HAVE_ACCELERATE:
        from accelerate.utils import operations as theirs

        yield theirs


@pytest.mark.parametrize("impl", list(_implementations()), ids=lambda m: m.__name__.split(".")[0])
def test_concatenate_returns_a_single_batch_as_it_is_even_when_not_a_tensor(impl):
    assert impl.concatenate(["text"]) == "text"
    with pytest.raises(TypeError):
        impl.concatenate([{"a": torch.zeros(1), "c": "x"}, {"a": torch.zeros(1), "c": "y"}])
    assert impl.concatenate([torch.zeros(2, 3), torch.ones(2, 3)]).shape == (4, 3)


def test_an_unsupported_type_names_the_function_and_the_test_as_accelerate_does():
    messages = []
    for impl in _implementations():
        with pytest.raises(TypeError) as info:
            impl.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
        messages.append(str(info.value))
    assert "`tensor`" in messages[0] and "is_torch_tensor" in messages[0]
    assert len(set(messages)) == 1


@pytest.mark.parametrize("impl", list(_implementations()), ids=lambda m: m.__name__.split(".")[0])
def test_a_nested_tensor_is_left_unpadded_with_a_warning(impl):
    nested = torch.nested.nested_tensor([[1, 2, 3], [1], [1, 2]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert impl.pad_across_processes(nested) is nested
    assert any(w.category.__name__ == "CannotPadNestedTensorWarning" for w in caught)


@pytest.mark.parametrize("batch, processes, rows", [(1, 2, 2), (3, 2, 4), (4, 3, 6), (3, 4, 4), (4, 6, 6),
                                                    (1, 6, 6)])
@pytest.mark.parametrize("impl", list(_implementations()), ids=lambda m: m.__name__.split(".")[0])
def test_pad_input_tensors_pads_with_zeros_to_split_over_the_processes(impl, batch, processes, rows):
    tensor = torch.rand(batch, 4) + 1
    padded = impl.pad_input_tensors({"x": tensor}, batch, processes)["x"]
    assert padded.shape == (rows, 4)
    assert torch.equal(padded[:batch], tensor) and not padded[batch:].any()


def test_pad_input_tensors_always_gives_a_multiple_of_the_processes():
    for batch in range(1, 20):
        for processes in range(1, 7):
            rows = ours.pad_input_tensors(torch.zeros(batch, 2), batch, processes).shape[0]
            assert rows % processes == 0 and rows >= batch and rows - batch < processes or rows == processes


def test_send_to_device_traces_under_torch_compile():
    compiled = torch.compile(ours.send_to_device, fullgraph=True, backend="eager")
    out = compiled({"a": torch.zeros([1], dtype=torch.bfloat16)}, "cpu")
    assert out["a"].dtype == torch.bfloat16
