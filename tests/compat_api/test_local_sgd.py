"""LocalSGD with 2 real gloo processes, on Accelerate and on torchbay side by side: the same loop gives the same
parameters, which differ between processes between averagings and agree after each."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import torchbay
from torchbay.errors import ConfigError

accelerate = pytest.importorskip("accelerate", reason="Accelerate (a dev dependency) is the reference")
import accelerate.local_sgd as acc_local_sgd  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS, EVERY = 5, 2


def _loop(side, out_dir):
    if side == "torchbay":
        accelerator, local_sgd_cls = torchbay.Accelerator(cpu=True), torchbay.LocalSGD
    else:
        accelerator, local_sgd_cls = accelerate.Accelerator(cpu=True), acc_local_sgd.LocalSGD
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(10 + rank)  # each process its own batches
    after = []
    with local_sgd_cls(accelerator=accelerator, model=model, local_sgd_steps=EVERY, enabled=True) as local_sgd:
        for _ in range(STEPS):
            x = torch.randn(8, 4, generator=data)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            after.append(accelerator.unwrap_model(model).weight.detach().flatten().tolist())
    final = accelerator.unwrap_model(model).weight.detach().flatten().tolist()
    with open(f"{out_dir}/{side}_{rank}.json", "w") as f:
        json.dump({"after": after, "final": final}, f)


def _launch(side: str, out_dir) -> None:
    """Two fresh processes under torchrun (not forks of this test process, whose state earlier tests changed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "ACCELERATE_"))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, side, str(out_dir)],
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_sgd_averages_every_n_steps_as_accelerate(tmp_path):
    _launch("accelerate", tmp_path)
    _launch("torchbay", tmp_path)
    results = {(side, r): json.loads((tmp_path / f"{side}_{r}.json").read_text())
               for side in ("accelerate", "torchbay") for r in range(2)}
    for side in ("accelerate", "torchbay"):
        r0, r1 = results[side, 0], results[side, 1]
        for step in range(STEPS):
            averaged = (step + 1) % EVERY == 0
            assert (r0["after"][step] == pytest.approx(r1["after"][step])) is averaged, (side, step)
        assert r0["final"] == pytest.approx(r1["final"])  # averaged once more when the block ends
    for r in range(2):
        assert results["torchbay", r]["final"] == pytest.approx(results["accelerate", r]["final"], abs=1e-6)


def test_local_sgd_does_nothing_with_one_process():
    acc = torchbay.Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 1))
    with torchbay.LocalSGD(accelerator=acc, model=model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 1
    with pytest.raises(ConfigError, match="local_sgd_steps"):
        torchbay.LocalSGD(accelerator=acc, model=model, local_sgd_steps=0)


def test_accelerate_local_sgd_is_served_under_the_switch():
    from torchbay.switch.finder import MODULES

    assert MODULES["accelerate.local_sgd"] == "torchbay.accelerator.local_sgd"
    from torchbay.accelerator import local_sgd

    assert local_sgd.LocalSGD is torchbay.LocalSGD and local_sgd.Accelerator is torchbay.Accelerator
    assert local_sgd.DistributedType is torchbay.DistributedType


if __name__ == "__main__":  # one rank of _launch
    _loop(sys.argv[1], sys.argv[2])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
