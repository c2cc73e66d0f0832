"""Exact mid-epoch resume: a dataloader that starts where the restored checkpoint left its epoch."""

from __future__ import annotations

import itertools

import torch


class ResumedEpochLoader:
    """A dataloader whose first epoch starts ``skip`` micro-batches in (the resume point).

    The skipped batches are the ones the checkpointed steps already trained on, so a resumed
    run neither repeats nor drops data. Creating that first iterator leaves the global RNG as
    the checkpoint restored it: in the uninterrupted run its draw happened before the
    checkpoint, and anchor sampling must continue from the same RNG state.

    Args:
        loader: The epoch's DataLoader (deterministic order per epoch: ``sampler.set_epoch``).
        skip: Micro-batches to skip in the first epoch iterated.
        on_epoch_start: Optional callable run each time an epoch's iteration starts.
    """

    def __init__(self, loader, skip: int, on_epoch_start=None) -> None:
        self.loader = loader
        self.skip = int(skip)
        self.on_epoch_start = on_epoch_start

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader) - self.skip

    def __iter__(self):
        if self.on_epoch_start is not None:
            self.on_epoch_start()
        if not self.skip:
            return iter(self.loader)
        with torch.random.fork_rng(devices=[]):
            iterator = iter(self.loader)
        skip, self.skip = self.skip, 0
        return itertools.islice(iterator, skip, None)


__all__ = ["ResumedEpochLoader"]
