"""torch.distributed mechanics that know no Accelerator: ``parallelism_config`` (mesh sizes,
Accelerate's ParallelismConfig), ``rng`` (seeding and RNG states per rank).
"""
