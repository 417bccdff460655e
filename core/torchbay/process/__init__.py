"""This process in the run: ``state`` (Accelerate's PartialState, AcceleratorState, DistributedType: which process,
which device, the process group), ``running`` (the live runs, their device backends, the one exit teardown),
``seeding`` (set_seed and synchronising generators across processes)."""
