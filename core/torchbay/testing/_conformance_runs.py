"""The conformance checks that start processes or train: collectives and train/save/load/resume."""


import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from torchbay import Accelerator
from torchbay.testing._conformance_base import (
    ConformanceSkip,
    _device_class,
    _draw,
    _fail,
    _first,
    _plugin_manager,
    _require_available,
    _single_process_env,
)
from torchbay.testing.processes import free_port
from torchbay.utils import set_seed

# --- 2 processes ---------------------------------------------------------------------------

_COLLECTIVE_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from torchbay import Accelerator

device, out_dir = sys.argv[1], sys.argv[2]
acc = Accelerator(device=device, seed=0)
rank, world = acc.process_index, acc.num_processes
t = torch.tensor([float(rank + 1)], device=acc.device)
summed = acc.reduce(t.clone(), "sum")
gathered = acc.gather(t.clone())
b = torch.tensor([float(rank + 10)], device=acc.device)
acc.strategy.broadcast(b, src=0)
obj = acc.strategy.broadcast_object({"from": rank}, src=0)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
x = torch.full((2, 4), float(rank + 1), device=acc.device)
loss = model(x).pow(2).mean()
acc.backward(loss)
opt.step()
opt.zero_grad()
params = [p.detach().float().cpu().flatten().tolist() for p in acc.unwrap_model(model).parameters()]
result = {
    "rank": rank, "world": world, "device": str(acc.device), "device_type": acc.device.type,
    "tensor_device_type": summed.device.type,
    "backend": str(dist.get_backend()) if dist.is_initialized() else None,
    "sum": summed.cpu().tolist(), "gathered": gathered.cpu().tolist(), "broadcast": b.cpu().tolist(),
    "object": obj, "params": params, "strategy": acc.strategy.name,
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
acc.end_training()
'''


def _launch_command(script: str, nprocs: int, args: Sequence[str], port: int) -> tuple[list[str], str]:
    if importlib.util.find_spec("torchbay.cli.launch") is not None:
        return ([sys.executable, "-m", "torchbay.cli.main", "launch", "--num-processes", str(nprocs), script, *args],
                "torchbay launch")
    return ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
             f"--master-port={port}", "--master-addr=127.0.0.1", script, *args],
            "torch.distributed.run (torchbay launch is not installed)")


def check_collectives(name: str, pm=None, env: dict[str, str] | None = None, timeout: float = 240, **_: Any) -> str:
    """Two real processes: reduce, gather, broadcast and one DDP step agree across ranks."""
    cls = _device_class(name, pm)
    _require_available(cls)
    if not getattr(cls, "multi_process", True):
        raise ConformanceSkip(f"device '{name}' declares multi_process = False (it runs one process)")
    if cls.torch_type() != "cpu" and cls.device_count() < 2:
        raise ConformanceSkip(f"the 2-process check needs 2 '{name}' devices on this machine, "
                              f"found {cls.device_count()}")
    with tempfile.TemporaryDirectory(prefix="torchbay-conformance-") as tmp:
        script = Path(tmp) / "collectives.py"
        script.write_text(_COLLECTIVE_SCRIPT)
        out = Path(tmp) / "out"
        out.mkdir()

        port = free_port()
        cmd, how = _launch_command(str(script), 2, [name, str(out)], port)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHBAY_DEVICE": name,
                    "TORCHBAY_LAUNCH__MAIN_PROCESS_PORT": str(port), "TORCHBAY_LAUNCH__MAIN_PROCESS_IP": "127.0.0.1",
                    **(env or {})}
        for key in ("TORCHBAY_RESOLVED_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            full_env.pop(key, None)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            _fail(f"2-process run through {how} did not finish in {timeout:.0f}s (a collective hangs?)\n"
                  f"--- stderr\n{(exc.stderr or b'')[-3000:]!r}")
        if proc.returncode != 0:
            _fail(f"2-process run through {how} exited with {proc.returncode}\n--- command: {' '.join(cmd)}\n"
                  f"--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-4000:]}")
        results = {}
        for rank in (0, 1):
            path = out / f"rank{rank}.json"
            if not path.exists():
                _fail(f"2-process run through {how}: rank {rank} wrote no result\n--- stderr\n{proc.stderr[-3000:]}")
            results[rank] = json.loads(path.read_text())
    problems = []
    for rank, r in results.items():
        if r["world"] != 2:
            problems.append(f"rank {rank} sees num_processes={r['world']}, expected 2")
        if r["device_type"] != cls.torch_type():
            problems.append(f"rank {rank} runs on {r['device']}, expected a '{cls.torch_type()}' device")
        if r["tensor_device_type"] != cls.torch_type():
            problems.append(f"rank {rank}: reduce returned a tensor on '{r['tensor_device_type']}'")
        expected_backend = "gloo" if cls.torch_type() == "cpu" else cls.dist_backend()
        if r["backend"] != expected_backend:
            problems.append(f"rank {rank}: process group backend is {r['backend']!r}, "
                            f"dist_backend() says {expected_backend!r}")
        if r["sum"] != [3.0]:
            problems.append(f"rank {rank}: all_reduce(sum) of [1] and [2] gave {r['sum']}, expected [3.0]")
        if r["gathered"] != [1.0, 2.0]:
            problems.append(f"rank {rank}: all_gather gave {r['gathered']}, expected [1.0, 2.0]")
        if r["broadcast"] != [10.0]:
            problems.append(f"rank {rank}: broadcast from rank 0 gave {r['broadcast']}, expected [10.0]")
        if r["object"] != {"from": 0}:
            problems.append(f"rank {rank}: broadcast_object gave {r['object']}")
    if results[0]["params"] != results[1]["params"]:
        problems.append(f"after one {results[0]['strategy']} step the ranks hold different weights "
                        f"({results[0]['params'][0][:3]}... vs {results[1]['params'][0][:3]}...): gradients were "
                        f"not averaged across processes")
    if problems:
        _fail(f"2-process run through {how}: " + "; ".join(problems))
    return f"2 processes via {how}: reduce, gather, broadcast, DDP step agree (backend {results[0]['backend']})"


# --- train / save / load / resume ------------------------------------------------------------

STEPS, SAVE_AFTER, BATCH, SAMPLES = 8, 5, 4, 16


def _isolated_batches(source):
    """Batches of ``source``, fetched so that the loader's own draw does not move the CPU stream.

    torch's DataLoader draws a base seed from the global CPU generator whenever an iterator
    is created; a run resumed mid-epoch creates it at another point of the stream than the
    uninterrupted run. That is a data-loader matter, not the device's, so the kit keeps it
    out of the comparison.
    """
    iterator = iter(source)
    while True:
        with torch.random.fork_rng(devices=[]):
            batch = next(iterator, None)
        if batch is None:
            return
        yield batch


def _train_run(name: str, *, seed: int, steps: range, mixed_precision: str, save_to: Path | None = None,
               load_from: Path | None = None) -> dict[str, Any]:
    """One run of a small loop that uses the device RNG (noise, dropout) and a shuffled loader."""
    acc = Accelerator(device=name, strategy="single", mixed_precision=mixed_precision, seed=seed)
    try:
        acc.device_backend.manual_seed(seed)
        set_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(16, 1))
        data_gen = torch.Generator().manual_seed(0)
        xs, ys = torch.randn(SAMPLES, 8, generator=data_gen), torch.randn(SAMPLES, 1, generator=data_gen)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH, shuffle=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        losses: dict[int, torch.Tensor] = {}
        probe = None
        step = 0
        if load_from is not None:
            with torch.no_grad():  # make a restore that leaves anything out visible
                for p in acc.unwrap_model(model).parameters():
                    p.add_(1.0)
            _draw(acc.device, 100)
            acc.load_state(str(load_from))
            step = steps.start
            probe = _draw(acc.device, 8)
        batches_per_epoch = len(loader)
        while step < steps.stop:
            skip = step % batches_per_epoch
            source = (acc.skip_first_batches(loader, skip) if skip and load_from is not None and step == steps.start
                      else loader)
            for x, y in _isolated_batches(source):
                noise = torch.randn(x.shape, device=x.device) * 0.01
                with acc.autocast():
                    out = model(x + noise)
                loss = torch.nn.functional.mse_loss(out.float(), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                losses[step] = loss.detach().float().cpu()
                if step == SAVE_AFTER and load_from is None:
                    if save_to is not None:
                        acc.save_state(str(save_to))
                    probe = _draw(acc.device, 8)
                if step >= steps.stop:
                    break
        params = {k: v.detach().float().cpu().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
        return {"losses": losses, "params": params, "probe": probe}
    finally:
        acc.end_training()


def _compare_runs(reference: dict, resumed: dict, mixed_precision: str) -> None:
    for step in range(SAVE_AFTER + 1, STEPS + 1):
        a, b = reference["losses"][step], resumed["losses"].get(step)
        if b is None or not torch.equal(a, b):
            _fail(f"resume ({mixed_precision}): step {step} after load_state gave loss "
                  f"{None if b is None else float(b)!r} "
                  f"but the uninterrupted run gave {float(a)!r}; "
                  "resuming from save_state must reproduce the run exactly")
    for key, value in reference["params"].items():
        other = resumed["params"][key]
        if not torch.equal(value, other):
            _fail(f"resume ({mixed_precision}): final weight '{key}' differs from the uninterrupted run "
                  f"(max abs diff {float((value - other).abs().max()):.3g})")


def check_train_resume(name: str, pm=None, **_: Any) -> str:
    """Train, save_state, load_state into a fresh run, finish: equal to the uninterrupted run."""
    cls = _device_class(name, pm)
    _require_available(cls)
    modes = ["no"] + (["bf16"] if cls.supports_autocast(torch.bfloat16) else [])
    with _plugin_manager(pm), _single_process_env(), tempfile.TemporaryDirectory(prefix="torchbay-resume-") as tmp:
        for mode in modes:
            state_dir = Path(tmp) / f"state_{mode}"
            reference = _train_run(name, seed=3, steps=range(0, STEPS), mixed_precision=mode)
            interrupted = _train_run(name, seed=3, steps=range(0, SAVE_AFTER), mixed_precision=mode, save_to=state_dir)
            if not torch.equal(reference["probe"], interrupted["probe"]):
                _fail(f"resume ({mode}): save_state changed the device random stream (draws right after it differ "
                      f"from an uninterrupted run): get_rng_state() must not consume random numbers")
            for step in range(1, SAVE_AFTER + 1):
                if not torch.equal(reference["losses"][step], interrupted["losses"][step]):
                    _fail(f"resume ({mode}): two runs with the same seed differ at step {step} before any save "
                          f"({float(reference['losses'][step])!r} vs {float(interrupted['losses'][step])!r}): "
                          f"seeding is not deterministic on this device")
            resumed = _train_run(name, seed=3, steps=range(SAVE_AFTER, STEPS), mixed_precision=mode,
                                 load_from=state_dir)
            if not torch.equal(resumed["probe"], interrupted["probe"]):
                _fail(f"resume ({mode}): after load_state the device random stream is not the one saved "
                      f"(next draws {_first(resumed['probe'])}..., saved run drew {_first(interrupted['probe'])}...): "
                      f"{cls.__qualname__}.set_rng_state did not restore what get_rng_state saved")
            _compare_runs(reference, resumed, mode)
    return (f"train/save/load/resume equals the uninterrupted run ({', '.join(modes)}; {STEPS} steps, "
            f"saved after {SAVE_AFTER})")
