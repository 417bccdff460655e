"""Accelerate's names and behaviours in one process (the compat suite runs Accelerate's own scripts;
these pin the behaviours down where a failure is easier to read)."""

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset, default_collate

import torchbay
from torchbay import Accelerator, DistributedType, GradientAccumulationPlugin, PartialState
from torchbay.compat.names import UnsupportedAPIError
from torchbay.data import SeedableRandomSampler, prepare_data_loader
from torchbay.errors import TorchbayError
from torchbay.utils import find_executable_batch_size, set_seed


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def _data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def test_bf16_training_matches_a_raw_autocast_loop_bit_for_bit():
    x, y = _data()
    raw = _mlp()
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    for i in range(0, 64, 8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = raw(x[i:i + 8])
        loss = F.mse_loss(out.float(), y[i:i + 8])
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()

    acc = Accelerator(mixed_precision="bf16")
    model = _mlp()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i in range(0, 64, 8):
        out = model(x[i:i + 8])
        assert out.dtype == torch.float32  # the user's loss runs in fp32, as after a raw autocast block
        loss = F.mse_loss(out, y[i:i + 8])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    for a, b in zip(raw.parameters(), acc.unwrap_model(model).parameters()):
        assert torch.equal(a, b)
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(x[:2]).dtype == torch.float32 and not hasattr(plain, "_torchbay_original_forward")


@pytest.mark.parametrize("with_generator", [False, True])
def test_prepare_does_not_change_a_seeded_loaders_order(with_generator):
    ds = TensorDataset(torch.arange(20))

    def run(prepare):
        set_seed(7)
        kwargs = {"generator": torch.Generator().manual_seed(3)} if with_generator else {}
        loader = DataLoader(ds, batch_size=4, shuffle=True, **kwargs)
        if prepare:
            loader = Accelerator().prepare(loader)
        return [b[0].tolist() for _ in range(2) for b in loader] + [torch.rand(1).item()]

    assert run(prepare=True) == run(prepare=False)


def test_seedable_sampler_is_opt_in_and_takes_accelerates_arguments():
    assert torchbay.DataLoaderConfiguration().use_seedable_sampler is False
    sampler = SeedableRandomSampler(generator=torch.Generator(), data_source=range(10), num_samples=10, data_seed=5)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == list(range(10)) and first != second  # next epoch, new order
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_batch_sampler_as_sampler_with_batch_size_none():
    ds = TensorDataset(torch.arange(10))
    sampler = BatchSampler(RandomSampler(ds), batch_size=4, drop_last=False)
    loader = DataLoader(ds, sampler=sampler, batch_size=None, collate_fn=default_collate)
    prepared = Accelerator().prepare(loader)
    seen = sorted(i for batch in prepared for i in batch[0].tolist())
    assert seen == list(range(10))


def test_free_functions_have_accelerates_signatures():
    from torchbay.utils import (
        broadcast,
        broadcast_object_list,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
        send_to_device,
        synchronize_rng_states,
    )

    Accelerator()
    t = torch.arange(3.0)
    assert torch.equal(gather(t), t) and gather_object([1]) == [1]
    assert torch.equal(reduce(t, "sum"), t) and torch.equal(reduce(t), t) and torch.equal(reduce(t, "sum", 2.0), 2 * t)
    with pytest.raises(TorchbayError, match="reduction"):
        reduce(t, "median")
    assert torch.equal(broadcast(t), t) and broadcast_object_list([1, 2]) == [1, 2]
    assert torch.equal(pad_across_processes(t), t)
    assert send_to_device({"a": [t]}, "cpu")["a"][0] is t
    synchronize_rng_states(["torch", "generator"], generator=torch.Generator())
    dl = prepare_data_loader(DataLoader(range(8), batch_size=4), put_on_device=True)
    assert [b.tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_state_classes_and_distributed_type():
    acc = Accelerator()
    state = PartialState()
    assert acc.distributed_type is DistributedType.NO == "NO" and state.distributed_type == DistributedType.NO
    assert acc.state.mixed_precision == "no" and state.num_processes == 1 and state.is_last_process
    assert isinstance(DistributedType.MULTI_CPU, str)
    assert acc.is_last_process and acc.on_last_process(lambda: 3)() == 3
    acc.state._reset_state()
    with pytest.raises(AttributeError, match="_reset_state"):
        acc.prepare(torch.nn.Linear(1, 1))
    Accelerator()  # a new Accelerator fills the state again
    acc.prepare(torch.nn.Linear(1, 1))


def test_accelerator_pickles():
    acc = Accelerator()
    acc.prepare(DataLoader(range(8), batch_size=2))
    again = pickle.loads(pickle.dumps(acc))
    assert again.state.__dict__ == acc.state.__dict__ and again.num_processes == 1


def test_trigger_and_gradient_accumulation_plugin():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True))
    assert acc.gradient_state.sync_each_batch and acc.gradient_state.num_steps == 2
    assert acc.gradient_state.active_dataloader is None
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False


def test_find_executable_batch_size_shrinks_to_90_percent_on_out_of_memory():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return batch_size * scale

    assert train(2) == 30 and tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15]


def test_availability_is_answered_by_the_plugins():
    from torchbay import utils

    assert utils.is_bf16_available() is True  # the cpu device autocasts bf16
    assert utils.is_cuda_available() is False and utils.is_torch_xla_available(check_is_tpu=True) is False
    assert utils.is_pytest_available() is True and utils.is_mps_available(min_version="2.0") is False
    assert torchbay.is_rich_available() in (True, False)


def test_unsupported_names_say_what_to_use():
    with pytest.raises(UnsupportedAPIError, match="fp8"):
        torchbay.utils.apply_fp8_autowrap
    with pytest.raises(AttributeError):
        torchbay.utils.no_such_name_anywhere


def test_notebook_launcher_one_process_runs_in_place():
    assert torchbay.notebook_launcher(lambda a: a + 1, (1,), num_processes=1) == 2


def test_ddp_kwargs_and_profile_kwargs():
    from torchbay import DDPCommunicationHookType, DistributedDataParallelKwargs, ProfileKwargs

    kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD, bucket_cap_mb=10)
    assert kwargs.ddp_kwargs() == {"bucket_cap_mb": 10}
    with ProfileKwargs(activities=["cpu"], record_shapes=True).build() as prof:
        torch.ones(2) + 1
    assert prof.key_averages() is not None


def test_fsdp_yaml_without_version_says_it_is_imported_as_fsdp2(tmp_path):
    from torchbay.compat.config_import import import_file, to_yaml

    path = tmp_path / "acc.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                    "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    tree, report = import_file(str(path))
    (note,) = [line for line in report.lines() if line.startswith("NOTE")]
    assert "FSDP1" in note and "FSDP2" in note and "fsdp_version: 1" in note
    assert "# NOTE fsdp_config.fsdp_version is absent" in to_yaml(tree, report, str(path))
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    assert not import_file(str(path))[1].notes


def test_backend_names_come_from_their_plugins():
    pytest.importorskip("torchbay_fsdp")
    pytest.importorskip("torchbay_deepspeed")
    from torchbay import utils

    fsdp = utils.FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy="size_based_wrap",
                                                min_num_params=10)
    assert fsdp.to_config() == {"strategy": "fsdp", "fsdp.reshard_after_forward": False, "fsdp.wrap_policy": "size",
                                "fsdp.min_num_params": 10}
    with pytest.raises(torchbay.ConfigError, match="HYBRID_SHARD"):
        utils.FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD").to_config()
    ds = torchbay.DeepSpeedPlugin(zero_stage=3, hf_ds_config={"gradient_clipping": 1.0,
                                                              "zero_optimization": {"stage": "auto"}})
    assert ds.to_config() == {"strategy": "deepspeed", "gradient_accumulation_steps": 1, "deepspeed.config": {
        "gradient_clipping": 1.0, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}}
    acc = Accelerator(fsdp_plugin=utils.FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False))
    assert acc.strategy.name == "fsdp" and acc.config.fsdp.reshard_after_forward is False
    acc.end_training()  # one-process fsdp holds a private process group
    assert callable(utils.merge_fsdp_weights) and utils.DummyOptim.__module__.startswith("torchbay_deepspeed")


def test_split_between_processes_of_a_dataset_like_object():
    from torchbay.process.queries import split_between

    class Rows:  # what split_between_processes needs of a datasets.Dataset: len() and select()
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def select(self, indices):
            return Rows([self.rows[i] for i in indices])

    data = Rows(list(range(3)))
    assert [split_between(data, 2, i, False).rows for i in range(2)] == [[0, 1], [2]]
    assert [split_between(data, 2, i, True).rows for i in range(2)] == [[0, 1], [2, 2]]
    assert split_between({"a": [1, 2, 3], "b": torch.arange(3)}, 2, 1, True)["b"].tolist() == [2, 2]


def test_prepare_model_for_evaluation_only_places_and_casts():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)
    assert isinstance(model, torch.nn.Linear) and model(torch.ones(1, 2)).dtype == torch.float32
    assert acc._models == []


def test_distributed_type_comes_from_strategy_and_device():
    from types import SimpleNamespace as NS

    from torchbay.process.state import distributed_type_for

    cpu, gpu = NS(name="cpu"), NS(name="cuda", accelerate_distributed_type="MULTI_GPU")
    assert distributed_type_for(NS(name="single", world_size=1), cpu) is DistributedType.NO
    assert distributed_type_for(NS(name="ddp", world_size=1), gpu) is DistributedType.NO
    assert distributed_type_for(NS(name="ddp", world_size=2), cpu) is DistributedType.MULTI_CPU
    assert distributed_type_for(NS(name="ddp", world_size=2), gpu) is DistributedType.MULTI_GPU
    assert distributed_type_for(NS(name="ddp", world_size=2), NS(name="npu")) is DistributedType.MULTI_NPU
    assert distributed_type_for(NS(name="fsdp", world_size=2), gpu) is DistributedType.FSDP
    assert distributed_type_for(NS(name="deepspeed", world_size=1), cpu) is DistributedType.DEEPSPEED


def test_gradient_state_without_arguments_is_the_latest_accelerators():
    from torchbay import GradientState

    acc = Accelerator(gradient_accumulation_steps=3)
    assert GradientState() is acc.gradient_state and GradientState().num_steps == 3
    assert GradientState(2) is not acc.gradient_state
