"""2-process worker: gather_for_metrics drops padding, collectives, split_between_processes."""

import json
import pickle
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchbay import Accelerator

acc = Accelerator()
out = {}
dl = acc.prepare(DataLoader(TensorDataset(torch.arange(11)), batch_size=3))
out["gathered"] = torch.cat([acc.gather_for_metrics(b[0]) for b in dl]).tolist()
dl_obj = acc.prepare(DataLoader(list(range(5)), batch_size=2, collate_fn=lambda b: b))
out["gathered_objects"] = [x for batch in dl_obj for x in acc.gather_for_metrics(batch, use_gather_object=True)]
from torchbay import Accelerator as _A  # noqa: E402  a second accelerator in the same group

acc_dispatch = _A(dataloader_config=__import__("torchbay").DataLoaderConfiguration(dispatch_batches=True))
dl_dispatch = acc_dispatch.prepare(DataLoader(TensorDataset(torch.arange(11)), batch_size=3))
out["dispatched_local"] = [b[0].tolist() for b in dl_dispatch]
out["dispatched"] = torch.cat([acc_dispatch.gather_for_metrics(b[0]) for b in dl_dispatch]).tolist()
rank = torch.tensor([acc.process_index + 1.0])
out["sum"] = acc.reduce(rank, "sum").item()
out["mean"] = acc.reduce(rank, "mean").item()
out["gather"] = acc.gather({"r": rank})["r"].tolist()
padded = acc.pad_across_processes(torch.ones(acc.process_index + 1), dim=0)
out["padded"] = acc.gather(padded).tolist()
with acc.split_between_processes(list(range(5))) as part:
    out["split"] = part
with acc.main_process_first():
    out["first"] = True
# objects of different sizes per rank (gloo: sent as bytes through the strategy's own collectives)
mine = {"rank": acc.process_index, "text": "x" * (1000 * acc.process_index + 1)}
out["objects_gathered"] = [(o["rank"], len(o["text"])) for o in acc.strategy.all_gather_object(mine)]
out["object_broadcast"] = acc.strategy.broadcast_object(mine if acc.process_index == 1 else None, src=1)["rank"]
acc.wait_for_everyone()
# every collective's work stays referenced here after the call returns (the oldest is let go), so
# gloo's thread does not destroy it: see ProcessCollectives.wait
works = []
for call in (lambda: acc.gather(rank), lambda: acc.reduce(rank, "sum"), lambda: acc.strategy.broadcast(rank.clone()),
             acc.wait_for_everyone):
    call()
    works.append(acc.strategy.collectives.held[-1])
out["held_works"] = [w is not None and w.is_completed() for w in works]
out["held_works_distinct"] = len({id(w) for w in works}) == len(works)
out["held_count"] = len(acc.strategy.collectives.held)
# as Accelerate pickles one
out["pickles_with_held_works"] = bool(acc_dispatch.strategy.collectives.held) and len(pickle.dumps(acc_dispatch)) > 0
if acc.is_main_process:
    json.dump(out, open(sys.argv[1], "w"))
acc.end_training()
