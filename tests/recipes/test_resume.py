"""``recipe_args.max_steps``: the loader stops on the step where the run ends, also in a resumed epoch."""

from __future__ import annotations

import functools

import pytest

from nemo_automodel_ext.recipes.resume import ResumedEpochLoader, batches_in_epoch


class _Epochs:
    """A loader of ``batches`` micro-batches an epoch, each named (epoch, index)."""

    def __init__(self, batches: int) -> None:
        self.batches, self.epoch = batches, 0
        self.sampler = self  # what ResumedEpochLoader.sampler exposes to the loop's set_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        return iter([(self.epoch, index) for index in range(self.batches)])


def _loop(loader, epochs: int, grad_accumulation_steps: int, start_epoch: int = 0) -> list[list[tuple]]:
    """Upstream's loop's view: ``len`` before each epoch, a step every full window and at the epoch's last batch."""
    steps = []
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        count, window = len(loader), []
        seen = 0
        for index, batch in enumerate(loader):
            seen += 1
            window.append(batch)
            if len(window) == grad_accumulation_steps or index == count - 1:
                steps.append(window)
                window = []
        assert seen == count  # the loop's last batch is the loader's last: a partial window is flushed there
    return steps


@pytest.mark.parametrize("batches, accumulate", [(10, 1), (10, 3), (9, 3), (7, 4)])
def test_a_capped_run_stops_on_its_last_step_inside_an_epoch(batches, accumulate):
    """Every cap from one step to past the epochs: the run trains exactly min(cap, planned) steps, each a full
    window except an epoch's flushing last, and the batches are the uncapped run's first ones."""
    per_epoch = -(-batches // accumulate)
    uncapped = _loop(ResumedEpochLoader(_Epochs(batches), 0), 3, accumulate)
    assert len(uncapped) == 3 * per_epoch
    for cap in range(1, 3 * per_epoch + 3):
        limit = functools.partial(batches_in_epoch, batches=batches, grad_accumulation_steps=accumulate, max_steps=cap)
        epochs = min(3, -(-cap // per_epoch))  # what the recipe plans
        steps = _loop(ResumedEpochLoader(_Epochs(batches), 0, batches_in_epoch=limit), epochs, accumulate)
        assert steps == uncapped[: min(cap, 3 * per_epoch)], cap


def test_a_run_resumed_inside_its_capped_epoch_stops_at_the_same_step():
    """9 batches an epoch, accumulation 2 (5 steps an epoch), capped at 8 steps: resumed after any step, the run
    skips the batches of its epoch already trained and trains the uninterrupted capped run's remaining steps."""
    limit = functools.partial(batches_in_epoch, batches=9, grad_accumulation_steps=2, max_steps=8)
    full = _loop(ResumedEpochLoader(_Epochs(9), 0, batches_in_epoch=limit), 2, 2)
    assert len(full) == 8 and full[-1] == [(1, 4), (1, 5)]
    for step in range(1, 8):  # the checkpoint's global step
        epoch, done = divmod(step, 5)
        resumed = ResumedEpochLoader(_Epochs(9), min(done * 2, 9), epoch=epoch, batches_in_epoch=limit)
        assert _loop(resumed, 2, 2, start_epoch=epoch) == full[step:], step
    assert batches_in_epoch(0, 9, 2, None) == 9 and batches_in_epoch(2, 9, 2, 8) == 0
