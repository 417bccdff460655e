"""Pipeline parallelism for ``strategy: fsdp`` (``parallelism.pp_size``), on torch.distributed.pipelining:
:mod:`.split` plans where the model is cut, :mod:`.stage` cuts it, :mod:`.schedule` places stages and builds
torch's schedule, :mod:`.model` is the prepared model, :mod:`.wrap` the strategy's part (docs/parallelism.md)."""
