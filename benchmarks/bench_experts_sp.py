"""Expert parallel and Ulysses sequence parallel on CPU (gloo): per-rank memory and step time, torchbay against the
same model driven by raw torch on the same mesh (torch's fully_shard and torchbay_fsdp's Ulysses / expert functions
called directly, no Accelerator).

    python benchmarks/bench_experts_sp.py [--steps 6] [--seq 1024] [--rounds 3]

Rows (one torchrun launch each):

- ``sp1`` (1 process: the whole sequence) and ``sp2`` (2 processes, sp 2): a Llama-style transformers model
  (2 layers, width 256, 8 heads), one sequence of ``--seq`` tokens per step;
- ``ep1`` (dp_shard 2) and ``ep2`` (dp_shard 2, ep 2): a torchtitan-style MoE (2 layers, width 128, 8 experts,
  top-2), a batch of 4 x 256 tokens per rank.

Per rank: ``param MB`` (the parameters each rank holds: local shards), ``gathered experts MB`` (expert weights
present in the expert modules' forward, measured in a forward pre-hook), ``activations MB`` (tensors saved for
backward in one forward, measured with saved-tensor hooks), and the median step time of torchbay and of raw torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "plugins", "fsdp", "tests", "scripts")


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8192,
                                        attn_implementation="sdpa"))


def _moe():
    sys.path.insert(0, SCRIPTS)
    import experts_train as moe
    import torch

    moe.DIM, moe.EXPERTS, moe.HEADS = 128, 8, 4
    torch.manual_seed(0)
    return moe.TinyMoE()


def _saved_bytes(fn) -> int:
    import torch

    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    return total[0]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sp, ep, raw = args.case.startswith("sp"), args.case == "ep2", args.raw
    model = _llama() if sp else _moe()
    gathered = [0]
    for name, module in model.named_modules():
        if name.endswith("experts"):
            module.register_forward_pre_hook(lambda m, a: gathered.__setitem__(
                0, max(gathered[0], sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)))))
    g = torch.Generator().manual_seed(1)
    if sp:
        ids = torch.randint(0, 1024, (1, args.seq), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
    else:
        ids = torch.randint(0, 32, (4, 257), generator=g)
    if raw:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if sp and world > 1:
            from torchbay_fsdp.ulysses import apply_ulysses
            from torchbay_fsdp.ulysses.batches import shard_batch

            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
            apply_ulysses(model, mesh["sp"].get_group(), world)
            batch = shard_batch(batch, rank, world)
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        if ep:
            from torchbay_fsdp.experts import apply_expert_parallel, expert_mesh

            emesh = expert_mesh("cpu", 1, world, 2)
            found, _ = apply_expert_parallel(model, None, emesh["ep"].get_group(), emesh.get_local_rank("ep"), 2)
            for module in found.values():
                fully_shard(module, mesh=emesh["dp_shard_mod_ep"])
                module.set_gradient_divide_factor(float(world))
        blocks = model.model.layers if sp else model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = [batch] * args.steps if sp else [ids] * args.steps
        is_main = rank == 0
    else:
        from torchbay import Accelerator, ParallelismConfig

        pc = (ParallelismConfig(sp_size=2) if args.case == "sp2" else ParallelismConfig(dp_shard_size=2, ep_size=2)
              if ep else None)
        acc = Accelerator(strategy="fsdp", parallelism_config=pc)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = [batch] * args.steps if sp else list(ids.repeat(acc.num_processes * args.steps, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=None if sp else 4)
        model, opt, loader = acc.prepare(model, opt, loader)
        batches = list(loader)
        is_main = acc.is_main_process

    def loss_of(b):
        if sp:
            return model(**b).loss
        logits = model(b[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    activations = _saved_bytes(lambda: loss_of(batches[0]))
    opt.zero_grad()
    times = []
    for b in batches:
        start = time.perf_counter()
        loss_of(b).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    if is_main:
        with open(args.out, "w") as f:
            json.dump({"param_mb": params / 2**20, "gathered_experts_mb": gathered[0] / 2**20,
                       "activations_mb": activations / 2**20, "step_s": statistics.median(times[1:])}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--case")
    parser.add_argument("--raw", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    procs = {"sp1": 1, "sp2": 2, "ep1": 2, "ep2": 2}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run, n in procs.items():
            row, ratios = {}, []
            for round_ in range(args.rounds):  # torchbay then raw, again: the ratio of each pair, then the median
                pair = {}
                for raw in (False, True):
                    out = os.path.join(tmp, f"{run}{raw}{round_}.json")
                    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                           "--master-port=29655", __file__, "--worker", "--case", run, "--out", out, "--steps",
                           str(args.steps), "--seq", str(args.seq)] + (["--raw"] if raw else [])
                    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                    got = json.load(open(out))
                    pair[raw] = got.pop("step_s")
                    row.update(got if not raw else {})
                ratios.append(pair[False] / pair[True])
                row.setdefault("step_s", []).append(pair[False])
                row.setdefault("raw_step_s", []).append(pair[True])
            row.update(step_s=statistics.median(row["step_s"]), raw_step_s=statistics.median(row["raw_step_s"]),
                       ratio=statistics.median(ratios), spread=(min(ratios), max(ratios)))
            rows[run] = row
    print(f"bench_experts_sp: {args.steps} steps (median of the last {args.steps - 1}), median of {args.rounds} "
          f"rounds alternating torchbay and raw torch")
    print("| run | processes | param MB / rank | gathered experts MB | activations MB / rank | torchbay step s | "
          "raw torch step s | torchbay / raw (min-max) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run, r in rows.items():
        print(f"| {run} | {procs[run]} | {r['param_mb']:.2f} | {r['gathered_experts_mb']:.2f} | "
              f"{r['activations_mb']:.1f} | {r['step_s']:.4f} | {r['raw_step_s']:.4f} | "
              f"{r['ratio']:.3f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) |")

if __name__ == "__main__":
    main()
