"""Whether this micro-batch synchronises gradients, and where the data loaders are (Accelerate's
``GradientState``): read by the prepared optimizer, scheduler and loaders, set by ``accumulate``."""

from __future__ import annotations

import weakref
from typing import Any

from torchbay.process.current import peek


class GradientState:
    """Whether this micro-batch synchronises gradients, and where the data loader is.

    One per ``Accelerator``; ``GradientState()`` without arguments gives the latest Accelerator's
    (Accelerate's is one per process). It has Accelerate's attribute names (``num_steps``,
    ``active_dataloader``, ``in_dataloader``...).
    """

    def __new__(cls, accumulation_steps: Any = None, sync_each_batch: bool = False, sync_with_dataloader: bool = True):
        if accumulation_steps is None:  # Accelerate's GradientState(): the latest Accelerator's
            run = peek()
            latest = run.gradient_state if run is not None else None
            if isinstance(latest, cls):
                return latest
        return super().__new__(cls)

    def __init__(self, accumulation_steps: Any = None, sync_each_batch: bool = False,
                 sync_with_dataloader: bool = True):
        if accumulation_steps is None and getattr(self, "_ready", False):
            return  # the shared one, as it is
        self._ready = True
        self._adjust_scheduler = True
        if hasattr(accumulation_steps, "num_steps"):  # Accelerate's GradientState(gradient_accumulation_plugin)
            sync_each_batch = getattr(accumulation_steps, "sync_each_batch", False)
            self._adjust_scheduler = getattr(accumulation_steps, "adjust_scheduler", True)
            sync_with_dataloader = getattr(accumulation_steps, "sync_with_dataloader", True)
            accumulation_steps = accumulation_steps.num_steps
        self.accumulation_steps = int(accumulation_steps or 1)
        self.sync_each_batch = sync_each_batch
        self._sync_with_dataloader = bool(sync_with_dataloader)
        self.step = 0
        self.sync_gradients = True
        self._end_of_dataloader = False  # without an active loader
        self._remainder = -1
        self._active_loaders: list[weakref.ref] = []  # weak: a dropped loader is freed at once

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active loader is serving its last batch."""
        loader = self.active_dataloader
        return loader.end_of_dataloader if loader is not None else self._end_of_dataloader

    @end_of_dataloader.setter
    def end_of_dataloader(self, value: bool) -> None:
        loader = self.active_dataloader
        if loader is not None:
            loader.end_of_dataloader = value
        else:
            self._end_of_dataloader = value

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last global batch (-1: unknown), for ``gather_for_metrics``."""
        loader = self.active_dataloader
        return loader.remainder if loader is not None else self._remainder

    @remainder.setter
    def remainder(self, value: int) -> None:
        loader = self.active_dataloader
        if loader is not None:
            loader.remainder = value
        else:
            self._remainder = value

    @property
    def num_steps(self) -> int:
        return self.accumulation_steps

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether the last batch of a loader always synchronises (and starts a new accumulation window)."""
        return self._sync_with_dataloader

    @property
    def adjust_scheduler(self) -> bool:
        return self._adjust_scheduler

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The gradient-accumulation settings under Accelerate's ``GradientAccumulationPlugin`` names."""
        return {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                "sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch}

    def set_sync_gradients(self, sync_gradients: bool) -> None:
        """Decide by hand whether this micro-batch synchronises (a loop that accumulates by itself, as
        transformers' Trainer does with Accelerate's name ``_set_sync_gradients``, instead of ``accumulate``)."""
        self.sync_gradients = bool(sync_gradients)

    _set_sync_gradients = set_sync_gradients  # Accelerate's name, called by transformers' Trainer

    @property
    def active_dataloader(self) -> Any:
        loaders = self._live_loaders()
        return loaders[-1] if loaders else None

    @property
    def dataloader_references(self) -> list[Any]:
        return [None, *self._live_loaders()]

    @property
    def in_dataloader(self) -> bool:
        return bool(self._live_loaders())

    def _live_loaders(self) -> list[Any]:
        return [loader for loader in (ref() for ref in self._active_loaders) if loader is not None]

    @property
    def initialized(self) -> bool:
        return True

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's reset of its process-wide gradient state; each torchbay Accelerator has its own."""

    def __repr__(self) -> str:
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation steps: {self.num_steps}\n")

    def advance(self) -> bool:
        """Called by ``accumulate``: decide whether this micro-batch syncs."""
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.accumulation_steps == 0
        return self.sync_gradients

    def add_dataloader(self, loader) -> None:
        """A loader starts an epoch: it is the active one until it ends."""
        self._active_loaders.append(weakref.ref(loader))

    def remove_dataloader(self, loader) -> None:
        """A loader's epoch ended (or was abandoned)."""
        self._active_loaders = [ref for ref in self._active_loaders if ref() is not None and ref() is not loader]

    _add_dataloader, _remove_dataloader = add_dataloader, remove_dataloader  # Accelerate's names
