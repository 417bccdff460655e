"""Core checks of a set-up, the core's ``torchbay env`` lines and memory estimates for single/ddp."""

from __future__ import annotations

import platform

from torchbay.plugins import hookimpl

@hookimpl
def torchbay_validate(context) -> list[str]:
    config = context.config
    problems = []
    device_cls = context.device_backend_cls
    if device_cls is not None and not device_cls.multi_process and context.cluster.local_world_size() > 1:
        problems.append(f"device '{device_cls.name}' runs one process per machine but this job starts "
                        f"{context.cluster.local_world_size()}; launch with --nproc-per-node 1")
    if device_cls is not None and config.visible_devices and not device_cls.visible_devices_variable():
        problems.append(f"visible_devices is set but device '{device_cls.name}' has no visible-devices variable; "
                        f"remove visible_devices")
    if device_cls is not None and device_cls.one_process_per_device and context.cluster.world_size() > 1:
        count, per_machine = device_cls.visible_count(config), context.cluster.local_world_size()
        if count and per_machine > count:
            variable = device_cls.visible_devices_variable()
            problems.append(f"device {device_cls.name}: {per_machine} processes per machine but only {count} "
                            f"device(s) visible; {device_cls.dist_backend()} needs one device per process: launch at "
                            f"most {count} processes per machine or make more devices visible (visible_devices"
                            + (f" / {variable}" if variable else "") + ")")
    backend = config.process_group_backend
    if backend and context.device_backend_cls is not None and context.cluster.world_size() > 1:
        import torch.distributed as dist

        if backend not in ("gloo", "mpi") and not hasattr(dist.Backend, backend.upper()):
            problems.append(f"process_group_backend '{backend}' is not a torch.distributed backend here; "
                            f"remove it to use device '{context.device_backend_cls.name}''s default")
    if config.launch.num_processes and config.launch.nproc_per_node and \
            config.launch.num_processes != config.launch.nproc_per_node * config.launch.num_machines:
        problems.append(f"launch.num_processes ({config.launch.num_processes}) is not launch.nproc_per_node "
                        f"({config.launch.nproc_per_node}) x launch.num_machines ({config.launch.num_machines}); "
                        f"give one of num_processes or nproc_per_node")
    return problems


@hookimpl
def torchbay_report_env() -> dict:
    import torch

    from torchbay.plugins import _own_version

    return {"torchbay": _own_version(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "torch accelerator":
            str(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else "none"}
