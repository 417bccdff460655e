"""Print, as JSON, what the plugin manager found; with --train, run one step and a save/load."""

import argparse
import json
import sys

import torch

p = argparse.ArgumentParser()
p.add_argument("--train", action="store_true")
p.add_argument("--config-file")
p.add_argument("--ckpt")
args = p.parse_args()

from torchbay.registry.manager import get_plugin_manager  # noqa: E402

pm = get_plugin_manager()
registries = pm.registries()  # registration failures are recorded while the registries are built
out = {"infos": {n: {"status": i.status, "distribution": i.distribution, "version": i.version, "error": i.error}
                 for n, i in pm.infos.items()},
       "registries": {k: sorted(v) for k, v in registries.items()},
       "hooks": {n: pm.hooks_of(n) for n in pm.infos}}
for n, i in pm.infos.items():
    out["infos"][n]["registers"] = i.registers
if args.train:
    from torchbay import Accelerator

    acc = Accelerator(config_file=args.config_file)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        opt.zero_grad()
    acc.save_state(args.ckpt)
    import torchbay_toy.plugin as toy

    toy.STEPS["count"] = 0
    acc.load_state(args.ckpt)
    out["run"] = {"device": acc.device_backend.name, "strategy": acc.strategy.name,
                  "precision": f"{acc.precision.name}:{acc.precision.engine}",
                  "io": acc.checkpoint_io.name, "cluster": acc.context.cluster.name,
                  "toy_level": acc.config.toy.level, "events": toy.EVENTS, "steps": toy.STEPS["count"]}
    acc.end_training()
json.dump(out, sys.stdout)
