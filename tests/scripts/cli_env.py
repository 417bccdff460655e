"""Run by torchbay launch in tests: writes the rank layout it was given; imports nothing heavy."""
import json
import os
import sys

keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
record = {k: os.environ.get(k) for k in keys}
record.update(pid=os.getpid(), has_resolved_env="TORCHBAY_RESOLVED_CONFIG" in os.environ, modules=sorted(
    m for m in ("torch", "torchbay") if m in sys.modules))
with open(os.path.join(sys.argv[1], f"task{record['RANK']}.json"), "w") as f:
    json.dump(record, f)
