"""2-process worker: gather_for_metrics drops padding, collectives, split_between_processes."""

import json
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
acc.wait_for_everyone()
if acc.is_main_process:
    json.dump(out, open(sys.argv[1], "w"))
acc.end_training()
