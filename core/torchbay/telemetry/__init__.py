"""Telemetry: what training does per step (throughput, achieved TFLOP/s and MFU, step and data-wait time, memory per
rank), model FLOPs counted once, the OOM report and the allocator's memory snapshot (docs/telemetry.md).

``flops``: counting a step's FLOPs with torch's ``FlopCounterMode`` and the ``6 x parameters x tokens`` estimate;
``monitor``: the :class:`~torchbay.telemetry.monitor.TelemetryMonitor` the Accelerator holds when
``telemetry.enabled`` is on, and what the data loader and progress bars ask of it; ``memory``: memory per rank, the
OOM report and the snapshot.
"""
