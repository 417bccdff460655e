"""The telemetry monitor: what training does, every ``telemetry.every_n_steps`` optimizer steps.

The Accelerator makes one when ``telemetry.enabled`` is on (else nothing is made, and a step pays one attribute read).
The prepared data loaders hand it every batch and how long the step waited for it; the prepared optimizer tells it
each step. The first step is the counting step: its FLOPs are counted with ``FlopCounterMode`` (unless
``telemetry.flops_per_step`` states them), its memory peak is logged beside ``estimate-memory``'s figure; it is left
out of the timings. Then, every N steps, one record: ``time/step_time_s``, ``time/data_wait_s``,
``throughput/samples_per_s``, ``throughput/tokens_per_s`` (when batches carry ``input_ids``),
``throughput/tflops``, ``throughput/mfu`` (only where the peak is known: the device plugin's ``peak_flops`` or
``telemetry.peak_tflops``), and ``memory/rank<R>/current_gib`` and ``peak_gib`` of every rank (one all-gather of two
numbers). Throughput, TFLOP/s and MFU are this process's (per device), as torchtitan reports them.

Records go to the running trackers at the optimizer step's number, and, when the jsonl tracker is not among them, to
``<logging dir>/telemetry/metrics.jsonl`` (so ``torchbay plot`` draws them either way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch

from torchbay.axes.device import flops_key
from torchbay.compile.compiler import is_compiled
from torchbay.telemetry.flops import StepFlopCounter, parameter_count, transformer_estimate
from torchbay.telemetry.memory import GIB, dump_snapshot, start_snapshot_recording
from torchbay.tracking.jsonl import JSONLinesTracker
from torchbay.tracking.progress import LIVE_BARS
from torchbay.tracking.trackers import JSONL_NAME, logging_base

logger = logging.getLogger("torchbay.telemetry")


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """``(samples, tokens)`` of a batch: samples from the first tensor's first dimension; tokens from
    ``input_ids`` (a mapping's key or an attribute) when the batch has it (padding included), else ``None``."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
    tokens = int(ids.numel()) if isinstance(ids, torch.Tensor) else None
    first = ids if isinstance(ids, torch.Tensor) else _first_tensor(batch)
    samples = int(first.shape[0]) if first is not None and first.ndim > 0 else 0
    return samples, tokens


def _first_tensor(batch: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if depth > 3:
        return None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


def compiled_module(models: list[Any]) -> str | None:
    """The name of a compiled module among ``models`` (``torch.compile``, ``Module.compile`` or torchbay's
    ``compile`` step), else ``None``."""
    for model in models:
        for name, module in getattr(model, "named_modules", lambda: [])():
            if is_compiled(module):
                return name or type(model).__name__
    return None


def peak_dtype(mixed_precision: str) -> Any:
    """The math whose peak MFU divides by, from the ``mixed_precision`` mode: bf16, fp16, fp8 (any ``fp8*`` mode),
    else fp32 (tf32 where torch lets float32 matmuls use TF32)."""
    if mixed_precision in ("bf16", "fp16") or mixed_precision.startswith(("fp8", "fp4")):
        return mixed_precision[:4] if mixed_precision.startswith(("fp8", "fp4")) else mixed_precision
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


class TelemetryMonitor:
    """One run's telemetry (see the module). ``models``/``optimizers``: callables giving the prepared lists;
    ``tracking``: the run's trackers (its ``running`` list); ``strategy``: for the memory all-gather and rank."""

    def __init__(self, settings: Any, config: Any, device_backend: Any, strategy: Any, tracking: Any,
                 models: Callable[[], list], optimizers: Callable[[], list]):
        self.settings = settings
        self.config = config
        self.device_backend = device_backend
        self.strategy = strategy
        self.tracking = tracking
        self.models, self.optimizers = models, optimizers
        self.rank, self.world_size = int(strategy.rank), int(strategy.world_size)
        self.every = int(settings.every_n_steps)
        self.step = 0
        self.counter = StepFlopCounter()
        self.flops_first_step: int | None = None
        self.first_counts = (0, 0)
        self.peak, self.peak_source = self._peak()
        self._own_jsonl: JSONLinesTracker | None = None
        self.snapshots = bool(settings.memory_snapshot) and start_snapshot_recording(device_backend,
                                                                                   settings.memory_snapshot_entries)
        self._reset_window()

    # -- what the loaders and the optimizer call ---------------------------------------------
    def watch(self, batches: Any):
        """``batches``, timing how long each ``next`` waits and counting samples and tokens; closes ``batches``
        when the loop stops early (so the loader's end of epoch runs at once, as without telemetry)."""
        clock = time.perf_counter
        try:
            iterator = iter(batches)
            while True:
                start = clock()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                self.on_batch(batch, clock() - start)
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def on_batch(self, batch: Any, wait_s: float) -> None:
        samples, tokens = batch_counts(batch)
        self.batches += 1
        self.samples += samples
        self.wait_s += wait_s
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens
        if (self.step == 0 and self.settings.count_flops and self.settings.flops_per_step is None
                and not self.counter.counting and self.counter.error is None):
            compiled = compiled_module(self.models())
            if compiled:  # FlopCounterMode misses what compiled graphs run (their backward): no count, not a wrong one
                self.counter.error = f"{compiled} is compiled (torch.compile); FlopCounterMode cannot see into it"
            else:
                self.counter.open()  # the first step's batch: count until its optimizer step

    def after_optimizer_step(self, optimizer: Any) -> None:
        """Called by every prepared optimizer's real step; counts the first prepared optimizer's."""
        optimizers = self.optimizers()
        if optimizers and optimizer is not optimizers[0]:
            return
        self.step += 1
        if self.step == 1:
            self._first_step()
        elif self.step % self.every == 0:
            self._flush()

    # -- the first step -------------------------------------------------------------------------
    def _first_step(self) -> None:
        counted = self.counter.close()
        self.flops_first_step = counted if self.settings.flops_per_step is None else int(self.settings.flops_per_step)
        self.first_counts = (self.samples, self.tokens or 0)
        values: dict[str, Any] = {}
        if counted is not None:
            values["flops/counted_per_step"] = counted
        elif self.settings.flops_per_step is not None:
            values["flops/stated_per_step"] = int(self.settings.flops_per_step)
        elif self.counter.error:
            logger.warning("telemetry: the first step's FLOPs could not be counted (%s); no TFLOP/s or MFU is "
                           "logged: state them with telemetry.flops_per_step", self.counter.error)
        if self.tokens:
            values["flops/6nt_per_step"] = transformer_estimate(parameter_count(self.models()), self.tokens)
        if self.peak is not None:
            values["throughput/peak_tflops"] = self.peak / 1e12
        estimate = self._estimate_bytes()
        if estimate is not None:
            values["memory/estimate_gib"] = estimate / GIB
        values.update(self._memory_values())
        if self.snapshots:
            dump_snapshot(self.device_backend, self.snapshot_dir(), f"rank{self.rank}.step1")
        self._log(values)
        self._reset_window()

    def _estimate_bytes(self) -> int | None:
        """``torchbay estimate-memory``'s per-process figure for these models (parameters, gradients, optimizer)."""
        models = self.models()
        if not models:
            return None
        params = parameter_count(models)
        trainable = sum(p.numel() for m in models for p in m.parameters() if p.requires_grad)
        try:
            estimate = type(self.strategy).estimate_memory(self.config, self.world_size,
                                                           {"parameters": params, "trainable": trainable})
        except Exception:  # a strategy that cannot estimate this set-up: no estimate, no failure
            return None
        return None if estimate is None else int(estimate.total)

    # -- every N steps ----------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self.device_backend.synchronize()
        self.t0 = time.perf_counter()
        self.window_start_step = self.step
        self.samples, self.tokens, self.wait_s, self.batches = 0, None, 0.0, 0

    def window_flops(self) -> float | None:
        """The window's model FLOPs: the first step's count scaled by tokens (else samples, else steps)."""
        if not self.flops_first_step:
            return None
        first_samples, first_tokens = self.first_counts
        if first_tokens and self.tokens:
            return self.flops_first_step * self.tokens / first_tokens
        if first_samples and self.samples:
            return self.flops_first_step * self.samples / first_samples
        return float(self.flops_first_step) * (self.step - self.window_start_step)

    def _flush(self) -> None:
        self.device_backend.synchronize()
        elapsed = max(time.perf_counter() - self.t0, 1e-12)
        steps = max(self.step - self.window_start_step, 1)
        values: dict[str, Any] = {"time/step_time_s": elapsed / steps}
        if self.batches:  # batches came from a prepared loader (else nothing is known of them: no zeros)
            values.update({"time/data_wait_s": self.wait_s / steps, "throughput/samples_per_s": self.samples / elapsed})
        if self.tokens is not None:
            values["throughput/tokens_per_s"] = self.tokens / elapsed
        flops = self.window_flops()
        if flops is not None:
            achieved = flops / elapsed
            values["throughput/tflops"] = achieved / 1e12
            if self.peak is not None:  # unknown peak: no MFU at all (never 0)
                values["throughput/mfu"] = achieved / self.peak
        values.update(self._memory_values())
        self._show_on_bars(values)
        self._log(values)
        self._reset_window()

    def _memory_values(self) -> dict[str, float]:
        try:
            stats = self.device_backend.memory_stats()
            mine = [float(stats.get("allocated", 0)), float(stats.get("peak_allocated", 0))]
        except Exception:  # a device that cannot say
            return {}
        rows = [mine]
        if self.world_size > 1:  # every rank's pair: one small all-gather, every N steps
            device = getattr(self.device_backend, "device", "cpu")
            gathered = self.strategy.all_gather(torch.tensor(mine, dtype=torch.float64, device=device))
            rows = gathered.view(self.world_size, 2).tolist()
        out = {}
        for rank, (current, peak) in enumerate(rows):
            out[f"memory/rank{rank}/current_gib"] = current / GIB
            out[f"memory/rank{rank}/peak_gib"] = peak / GIB
        return out

    # -- where the numbers go ---------------------------------------------------------------------
    def _peak(self) -> tuple[float | None, str]:
        if self.settings.peak_tflops is not None:
            return float(self.settings.peak_tflops) * 1e12, "telemetry.peak_tflops"
        dtype = peak_dtype(str(self.config.mixed_precision))
        try:
            peak = self.device_backend.peak_flops(dtype)
        except Exception as exc:  # a plugin's bug must not stop training: no MFU, said once
            logger.warning("telemetry: device %s's peak_flops(%r) failed (%s: %s); no MFU is logged",
                           self.device_backend.name, dtype, type(exc).__name__, exc)
            return None, "unknown"
        source = f"device plugin '{self.device_backend.name}' ({flops_key(dtype)})"
        return (float(peak), source) if peak else (None, "unknown")

    def snapshot_dir(self) -> str:
        return str(logging_base(self.config) / "telemetry")

    def _log(self, values: dict[str, Any]) -> None:
        running = list(getattr(self.tracking, "running", []))
        for tracker in running:
            tracker.log(values, step=self.step)
        if self.rank != 0 or any(t.name == JSONL_NAME for t in running):
            return
        if self._own_jsonl is None:
            self._own_jsonl = JSONLinesTracker("telemetry", logging_base(self.config))
            self._own_jsonl.start()
        self._own_jsonl.log(values, step=self.step)

    def _show_on_bars(self, values: dict[str, Any]) -> None:
        rate, samples = values.get("throughput/tokens_per_s"), values.get("throughput/samples_per_s")
        text = (f"{rate:,.0f} tok/s" if rate is not None else f"{samples:,.1f} samples/s" if samples is not None
                else f"{values['time/step_time_s'] * 1e3:,.1f} ms/step")
        if "throughput/mfu" in values:
            text += f", MFU {values['throughput/mfu']:.1%}"
        for bar in list(LIVE_BARS):
            bar.set_postfix_str(text, refresh=False)

    def finish(self) -> None:
        """Close the monitor's own jsonl file (``end_training``)."""
        if self._own_jsonl is not None:
            self._own_jsonl.finish()
            self._own_jsonl = None
