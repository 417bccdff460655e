"""A rank of a two-rank gloo job that records its collectives with torch's flight recorder and dumps them, for
tests/launch/test_flight_recorder.py: ``python record_collectives.py RANK PORT OUT_DIR SCENARIO``.

Both ranks run two all_reduces; then, by SCENARIO, ``mismatch``: rank 0 an all_reduce, rank 1 a broadcast;
``missing``: rank 0 a third all_reduce that rank 1 never enters; ``same``: nothing more. The last collective is
started without waiting (it cannot finish: the ranks disagree), the ring buffer is written to
``OUT_DIR/nccl_trace_rank_<RANK>`` and the process leaves at once.
"""

import os
import sys

os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._C._distributed_c10d import _dump_fr_trace  # noqa: E402

rank, port, out, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.ones(4)
dist.all_reduce(t)
dist.all_reduce(t)
if scenario == "mismatch":
    (dist.all_reduce(t, async_op=True) if rank == 0 else dist.broadcast(torch.ones(8), 0, async_op=True))
elif scenario == "missing" and rank == 0:
    dist.all_reduce(t, async_op=True)
with open(os.path.join(out, f"nccl_trace_rank_{rank}"), "wb") as f:
    f.write(_dump_fr_trace())
sys.stdout.flush()
os._exit(0)
