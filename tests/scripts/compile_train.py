"""Worker for tests/compile/test_compile.py: a small stack of residual blocks trained through the public
API with the ``compile`` section off, whole-model and regional, for each strategy of
``--strategies`` (``single``, or ``ddp,fsdp`` under torchrun, sharing one process group).

The compiled runs use the backend ``torchbay_counting``: aot_eager (the same kernels as eager,
so losses agree bit for bit) that counts the graphs it is given. Under DDP, torch splits the
graph at each gradient bucket (1 MB for the first, so this 1.6 MB model gives two graphs or more):
that shows the compiled code ran inside DDP's forward. With torchbay-fp8-torchao installed, the
same model also trains in emulated FP8, eager and compiled (conversion, then the strategy, then
compile). Writes ``<out>.<strategy>.rank<r>.json``.
"""

import argparse
import importlib.util
import json

import torch

from torchbay import Accelerator

WIDTH = 256
BLOCKS = 6
GRAPHS: list[int] = []
HAS_TORCHAO = importlib.util.find_spec("torchbay_fp8_torchao") is not None
LAST: list = []  # the latest Accelerator, whose end_training tears the process group down


@torch._dynamo.register_backend(name="torchbay_counting")
def counting_backend(gm, example_inputs):
    GRAPHS.append(len(gm.graph.nodes))
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.linear(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(rank: int, steps: int):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(steps)]


def run(strategy: str, compile_section: dict | None, accumulation: int = 1, steps: int = 4,
        mixed_precision: str = "no") -> dict:
    config = {"compile": compile_section or {"enabled": False}}
    if strategy == "fsdp":
        config["fsdp"] = {"transformer_layer_cls_to_wrap": ["Block"]}
    if mixed_precision == "fp8":  # torchao, emulated: its Float8 Linears, then the strategy, then compile
        config["fp8"] = {"backend": "torchao", "engine_options": {"emulate": True}}
    acc = Accelerator(strategy=strategy, seed=0, gradient_accumulation_steps=accumulation, config=config,
                      mixed_precision=mixed_precision)
    LAST[:] = [acc]
    torch.manual_seed(1)
    user_model = Net()
    optimizer = torch.optim.SGD(user_model.parameters(), lr=0.01)
    model, optimizer = acc.prepare(user_model, optimizer)
    before = len(GRAPHS)
    losses = []
    for x, y in batches(acc.process_index, steps * accumulation):
        x, y = x.to(acc.device), y.to(acc.device)
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    state = acc.get_state_dict(model)
    return {"losses": losses, "graphs": GRAPHS[before:], "compiled": acc._compiler.compiled,
            "unwrapped_is_user_module": acc.unwrap_model(model) is user_model,
            "state_keys": sorted(state), "weight_sum": float(sum(v.double().sum() for v in state.values())),
            "rank": acc.process_index, "world": acc.num_processes,
            "converted": getattr(acc.precision, "converted", None),
            "fp8_weights": acc.precision.fsdp_float8_weights() if mixed_precision == "fp8" else []}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--strategies", default="single")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for strategy in args.strategies.split(","):
        counting = {"enabled": True, "backend": "torchbay_counting"}
        result = {"eager": run(strategy, None), "whole": run(strategy, counting),
                  "regional": run(strategy, {**counting, "regional": True})}
        if HAS_TORCHAO:
            result["fp8_eager"] = run(strategy, None, mixed_precision="fp8")
            result["fp8_compiled"] = run(strategy, counting, mixed_precision="fp8")
        if strategy != "fsdp":
            result["eager_accumulate"] = run(strategy, None, accumulation=2, steps=2)
            result["whole_accumulate"] = run(strategy, counting, accumulation=2, steps=2)
        rank = result["eager"]["rank"]
        with open(f"{args.out}.{strategy}.rank{rank}.json", "w") as f:
            json.dump(result, f)
    if LAST and LAST[0].num_processes > 1:
        LAST[0].end_training()


if __name__ == "__main__":
    main()
