"""Accelerator behaviours that follow Accelerate's, each call made on Accelerate and on torchbay side by side
(issue 36): the batch-size search, the launcher's entry point, log records' call site, the prepared optimizer's
extra methods and skipped steps, and what ``unwrap_model`` removes."""

import functools
import inspect
import logging
import os

import pytest
import torch

import torchbay
import torchbay.utils as tb_utils
from torchbay.errors import ConfigError, TorchbayError
from torchbay.state import AcceleratorState as TbState

accelerate = pytest.importorskip("accelerate", reason="Accelerate (a dev dependency) is the reference")
import accelerate.logging as acc_logging  # noqa: E402
import accelerate.utils as acc_utils  # noqa: E402
from accelerate.state import AcceleratorState as AccState  # noqa: E402

OOM = "CPU out of memory."


@pytest.fixture
def acc_accelerator():
    """Accelerate's Accelerator (CPU), its process-wide state reset after the test."""
    yield accelerate.Accelerator(cpu=True)
    AccState._reset_state(True)


def _sizes_tried(finder, start, stop_at, **kwargs):
    tried = []

    @finder(starting_batch_size=start, **kwargs)
    def train(batch_size, tag):
        tried.append(batch_size)
        if batch_size > stop_at:
            raise RuntimeError(OOM)
        return batch_size, tag

    return train("x"), tried


@pytest.mark.parametrize("start, stop_at", [(128, 8), (64, 16), (7, 1)])
def test_find_executable_batch_size_tries_accelerates_sizes(start, stop_at):
    ours = _sizes_tried(tb_utils.find_executable_batch_size, start, stop_at)
    theirs = _sizes_tried(acc_utils.find_executable_batch_size, start, stop_at)
    assert ours == theirs and ours[1][1] == int(start * 0.9)


def test_find_executable_batch_size_takes_accelerates_reduce_function():
    for finder in (tb_utils.find_executable_batch_size, acc_utils.find_executable_batch_size):
        sizes = iter([50, 10])
        result, tried = _sizes_tried(finder, 100, 10, reduce_batch_size_fn=lambda: next(sizes))
        assert tried == [100, 50, 10] and result == (10, "x")
    _, tried = _sizes_tried(tb_utils.find_executable_batch_size, 100, 10, reduce_batch_size_fn=lambda n: n - 45)
    assert tried == [100, 55, 10]


@pytest.mark.parametrize("finder", [tb_utils.find_executable_batch_size, acc_utils.find_executable_batch_size],
                         ids=["torchbay", "accelerate"])
def test_find_executable_batch_size_errors_are_accelerates_types(finder):
    @finder(starting_batch_size=16)
    def always_oom(batch_size):
        raise RuntimeError(OOM)

    with pytest.raises(RuntimeError, match="(?i)no executable batch size found, reached zero"):
        always_oom()

    @finder(starting_batch_size=0)
    def start_zero(batch_size):
        pass

    with pytest.raises(RuntimeError):
        start_zero()

    @finder(starting_batch_size=8)
    def two_args(batch_size, a, b):
        pass

    with pytest.raises(TypeError, match=r"two_args\(a='?hello'?, b='?world'?\)"):
        two_args(8, "hello", "world")


def test_find_executable_batch_size_errors_are_torchbay_errors():
    @tb_utils.find_executable_batch_size(starting_batch_size=0)
    def start_zero(batch_size):
        pass

    with pytest.raises(TorchbayError):
        start_zero()


def test_find_executable_batch_size_keeps_the_size_found_across_calls():
    for finder in (tb_utils.find_executable_batch_size, acc_utils.find_executable_batch_size):
        tried = []

        @finder(starting_batch_size=10)
        def train(batch_size):
            tried.append(batch_size)
            if batch_size > 8:
                raise RuntimeError(OOM)

        train()
        train()
        assert tried == [10, 9, 8, 8]


def _add_rank(value, out):
    out.put((torchbay.PartialState().process_index, value))


def test_debug_launcher_runs_a_partial():
    import multiprocessing

    queue = multiprocessing.get_context("fork").Queue()
    tb_utils.debug_launcher(functools.partial(_add_rank, 7, queue), num_processes=2)
    assert sorted(queue.get(timeout=30) for _ in range(2)) == [(0, 7), (1, 7)]


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
def test_log_records_name_the_callers_line(side, caplog, acc_accelerator):
    get_logger = tb_utils.get_logger if side == "torchbay" else acc_logging.get_logger
    logger = get_logger(__name__, log_level="INFO")
    with caplog.at_level(logging.INFO):
        line = inspect.currentframe().f_lineno + 1
        logger.info("hello")
        logger.warning("in order", main_process_only=False, in_order=True)
    first, second = caplog.records
    assert first.filename == os.path.basename(__file__) and first.lineno == line
    assert first.funcName == "test_log_records_name_the_callers_line"
    assert second.filename == os.path.basename(__file__) and second.lineno == line + 1


class ScheduleFree(torch.optim.SGD):
    """Stands for a schedule-free optimizer: train()/eval() modes switched by the user."""

    mode = "train"

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"

    def extra(self):
        return "from the optimizer"


def test_prepared_optimizer_passes_train_and_eval_through(acc_accelerator):
    for accelerator in (acc_accelerator, torchbay.Accelerator(cpu=True)):
        model = torch.nn.Linear(2, 2)
        optimizer = accelerator.prepare(ScheduleFree(model.parameters(), lr=0.1))
        optimizer.eval()
        assert optimizer.optimizer.mode == "eval"
        optimizer.train()
        assert optimizer.optimizer.mode == "train"
        plain = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        plain.train()  # an optimizer without modes: nothing happens
        plain.eval()
    assert optimizer.extra() == "from the optimizer"  # torchbay passes its other methods through


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
def test_scheduler_does_not_step_after_a_skipped_optimizer_step(side, acc_accelerator):
    accelerator = torchbay.Accelerator(cpu=True) if side == "torchbay" else acc_accelerator
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.9)
    optimizer._is_overflow = True  # as a loss scaler that found inf gradients
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.9)


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
@pytest.mark.parametrize("keep_torch_compile", [True, False])
def test_unwrap_model_removes_a_users_data_parallel(side, keep_torch_compile, acc_accelerator):
    accelerator = torchbay.Accelerator(cpu=True) if side == "torchbay" else acc_accelerator
    model = torch.nn.Linear(2, 4)
    assert accelerator.unwrap_model(torch.nn.DataParallel(model)) is model
    compiled = torch.compile(torch.nn.DataParallel(model))
    unwrapped = accelerator.unwrap_model(compiled, keep_torch_compile=keep_torch_compile)
    if keep_torch_compile:
        assert unwrapped is compiled and unwrapped._orig_mod is model
    else:
        assert unwrapped is model
    assert torchbay.utils.extract_model_from_parallel(torch.nn.DataParallel(model)) is model


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
def test_prepare_marks_what_it_returns_and_does_not_prepare_a_model_twice(side, acc_accelerator):
    accelerator = torchbay.Accelerator(cpu=True) if side == "torchbay" else acc_accelerator
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    dummy = [1, 2]
    *prepared, dummy = accelerator.prepare(model, optimizer, scheduler, loader, dummy)
    assert all(getattr(obj, "_is_accelerate_prepared", False) is True for obj in prepared)
    assert getattr(dummy, "_is_accelerate_prepared", False) is False
    count = len(accelerator._models)
    assert accelerator.prepare_model(prepared[0]) is prepared[0] and len(accelerator._models) == count


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
def test_sync_gradients_can_be_set_on_the_accelerator(side, acc_accelerator):
    accelerator = torchbay.Accelerator(cpu=True) if side == "torchbay" else acc_accelerator
    accelerator.sync_gradients = False
    assert accelerator.gradient_state.sync_gradients is False
    accelerator.sync_gradients = True
    assert accelerator.gradient_state.sync_gradients is True


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
def test_save_model_reads_the_weights_of_an_offloaded_model(side, acc_accelerator, tmp_path):
    accelerator = torchbay.Accelerator(cpu=True) if side == "torchbay" else acc_accelerator
    dispatch = torchbay.load_checkpoint_and_dispatch if side == "torchbay" else accelerate.load_checkpoint_and_dispatch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5)).eval()
    x = torch.randn(3, 3)
    expected = model(x)
    accelerator.save_model(model, str(tmp_path))
    dispatch(model, str(tmp_path), device_map={"0": "cpu", "1": "disk", "2": "cpu"},
             offload_folder=str(tmp_path / "offload"))
    accelerator.save_model(model, str(tmp_path / "again"))
    reloaded = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5)).eval()
    dispatch(reloaded, str(tmp_path / "again"))
    assert torch.allclose(reloaded(x), expected, atol=1e-5)


@pytest.mark.parametrize("given", [{"backend": "inductor"}, {"backend": "aot_eager", "mode": "reduce-overhead"},
                                   {"backend": "eager", "fullgraph": True, "use_regional_compilation": True}])
def test_dynamo_plugin_to_kwargs_gives_what_differs_from_the_defaults(given, monkeypatch):
    for key in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]:
        monkeypatch.delenv(key)
    assert tb_utils.TorchDynamoPlugin(**given).to_kwargs() == acc_utils.TorchDynamoPlugin(**given).to_kwargs()


@pytest.mark.parametrize("environment", [{"BACKEND": "aot_eager", "MODE": "reduce-overhead"},
                                         {"BACKEND": "inductor", "USE_FULLGRAPH": "true", "USE_DYNAMIC": "false"},
                                         {"BACKEND": "no", "USE_REGIONAL_COMPILATION": "1"}])
def test_dynamo_plugin_reads_accelerates_environment_as_accelerate_does(environment, monkeypatch):
    for key in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(f"ACCELERATE_DYNAMO_{key}", value)
    assert tb_utils.TorchDynamoPlugin().to_kwargs() == acc_utils.TorchDynamoPlugin().to_kwargs()
    assert tb_utils.TorchDynamoPlugin(mode="max-autotune").to_kwargs() == acc_utils.TorchDynamoPlugin(
        mode="max-autotune").to_kwargs()  # an argument given wins over the environment


def test_a_dynamo_environment_flag_that_is_not_a_boolean_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "maybe")
    with pytest.raises(ConfigError, match="ACCELERATE_DYNAMO_USE_FULLGRAPH='maybe' is not a boolean"):
        tb_utils.TorchDynamoPlugin()


def test_environment_helpers_answer_as_accelerates(monkeypatch):
    from accelerate.utils import environment as acc_environment

    assert tb_utils.are_libraries_initialized("torch", "os", "no_such_library") == \
        acc_environment.are_libraries_initialized("torch", "os", "no_such_library") == ["torch", "os"]
    for key in [k for k in os.environ if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "OMPI_", "PMI_", "SLURM_"))]:
        monkeypatch.delenv(key)
    assert vars(tb_utils.get_cpu_distributed_information()) == vars(acc_environment.get_cpu_distributed_information())
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    ours = tb_utils.get_cpu_distributed_information()
    assert vars(ours) == vars(acc_environment.get_cpu_distributed_information()) == {
        "rank": 3, "world_size": 4, "local_rank": 1, "local_world_size": 2}


def test_model_has_dtensor_answers_as_accelerates(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    model = torch.nn.Linear(2, 2)
    assert tb_utils.model_has_dtensor(model) is acc_utils.model_has_dtensor(model) is False
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model.weight = torch.nn.Parameter(DTensor.from_local(model.weight.data, mesh, [Replicate()]))
        assert tb_utils.model_has_dtensor(model) is acc_utils.model_has_dtensor(model) is True
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wanted", ["cpu:3", "cpu"])
def test_accelerate_torch_device_names_the_device_as_on_accelerate(monkeypatch, wanted):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", wanted)
    AccState._reset_state(True)
    theirs = str(accelerate.Accelerator().state.device)
    AccState._reset_state(True)
    TbState._reset_state(True)
    try:
        ours = torchbay.Accelerator()
        assert str(ours.state.device) == str(ours.device) == theirs == wanted
    finally:
        TbState._reset_state(True)


def test_accelerate_torch_device_of_another_type_than_the_run_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "meta:0")
    TbState._reset_state(True)
    with pytest.raises(ConfigError, match="ACCELERATE_TORCH_DEVICE='meta:0' names a meta device"):
        torchbay.Accelerator(cpu=True)
    TbState._reset_state(True)
