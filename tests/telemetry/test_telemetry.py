"""Telemetry (docs/telemetry.md): FLOPs counted on a small GPT against the analytic count, the metrics in the jsonl
file with their names and steps, MFU absent (not zero) when the peak is unknown, a device's ``peak_flops`` used, the
progress bar's tokens/s, and the OOM report."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchbay import Accelerator
from torchbay.builtin.cpu import CPUBackend
from torchbay.telemetry.flops import count_flops, parameter_count, transformer_estimate
from torchbay.telemetry.memory import oom_report
from torchbay.tracking.jsonl import read_jsonl

VOCAB, DIM, LAYERS, SEQ = 64, 32, 2, 16


class Block(nn.Module):
    """Attention written as plain matmuls (so the analytic count is exact) and an MLP; no biases."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(DIM)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.out(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v)
        return x + self.down(torch.relu(self.up(x)))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Tokens(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.arange(SEQ) * (i + 1) % VOCAB
        return {"input_ids": ids, "labels": ids.roll(-1)}


def analytic_step_flops(batch: int) -> int:
    """Forward + backward FLOPs of one step: every matmul weight 6 x tokens (2 forward, 4 backward), and the two
    attention products (q k^T and p v, 2 x seq^2 x dim each forward) 3 x their forward."""
    tokens = batch * SEQ
    matmul_params = LAYERS * (3 * DIM * DIM + DIM * DIM + 8 * DIM * DIM) + DIM * VOCAB
    attention_forward = LAYERS * 2 * (2 * batch * SEQ * SEQ * DIM)
    return 6 * matmul_params * tokens + 3 * attention_forward


def test_counted_flops_equal_the_analytic_count_and_6nt_is_beside_it():
    model, batch = TinyGPT(), Tokens()[0]
    ids = torch.stack([batch["input_ids"]] * 4)

    def step():
        model(ids, ids.roll(-1, 1)).backward()

    counted = count_flops(step)
    analytic = analytic_step_flops(4)
    assert counted == pytest.approx(analytic, rel=1e-3)  # stated tolerance: 0.1% (exact here: plain matmuls)
    # 6 x parameters x tokens counts the embedding (no FLOPs) and leaves attention's products out: 25% off here
    estimate = transformer_estimate(parameter_count([model]), 4 * SEQ)
    assert estimate == pytest.approx(analytic, rel=0.25)


def test_count_on_meta_tensors_costs_no_memory():
    with torch.device("meta"):
        model = TinyGPT()
        ids = torch.zeros(4, SEQ, dtype=torch.long)
    assert count_flops(lambda: model(ids, ids).backward()) == pytest.approx(analytic_step_flops(4), rel=1e-3)


def _train(tmp_path, steps=7, every=3, bar=None, **telemetry):
    acc = Accelerator(project_dir=str(tmp_path), log_with="jsonl", device="cpu",
                      config={"telemetry": {"enabled": True, "every_n_steps": every, **telemetry}})
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Tokens(), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.init_trackers("run")
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        acc.backward(model(**batch))
        opt.step()
        opt.zero_grad()
        if bar is not None:
            bar.update(1)
    batches.close()
    acc.end_training()
    records = [r for r in read_jsonl(tmp_path / "logs" / "jsonl" / "run" / "metrics.jsonl") if "values" in r]
    return {r["step"]: r["values"] for r in records}


def test_metrics_reach_the_jsonl_file_with_their_names_and_steps(tmp_path):
    logged = _train(tmp_path)
    assert sorted(logged) == [1, 3, 6]  # the counting step, then every 3 optimizer steps
    first = logged[1]
    assert first["flops/counted_per_step"] == pytest.approx(analytic_step_flops(4), rel=1e-3)
    assert first["flops/6nt_per_step"] == transformer_estimate(parameter_count([TinyGPT()]), 4 * SEQ)
    assert first["memory/estimate_gib"] > 0 and first["memory/rank0/peak_gib"] > 0
    for step in (3, 6):
        values = logged[step]
        for name in ("time/step_time_s", "time/data_wait_s", "throughput/samples_per_s", "throughput/tokens_per_s",
                     "throughput/tflops", "memory/rank0/current_gib", "memory/rank0/peak_gib"):
            assert values[name] > 0, name
        assert values["throughput/tokens_per_s"] == pytest.approx(values["throughput/samples_per_s"] * SEQ)
        # the cpu's peak is unknown: no MFU at all, never 0
        assert "throughput/mfu" not in values and "throughput/peak_tflops" not in first


def test_the_progress_bar_shows_tokens_per_second(tmp_path):
    import io

    from torchbay.tracking.progress import progress_bar

    bar = progress_bar(total=4, file=io.StringIO())
    _train(tmp_path, steps=4, every=3, bar=bar)
    assert bar.postfix.endswith("tok/s")
    bar.close()


def test_a_plugin_s_peak_flops_gives_mfu(tmp_path, monkeypatch):
    asked = []

    def peak(self, dtype):
        asked.append(dtype)
        return 1e12

    monkeypatch.setattr(CPUBackend, "peak_flops", peak)  # a device that publishes 1 TFLOP/s for fp32
    logged = _train(tmp_path, steps=4, every=3)
    assert asked == ["fp32"] and logged[1]["throughput/peak_tflops"] == 1.0
    values = logged[3]
    assert values["throughput/mfu"] == pytest.approx(values["throughput/tflops"] / 1.0)


def test_stated_peak_and_flops_win(tmp_path):
    logged = _train(tmp_path, steps=4, every=3, peak_tflops=2.0, flops_per_step=1e9)
    assert logged[1]["flops/stated_per_step"] == 1e9 and "flops/counted_per_step" not in logged[1]
    values = logged[3]
    assert values["throughput/tflops"] == pytest.approx(1e9 / values["time/step_time_s"] / 1e12, rel=1e-6)
    assert values["throughput/mfu"] == pytest.approx(values["throughput/tflops"] / 2.0)


def test_oom_report_names_each_part():
    model = nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 256)).sum().backward()
    opt.step()
    report = oom_report([model], [opt], CPUBackend())
    assert "parameters" in report and "gradients" in report and "optimizer" in report
    params = (256 * 256 + 256) * 4
    assert f"{params / 2**30:9.3f} GiB" in report.splitlines()[1]
    assert f"{2 * params / 2**30:9.3f} GiB" in report.splitlines()[3]  # Adam's two moments


def test_an_oom_in_backward_carries_the_report():
    acc = Accelerator(device="cpu")
    model = nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(torch.OutOfMemoryError) as caught:
        acc.backward(Boom.apply(model(torch.ones(1, 4))).sum())
    assert any("out of memory on rank 0" in note and "parameters" in note for note in caught.value.__notes__)
    acc.end_training()


def test_plot_draws_the_telemetry(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from torchbay.cli.main import main
    from torchbay.cli.plot import collect, panels

    _train(tmp_path, steps=4, every=3)
    assert main(["plot", str(tmp_path), "--telemetry"]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG" and "wrote" in capsys.readouterr().out
    series, _ = collect(str(tmp_path), None)
    assert [step for step, _ in series["throughput/tokens_per_s"]] == [3]
    assert panels({"memory/rank0/peak_gib": [], "memory/rank1/peak_gib": []}) == \
        {"peak_gib": ["memory/rank0/peak_gib", "memory/rank1/peak_gib"]}


def test_without_the_jsonl_tracker_telemetry_writes_its_own_file(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), device="cpu",
                      config={"telemetry": {"enabled": True, "every_n_steps": 2}})
    model = TinyGPT()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(Tokens(), batch_size=2))
    for step, batch in enumerate(loader):
        if step == 2:
            break
        acc.backward(model(**batch))
        opt.step()
    acc.end_training()
    records = read_jsonl(tmp_path / "logs" / "telemetry" / "metrics.jsonl")
    assert [r["step"] for r in records if "values" in r] == [1, 2]
    assert records[-1] == {"event": "finish", "time": records[-1]["time"]}


def test_a_compiled_model_gets_no_count_rather_than_a_wrong_one(tmp_path, caplog):
    from torchbay.telemetry.monitor import compiled_module

    model = TinyGPT()
    assert compiled_module([model]) is None
    model.blocks[0].compile(backend="eager")  # compiled in place, as compile.regional does
    assert compiled_module([model]) == "blocks.0"
    assert compiled_module([torch.compile(nn.Linear(2, 2), backend="eager")]) == "OptimizedModule"
    from torchbay.compile.compiler import compile_in_place

    assert compiled_module([nn.Sequential(compile_in_place(nn.Linear(2, 2), backend="eager"))]) == "0"


def test_two_processes_log_every_rank_s_memory(tmp_path):
    from torchbay.testing import telemetry_run
    from torchbay.testing.processes import run_torchrun

    result = run_torchrun(telemetry_run.__file__, 2, ["--project-dir", str(tmp_path)], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in read_jsonl(tmp_path / "logs" / "jsonl" / "telemetry" / "metrics.jsonl") if "values" in r]
    assert [r["step"] for r in records] == [1, 3]  # written once, by the main process
    for record in records:
        for rank in (0, 1):
            assert record["values"][f"memory/rank{rank}/peak_gib"] > 0


def test_without_a_prepared_loader_only_what_is_known_is_logged(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), device="cpu", log_with="jsonl",
                      config={"telemetry": {"enabled": True, "every_n_steps": 2, "flops_per_step": 1e6}})
    model = nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.init_trackers("run")
    for _ in range(2):
        acc.backward(model(torch.ones(2, 4)).sum())
        opt.step()
    acc.end_training()
    (window,) = [r["values"] for r in read_jsonl(tmp_path / "logs" / "jsonl" / "run" / "metrics.jsonl")
                 if r.get("step") == 2]
    assert window["time/step_time_s"] > 0 and window["throughput/tflops"] > 0  # stated FLOPs per step
    assert not {"throughput/samples_per_s", "time/data_wait_s", "throughput/tokens_per_s"} & set(window)


def test_telemetry_off_puts_nothing_on_the_step():
    acc = Accelerator(device="cpu")
    model = nn.Linear(4, 4)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(Tokens(), batch_size=2))
    assert acc.telemetry is None and loader._batch_watch is None
    batches = iter(loader)
    assert type(batches).__name__ == "generator" and batches.gi_code.co_name == "_iterate"  # the loader's own
    batches.close()
    acc.end_training()


def test_a_device_that_writes_allocator_snapshots_gets_them_after_the_first_step_and_on_oom(tmp_path, monkeypatch):
    recorded = []

    def record(self, entries):
        recorded.append(entries)
        return True

    def dump(self, path):
        with open(path, "wb") as f:
            f.write(b"snapshot")
        return True

    monkeypatch.setattr(CPUBackend, "record_memory_history", record)
    monkeypatch.setattr(CPUBackend, "dump_memory_snapshot", dump)
    _train(tmp_path, steps=2, every=3, memory_snapshot=True, memory_snapshot_entries=5)
    assert recorded == [5]
    folder = tmp_path / "logs" / "telemetry"
    assert (folder / "memory_snapshot.rank0.step1.pickle").read_bytes() == b"snapshot"
    acc = Accelerator(project_dir=str(tmp_path), device="cpu",
                      config={"telemetry": {"enabled": True, "memory_snapshot": True}})
    error = torch.OutOfMemoryError("out of memory")
    acc.explain_oom(error)
    acc.end_training()
    assert "allocator snapshot: " + str(folder / "memory_snapshot.oom.rank0.pickle") in error.__notes__[0]
    acc.explain_oom(error)
    assert len(error.__notes__) == 1  # once per error


def test_an_oom_that_ends_the_program_carries_the_report(tmp_path):
    from torchbay.testing.processes import run_python

    script = tmp_path / "oom.py"
    script.write_text("import torch\nfrom torchbay import Accelerator\nacc = Accelerator(device='cpu')\n"
                      "model = acc.prepare(torch.nn.Linear(8, 8))\n"
                      "raise torch.OutOfMemoryError('out of memory in the forward')\n")
    result = run_python(str(script), timeout=120)
    assert result.returncode == 1
    assert "OutOfMemoryError: out of memory in the forward" in result.stderr
    assert "torchbay: out of memory on rank 0 (cpu); what it held:" in result.stderr
