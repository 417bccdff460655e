"""What a prepared loader keeps per epoch: its place in the gradient state (:class:`DataLoaderStateMixin`,
Accelerate's name), the shuffling RNG at the epoch's start (:class:`EpochRng`, for exact resume) and the batch
indices it serves (:class:`EpochBatches`, which skips the batches a resumed run already served without loading them).

None of these objects refers back to the loader, so a loader that is dropped is freed at once (no cycle to collect).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import RandomSampler

from torchbay.data.sharding import SeedableRandomSampler

#: what makes a length or batch size unknown (an unsized dataset, a batch sampler whose batches vary in size)
_UNKNOWN = (TypeError, AttributeError, ZeroDivisionError, NotImplementedError, ValueError)


class DataLoaderStateMixin:
    """Where a loader is in its epoch, as the gradient state reads it (Accelerate's ``DataLoaderStateMixin``).

    ``end_of_dataloader``: the batch just served is the epoch's last; ``remainder``: how many samples of the last
    global batch are real (``len(dataset) % total_batch_size``; -1 when unknown), which ``gather_for_metrics`` keeps.
    A subclass has ``gradient_state``, ``total_batch_size`` and ``_drop_last``.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.end_of_dataloader = False
        cls.remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start an epoch: reset the flags, compute the remainder, become the gradient state's active loader."""
        self.reset()
        if not self._drop_last:
            try:
                length = getattr(self.dataset, "total_dataset_length", None)
                length = len(self.dataset) if length is None else length
                self.remainder = length % self.total_batch_size
            except _UNKNOWN:
                pass
        self.gradient_state.add_dataloader(self)

    def end(self) -> None:
        """End an epoch (finished or abandoned): the gradient state forgets this loader."""
        self.gradient_state.remove_dataloader(self)


def shuffling_sampler(source: Any) -> Any:
    """The sampler that orders the indices behind a batch sampler (through shards and skips), or None."""
    seen = 0
    while hasattr(source, "batch_sampler") and seen < 8:  # BatchSamplerShard, SkipBatchSampler, EpochBatches
        source, seen = source.batch_sampler, seen + 1
    if isinstance(source, RandomSampler):
        return source
    return getattr(source, "sampler", None)


class EpochRng:
    """The shuffling sampler's random state at the start of each epoch: recorded (``save_state``) and, after
    ``load_state`` in the middle of an epoch, restored where the sampler draws its order.

    A ``RandomSampler`` without a generator draws its seed from the global RNG when an epoch starts; that seed is
    drawn here, as the sampler would draw it, and recorded. A generator that the sampler owns is recorded as a
    state. A :class:`SeedableRandomSampler` needs nothing: its order depends on its seed and epoch.
    """

    def __init__(self, source: Any):
        self.source = source  # what the sampler is found behind (set_sampler may replace it)
        self.resume_from: dict[str, Any] | None = None
        self.epoch_start: dict[str, Any] | None = None
        self._drawn: torch.Generator | None = None

    @property
    def sampler(self) -> Any:
        return shuffling_sampler(self.source)

    def start(self) -> None:
        sampler = self.sampler
        resume, self.resume_from = self.resume_from, None
        if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
            return
        if sampler.generator is None:
            if resume and "sampler_seed" in resume:  # drawn before the save: the restored RNG is past it
                seed = resume["sampler_seed"]
            else:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self.epoch_start = {"sampler_seed": seed}
            self._drawn = sampler.generator = torch.Generator().manual_seed(seed)
            return
        if resume and "sampler_rng" in resume:
            sampler.generator.set_state(resume["sampler_rng"])
        self.epoch_start = {"sampler_rng": sampler.generator.get_state()}

    def finish(self) -> None:
        """After an epoch (or its abandon): a sampler without a generator draws from the global RNG again."""
        sampler = self.sampler
        if self._drawn is not None and getattr(sampler, "generator", None) is self._drawn:
            sampler.generator = None
        self._drawn = None

    def state_between_epochs(self) -> dict[str, Any]:
        """What restores the order of the next epoch when saved between two epochs."""
        sampler = self.sampler
        if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler) \
                and sampler.generator is not None:
            return {"sampler_rng": sampler.generator.get_state()}
        return {}

    def restore_between_epochs(self, state: dict[str, Any]) -> None:
        sampler = self.sampler
        if "sampler_rng" in state and getattr(sampler, "generator", None) is not None:
            sampler.generator.set_state(state["sampler_rng"])


class EpochBatches:
    """The batch indices a prepared loader reads: its batch sampler's, less the first ``skip`` of the epoch (set
    before each epoch; a resumed run skips what it served), starting the :class:`EpochRng` where sampling starts."""

    def __init__(self, batch_sampler: Any, rng: EpochRng):
        self.batch_sampler = batch_sampler
        self.rng = rng
        self.skip = 0

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        self.rng.start()
        for index, batch in enumerate(self.batch_sampler):
            if index >= skip:
                yield batch
