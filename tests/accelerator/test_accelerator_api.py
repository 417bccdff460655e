"""The Accelerator API in one process: precision, accumulation, clipping, wrappers, helpers."""

import logging

import pytest
import torch

from torchbay import (
    Accelerator,
    AutocastKwargs,
    ConfigError,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    get_logger,
    tqdm,
)


def make(**kwargs):
    acc = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return acc, model, opt


def test_bf16_autocasts_the_prepared_forward():
    acc, model, opt = make(mixed_precision="bf16")
    model = acc.prepare(model)
    x = torch.randn(2, 8)
    out = model(x)  # computed in bf16, returned as fp32 (Accelerate's convert_outputs_to_fp32)
    assert out.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, acc.unwrap_model(model)._torchbay_original_forward(x).float())
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.randn(2, 8)).dtype == torch.float32
    with acc.autocast():
        assert plain(torch.randn(2, 8)).dtype == torch.bfloat16
    with acc.autocast(AutocastKwargs(enabled=False)):
        assert plain(torch.randn(2, 8)).dtype == torch.float32


def test_fp16_scales_the_loss_and_skips_steps_with_inf():
    acc, model, opt = make(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model, opt = acc.prepare(model, opt)
    before = model.weight.detach().clone()
    loss = model(torch.randn(2, 8)).float().sum()
    acc.backward(loss)
    assert acc.precision.scaler.get_scale() == 1024.0
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert acc.optimizer_step_was_skipped and torch.equal(model.weight, before)
    opt.zero_grad()
    acc.backward(model(torch.randn(2, 8)).float().sum())
    opt.step()
    assert not acc.optimizer_step_was_skipped and not torch.equal(model.weight, before)


def test_clip_grad_norm_unscales_first():
    acc, model, opt = make(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 8)).float().sum() * 10)
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    total = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm > 1.0 and total == pytest.approx(1.0, rel=1e-3)
    opt.step()  # no second unscale error


def test_accumulation_steps_only_on_sync_and_averages():
    torch.manual_seed(0)
    xs = [torch.randn(2, 8) for _ in range(4)]
    acc, model, opt = make(gradient_accumulation_steps=4)
    model, opt = acc.prepare(model, opt)
    start = model.weight.detach().clone()
    for i, x in enumerate(xs):
        with acc.accumulate(model):
            acc.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if i < 3:
                assert torch.equal(model.weight, start)
    ref = torch.nn.Linear(8, 8)
    ref.weight.data, ref.bias.data = start.clone(), acc.unwrap_model(model).bias.detach().clone()
    torch.manual_seed(0)
    ref2 = make()[1]
    ref2_opt = torch.optim.SGD(ref2.parameters(), lr=0.1)
    (sum(ref2(x).pow(2).mean() for x in xs) / 4).backward()
    ref2_opt.step()
    torch.testing.assert_close(model.weight, ref2.weight)


def test_gradient_accumulation_plugin_is_the_same_setting():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3
    with pytest.raises(ConfigError, match="disagree"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))


def test_prepare_in_separate_calls_and_any_order():
    acc, model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched_p, model_p = acc.prepare(sched, model)
    opt_p = acc.prepare(opt)
    assert sched_p.scheduler is sched and model_p is model and opt_p.optimizer is opt
    acc.backward(model_p(torch.randn(2, 8)).sum())
    opt_p.step()
    sched_p.step()
    assert sched.get_last_lr() == [0.05]


def test_scheduler_waits_for_real_optimizer_steps():
    acc, model, opt = make(gradient_accumulation_steps=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    lrs = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(2, 8)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == [0.1, 0.05, 0.05, 0.025]


def test_helpers(capsys):
    acc = Accelerator()
    acc.print("hello")
    assert capsys.readouterr().out == "hello\n"
    assert acc.on_main_process(lambda: 5)() == 5
    assert acc.on_process(lambda: 5, process_index=1)() is None
    with acc.split_between_processes({"a": [1, 2, 3]}) as part:
        assert part == {"a": [1, 2, 3]}
    assert acc.is_main_process and acc.is_local_main_process and acc.num_processes == 1
    assert acc.device == torch.device("cpu") and acc.distributed_type == "NO" and acc.strategy.name == "single"
    bar = tqdm(range(3))
    assert list(bar) == [0, 1, 2]


def test_logger_logs_on_main_process_only(caplog, monkeypatch):
    logger = get_logger("torchbay.test", log_level="INFO")
    with caplog.at_level(logging.INFO):
        logger.info("from main")
        monkeypatch.setenv("RANK", "1")
        logger.info("from rank 1")
        logger.info("everywhere", main_process_only=False)
    assert [r.message for r in caplog.records] == ["from main", "everywhere"]


def test_log_with_a_tracker_that_is_not_installed_is_refused_with_a_hint():
    with pytest.raises(ConfigError, match=r"tracking.log_with: tracker 'nosuch' is not installed "
                                          r".*no plugin torchbay publishes provides tracker 'nosuch'"):
        Accelerator(log_with="nosuch")


def test_slurm_and_mpi_environments_are_read(monkeypatch):
    from torchbay.builtin.cluster import OpenMPIEnvironment, SlurmEnvironment, expand_first_host

    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a task srun started (tests/launch/test_slurm.py: real SLURM)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[007-008],cpu1")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = SlurmEnvironment()
    assert SlurmEnvironment.detect() and (env.rank(), env.world_size(), env.local_rank()) == (3, 8, 1)
    assert env.main_address() == "gpu007" and env.main_port() == 13456
    assert expand_first_host("node1") == "node1"
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    mpi = OpenMPIEnvironment()
    assert OpenMPIEnvironment.detect() and (mpi.rank(), mpi.world_size()) == (2, 4)


def test_the_strategy_holds_its_collectives_and_their_works_do_not_pickle():
    """issue 37 item 4: the collectives and the works they keep are an object the Strategy base holds; its
    collective methods hand over to it (no-ops in one process)."""
    import pickle
    import threading

    from torchbay.distributed.collectives import ProcessCollectives

    acc = Accelerator(cpu=True)
    strategy = acc.strategy
    collectives = strategy.collectives
    assert isinstance(collectives, ProcessCollectives) and collectives.member is strategy
    assert collectives.keep == type(strategy).held_works and collectives.held == ()
    tensor = torch.ones(2)
    assert strategy.all_reduce(tensor) is tensor and strategy.all_gather_object(3) == [3]
    assert acc.reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # the Accelerator goes through the strategy's methods
    collectives.held = (threading.Lock(),)  # a kept work does not pickle either: it is left behind
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy.collectives.held == () and copy.collectives.member is copy and collectives.held
    strategy.teardown()
    assert collectives.held == ()
    acc.end_training()
