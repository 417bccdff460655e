"""Big-model loading side by side in one run: raw torch, Accelerate 1.15 and torchbay.

A 1 GB fp32 model (16 x Linear(4096, 4096)) is saved as 4 safetensors shards with a Hugging
Face index in a temporary folder (generated here, never downloaded). Each case runs in a
fresh subprocess and measures, from a state where everything is imported, the time until one
forward pass has run, the peak resident memory above the pre-load RSS (VmHWM, reset first),
and the growth of anonymous (non-file) memory after the forward (RssAnon: copies, as opposed
to pages of the mapped checkpoint):

- raw:        model = Net(); model.load_state_dict(merged safetensors.load_file of every shard)
- raw assign: Net() built on the meta device, each shard's load_file, load_state_dict(assign=True):
              the fastest plain-torch load, issue 27's reference (torchbay within 1.05x of it)
- accelerate: init_empty_weights + load_checkpoint_and_dispatch(device_map="auto")
- torchbay:   the same names from torchbay
- torchbay cold: the same, with the discovery of torchbay's plugins (pydantic, the config
              sections, the device registry) inside the timed part instead of before it
- ... disk:   max_memory={"cpu": "300MB"} and an offload_folder (most of the model waits on disk)

Rounds interleave the cases (rotating their order) so that noise hits each alike; the ratios
are medians over rounds of case / raw. Every case's output must equal raw's.

    python benchmarks/bench_big_model.py [--rounds 5] [--layers 16]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

WIDTH = 4096

CHILD = r"""
import json, os, sys, time
import torch
from torch import nn

case, folder, layers, offload = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(%(width)d, %(width)d) for _ in range(layers))
    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0

if case.startswith("raw"):
    from safetensors.torch import load_file
elif case.startswith("accelerate"):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
else:
    from torchbay import init_empty_weights, load_checkpoint_and_dispatch
    if not case.endswith("cold"):  # the device plugins found first, as importing accelerate finds its devices
        from torchbay.registry.manager import get_plugin_manager
        get_plugin_manager().registries()
x = torch.ones(1, %(width)d)
torch.manual_seed(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
rss0, anon0 = status("VmRSS"), status("RssAnon")
start = time.perf_counter()
if case == "raw":
    model = Net()
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(folder, name)))
    model.load_state_dict(state)
elif case == "raw assign":
    with torch.device("meta"):
        model = Net()
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(folder, name), device="cpu"))
    model.load_state_dict(state, assign=True)
else:
    with init_empty_weights():
        model = Net()
    kwargs = {"max_memory": {"cpu": "300MB"}, "offload_folder": offload} if case.endswith("disk") else {}
    model = load_checkpoint_and_dispatch(model, folder, device_map="auto", **kwargs)
with torch.no_grad():
    out = model(x)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak": status("VmHWM") - rss0, "anon": status("RssAnon") - anon0,
                  "sum": float(out.double().sum())}))
""" % {"width": WIDTH}

CASES = ["raw", "raw assign", "accelerate", "torchbay", "torchbay cold", "accelerate disk", "torchbay disk"]


def write_checkpoint(folder: str, layers: int) -> int:
    import torch
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(0)
    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH) * WIDTH ** -0.5
        state[f"layers.{i}.bias"] = torch.zeros(WIDTH)
    size = sum(t.numel() * 4 for t in state.values())
    os.makedirs(folder)
    save_torch_state_dict(state, folder, max_shard_size=size // 4 + 2**20)  # 4 shards and an index
    return size


def run_case(case: str, folder: str, layers: int, work: str) -> dict:
    offload = tempfile.mkdtemp(prefix="offload_", dir=work)
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, case, folder, str(layers), offload], capture_output=True,
                              text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"case {case!r} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(offload, ignore_errors=True)  # the benchmark's own scratch folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16, help="16 layers of 4096x4096 fp32 = 1 GiB")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = args.cases.split(",")
    work = tempfile.mkdtemp(prefix="bench_big_model_", dir=os.environ.get("BENCH_DIR"))
    try:
        folder = os.path.join(work, "ckpt")
        size = write_checkpoint(folder, args.layers)
        shards = len([n for n in os.listdir(folder) if n.endswith(".safetensors")])
        results = {case: [] for case in cases}
        for r in range(args.rounds + 1):  # round 0 warms the page cache and the interpreters
            order = cases[r % len(cases):] + cases[:r % len(cases)]
            for case in order:
                result = run_case(case, folder, args.layers, work)
                if r:
                    results[case].append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["raw"] if "raw" in results else results[cases[0]]
    for case in cases:
        for got, want in zip(results[case], base):
            if abs(got["sum"] - want["sum"]) > 1e-3 * max(1.0, abs(want["sum"])):
                raise SystemExit(f"{case}: output {got['sum']} differs from raw's {want['sum']}")
    print(f"checkpoint {size / 2**30:.2f} GiB fp32 in {shards} safetensors shards + HF index; {args.rounds} rounds, "
          f"each case in its own process; medians")
    versus = "x " + ("raw" if "raw" in results else cases[0])
    assign_header = "x assign" if "raw assign" in results else ""
    print(f"{'case':<17}{'seconds':>9}{versus:>8}{assign_header:>10}{'peak RSS +GiB':>15}{'x ckpt':>8}"
          f"{'anon +GiB':>11}{'x ckpt':>8}")
    for case in cases:
        rows = results[case]
        seconds = statistics.median(r["seconds"] for r in rows)
        ratio = statistics.median(r["seconds"] / b["seconds"] for r, b in zip(rows, base))
        peak = statistics.median(r["peak"] for r in rows)
        anon = statistics.median(r["anon"] for r in rows)
        assign = ""
        if "raw assign" in results:  # issue 27's reference: meta init + load_file + assign=True
            assign = format(statistics.median(r['seconds'] / a['seconds']
                                              for r, a in zip(rows, results['raw assign'])), ">10.3f")
        print(f"{case:<17}{seconds:>9.3f}{ratio:>8.3f}{assign}{peak / 2**30:>15.3f}{peak / size:>8.3f}"
              f"{anon / 2**30:>11.3f}{anon / size:>8.3f}")


if __name__ == "__main__":
    main()
