"""Data loading as Accelerate's users see it (issue 36): the same calls on Accelerate 1.15 and on torchbay, with 1
and 2 gloo processes (tests/scripts/data_side_by_side.py), then torchbay-only checks of the same behaviours.

Compared: the shuffled order at the same seed (and the global RNG stream after it), ``use_seedable_sampler``,
streaming datasets (lengths, padding of the last batch, ``gather_for_metrics``) with and without
``dispatch_batches``, custom batch samplers whose batches vary in size (and their ``set_epoch``),
``sync_with_dataloader=False``, and ``prepare`` of objects prepared before.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, TensorDataset

from torchbay.testing.processes import run_python, run_torchrun

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "data_side_by_side.py")
ENV = {"TORCHBAY_AS_ACCELERATE": "0"}
KEYS = ["is_dataloader", "shuffled", "shuffled_len", "rng_after", "seedable", "stream_dispatch_None",
        "stream_dispatch_False", "sized_stream_dispatch_None", "sized_stream_dispatch_False", "custom_batches",
        "custom_after_set_epoch", "syncs_without_dataloader_sync", "prepare_again_same"]


def _run(tmp: Path, backend: str, processes: int) -> list[dict]:
    args = [str(tmp), backend]
    run = run_python(SCRIPT, args, env=ENV, timeout=240) if processes == 1 else \
        run_torchrun(SCRIPT, processes, args, env=ENV, timeout=240)
    run.check()
    return [json.loads((tmp / f"{backend}_rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-processes"])
def both(request, tmp_path_factory) -> tuple[list[dict], list[dict]]:
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("the real Accelerate is not installed (run with the HF environment)")
    tmp = tmp_path_factory.mktemp(f"data_{request.param}")
    return _run(tmp, "accelerate", request.param), _run(tmp, "torchbay", request.param)


@pytest.mark.multiprocess
@pytest.mark.parametrize("key", KEYS)
def test_torchbay_serves_what_accelerate_serves(both, key):
    theirs, ours = both
    for rank, (a, t) in enumerate(zip(theirs, ours)):
        assert t[key] == a[key], f"rank {rank}: {key}"


# -- torchbay alone (no Accelerate needed) ----------------------------------------------------------


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([float(i)]) for i in range(5))


def test_a_prepared_loader_is_a_dataloader_and_preparing_it_again_returns_it():
    from torchbay import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    assert isinstance(loader, DataLoader)
    again = acc.prepare(model, opt, sched, loader)
    assert all(a is b for a, b in zip(again, (model, opt, sched, loader)))
    assert acc.prepare_data_loader(loader) is loader
    assert len(acc._optimizers) == 1 and len(acc._schedulers) == 1 and len(acc._dataloaders) == 1


def test_an_unsized_stream_has_no_length_as_on_accelerate():
    from torchbay import Accelerator

    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(Stream(), batch_size=2))
    with pytest.raises(TypeError):
        len(loader)
    assert [b.flatten().tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0]]


def test_sync_with_dataloader_false_keeps_counting_across_the_end_of_a_loader():
    from torchbay import Accelerator
    from torchbay.utils import GradientAccumulationPlugin

    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=4, sync_with_dataloader=False))
    assert acc.gradient_state.sync_with_dataloader is False
    model, loader = acc.prepare(torch.nn.Linear(1, 1), DataLoader(TensorDataset(torch.ones(6, 1)), batch_size=1))
    syncs = []
    for (_x,) in loader:
        with acc.accumulate(model):
            syncs.append(acc.sync_gradients)
    assert syncs == [False, False, False, True, False, False]


class VaryingBatches(BatchSampler):
    def __init__(self):
        self.epoch = 0

    def __iter__(self):
        yield from ([0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13])

    def __len__(self):
        return 5

    def set_epoch(self, epoch):
        self.epoch = epoch


def test_set_epoch_reaches_a_custom_batch_sampler():
    from torchbay import Accelerator

    sampler = VaryingBatches()
    loader = Accelerator(cpu=True).prepare(DataLoader(TensorDataset(torch.arange(14)), batch_sampler=sampler))
    loader.set_epoch(3)
    assert sampler.epoch == 3
    assert [len(b[0]) for b in loader] == [3, 2, 4, 3, 2]


def test_varying_batches_are_shared_round_robin_between_processes():
    from torchbay.data import BatchSamplerShard

    shards = [list(BatchSamplerShard(VaryingBatches(), 2, rank, even_batches=True)) for rank in range(2)]
    assert shards == [[[0, 1, 2], [5, 6, 7, 8], [12, 13]], [[3, 4], [9, 10, 11], [0, 1, 2]]]


def test_a_dropped_prepared_loader_is_freed_at_once():
    import weakref

    from torchbay import Accelerator

    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    iterator = iter(loader)
    next(iterator)
    ref = weakref.ref(loader)
    acc._dataloaders.clear()
    del loader, iterator
    assert ref() is None and acc.gradient_state.active_dataloader is None
