"""Data-loader sharding as Accelerate documents it, reseeding per epoch, and skip_first_batches."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from torchbay import Accelerator, DataLoaderConfiguration
from torchbay.data.loader import IterableDatasetShard, SeedableRandomSampler, ShardedBatchSampler


def shards(n, batch_size, world, split=False, even=True, drop_last=False):
    inner = BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)
    return [list(ShardedBatchSampler(inner, world, rank, split, even)) for rank in range(world)]


def test_round_robin_batches_with_even_batches():
    r0, r1 = shards(10, 3, 2)
    # batches of 3 over 0..9: [0,1,2] [3,4,5] [6,7,8] [9] -> the last round is completed from the start
    assert r0 == [[0, 1, 2], [6, 7, 8]]
    assert r1 == [[3, 4, 5], [9, 0, 1]]
    assert len(ShardedBatchSampler(BatchSampler(SequentialSampler(range(10)), 3, False), 2, 0, False, True)) == 2


def test_missing_batches_are_built_from_the_start():
    r0, r1, r2 = shards(7, 2, 3)  # [0,1] [2,3] [4,5] | [6] -> [6,0] [1,2] [3,4]
    assert (r0, r1, r2) == ([[0, 1], [6, 0]], [[2, 3], [1, 2]], [[4, 5], [3, 4]])


def test_uneven_batches_when_even_batches_is_off():
    r0, r1 = shards(10, 3, 2, even=False)
    assert r0 == [[0, 1, 2], [6, 7, 8]] and r1 == [[3, 4, 5], [9]]


def test_split_batches_cuts_each_batch():
    r0, r1 = shards(10, 4, 2, split=True)
    assert r0 == [[0, 1], [4, 5], [8, 9]] and r1 == [[2, 3], [6, 7], [0, 1]]


def test_split_batches_needs_a_divisible_batch_size():
    from torchbay import ConfigError

    with pytest.raises(ConfigError, match="split_batches"):
        shards(10, 3, 2, split=True)


def test_drop_last_drops_the_incomplete_round():
    r0, r1 = shards(10, 3, 2, drop_last=True)
    assert r0 == [[0, 1, 2]] and r1 == [[3, 4, 5]]


def test_every_sample_is_served_once_per_epoch_before_padding():
    r0, r1 = shards(23, 4, 2)
    served = [i for b in r0 + r1 for i in b]
    assert set(served) == set(range(23)) and len(served) == 24


def test_seedable_sampler_depends_on_seed_and_epoch_only():
    a = SeedableRandomSampler(range(20), seed=3)
    b = SeedableRandomSampler(range(20), seed=3)
    torch.manual_seed(0)
    first = list(a)
    torch.manual_seed(99)
    assert list(b) == first
    b.set_epoch(1)
    assert list(b) != first and sorted(b) == list(range(20))


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


def test_iterable_dataset_is_sliced_per_process():
    parts = [list(IterableDatasetShard(Stream(), 2, num_processes=2, process_index=rank)) for rank in range(2)]
    assert parts == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]


def test_prepared_loader_reshuffles_each_epoch_without_set_epoch():
    acc = Accelerator(seed=0)
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True))
    epoch0 = [b[0].tolist() for b in dl]
    epoch1 = [b[0].tolist() for b in dl]
    assert epoch0 != epoch1
    assert sorted(sum(epoch0, [])) == list(range(16)) == sorted(sum(epoch1, []))
    acc2 = Accelerator(seed=0)
    dl2 = acc2.prepare(DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True))
    assert [b[0].tolist() for b in dl2] == epoch0  # same seed, same order
    skipped = [b[0].tolist() for b in acc2.skip_first_batches(dl2, 3)]
    assert skipped == epoch1[3:]


def test_last_batch_is_flagged_and_accumulation_syncs_there():
    acc = Accelerator(gradient_accumulation_steps=4)
    model = torch.nn.Linear(1, 1)
    model, dl = acc.prepare(model, DataLoader(TensorDataset(torch.ones(6, 1)), batch_size=1))
    syncs = []
    for (x,) in dl:
        with acc.accumulate(model):
            syncs.append(acc.sync_gradients)
    assert syncs == [False, False, False, True, False, True]


def test_gather_for_metrics_single_process_keeps_everything():
    acc = Accelerator()
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    got = torch.cat([acc.gather_for_metrics(b[0]) for b in dl])
    assert got.tolist() == list(range(10))


def test_dataloader_configuration_reaches_the_config():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=False))
    assert acc.config.dataloader.split_batches and not acc.config.dataloader.even_batches
    assert acc.context.resolved.source_of("dataloader.split_batches") == "args"


@pytest.mark.multiprocess
def test_collectives_and_gather_for_metrics_in_two_processes(tmp_path, script):
    import json

    from torchbay.testing.processes import run_torchrun

    out_file = tmp_path / "out.json"
    run_torchrun(script("core_collectives.py"), 2, [str(out_file)]).check()
    out = json.loads(out_file.read_text())
    assert out["gathered"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 12 served, the repeated one dropped
    assert sorted(out["gathered_objects"]) == [0, 1, 2, 3, 4]
    assert out["sum"] == 3.0 and out["mean"] == 1.5 and out["gather"] == [1.0, 2.0]
    assert out["padded"] == [1.0, 0.0, 1.0, 1.0]
    assert out["split"] == [0, 1, 2]
    assert out["dispatched"] == list(range(11))  # rank 0 read, everyone got a slice, padding dropped
    assert out["dispatched_local"] == [[0, 1, 2], [6, 7, 8]]  # rank 0 of global batches of 6
    assert out["objects_gathered"] == [[0, 1], [1, 1001]] and out["object_broadcast"] == 1
    assert out["held_works"] == [True] * 4 and out["held_works_distinct"] and out["held_count"] == 2
    assert out["pickles_with_held_works"]
