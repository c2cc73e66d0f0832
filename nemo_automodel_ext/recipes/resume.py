"""Exact mid-epoch resume (a dataloader that starts where the restored checkpoint left its epoch, and stops
where ``recipe_args.max_steps`` ends the run), and which checkpoint a failed run can safely resume from
(``resume_advice``)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import torch
from nemo_automodel.recipes.llm._spec_train_utils import optim_steps_per_epoch
from safetensors.torch import load_file


def batches_in_epoch(epoch: int, batches: int, grad_accumulation_steps: int, max_steps: int | None) -> int:
    """Micro-batches epoch ``epoch`` trains when the run stops after ``max_steps`` optimizer steps.

    Every epoch before the one where ``max_steps`` falls trains all ``batches`` (``optim_steps_per_epoch`` steps,
    the last one flushing a partial accumulation window); that epoch trains the full windows of its remaining
    steps, so the run stops on an optimizer step; later epochs train none. ``max_steps`` None: ``batches``.
    """
    if max_steps is None:
        return batches
    remaining = int(max_steps) - epoch * optim_steps_per_epoch(batches, grad_accumulation_steps)
    return max(0, min(batches, remaining * grad_accumulation_steps))


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
        epoch: Index of the first epoch iterated (the resumed one); each iteration starts the next.
        batches_in_epoch: Optional ``epoch -> micro-batches`` that epoch trains (``batches_in_epoch``: a run that
            stops inside an epoch); None: every batch of every epoch. ``len`` is the current epoch's count, so the
            loop's last batch of an epoch is the last one trained.
    """

    def __init__(self, loader, skip: int, on_epoch_start=None, epoch: int = 0, batches_in_epoch=None) -> None:
        self.loader = loader
        self.skip = int(skip)
        self.on_epoch_start = on_epoch_start
        self.epoch = int(epoch)
        self.batches_in_epoch = batches_in_epoch

    @property
    def sampler(self):
        """What the loop's ``set_epoch`` reaches: the batch sampler when it orders the epoch (``run/batching.py``)."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        return batch_sampler if hasattr(batch_sampler, "set_epoch") else self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset

    def _stop(self) -> int:
        full = len(self.loader)
        return full if self.batches_in_epoch is None else min(full, self.batches_in_epoch(self.epoch))

    def __len__(self) -> int:
        return max(0, self._stop() - self.skip)

    def __iter__(self):
        if self.on_epoch_start is not None:
            self.on_epoch_start()
        stop = self._stop()
        self.epoch += 1
        if not self.skip:
            iterator = iter(self.loader)
            return iterator if stop == len(self.loader) else itertools.islice(iterator, stop)
        with torch.random.fork_rng(devices=[]):
            iterator = iter(self.loader)
        skip, self.skip = self.skip, 0
        return itertools.islice(iterator, skip, max(skip, stop))


def _step_of(checkpoint: Path) -> int:
    match = re.fullmatch(r"epoch_\d+_step_(\d+)", checkpoint.name)
    return int(match.group(1)) if match else -1


def weights_are_finite(checkpoint: Path) -> bool:
    """Whether every tensor of a checkpoint's draft weights (``model/**/*.safetensors``) is finite."""
    files = sorted((checkpoint / "model").rglob("*.safetensors"))
    if not files:
        return False
    for file in files:
        try:
            if not all(bool(torch.isfinite(tensor).all()) for tensor in load_file(file).values()):
                return False
        except Exception:  # unreadable: not a checkpoint to resume from
            return False
    return True


def resume_advice(checkpoint_dir: str | Path | None, failed_step: int) -> str:
    """Which checkpoint a run that hit a non-finite loss at ``failed_step`` can safely resume from.

    The weights that gave the non-finite loss are those after step ``failed_step - 1``; a
    checkpoint of that step holds them, so resuming from it (LATEST, when checkpoints are
    saved every step) repeats the failure. The advice names LATEST, whether it holds those
    weights or non-finite ones, and the newest earlier checkpoint whose weights are finite.

    Args:
        checkpoint_dir: ``checkpoint.checkpoint_dir`` of the run (None: checkpointing off).
        failed_step: The optimizer step whose loss was non-finite (1-based).

    Returns:
        One sentence for the refusal message.
    """
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete

    root = Path(checkpoint_dir) if checkpoint_dir else None
    found = sorted(
        (path for path in (root.glob("epoch_*_step_*") if root and root.is_dir() else []) if _step_of(path) >= 0),
        key=_step_of,
        reverse=True,
    )
    complete = [path for path in found if not is_checkpoint_incomplete(path)]
    if not complete:
        return "no checkpoint was saved yet: lower optimizer.lr (or check the data) and start again"
    finite: dict[Path, bool] = {}  # each checkpoint's weights are read once

    def is_finite(path: Path) -> bool:
        if path not in finite:
            finite[path] = weights_are_finite(path)
        return finite[path]

    latest = complete[0]
    if _step_of(latest) >= failed_step - 1:
        state = "holds the weights that gave this loss" if is_finite(latest) else "holds non-finite weights"
        verdict = f"LATEST ({latest.name}) {state}, so resuming from it repeats this failure"
    else:
        verdict = f"LATEST ({latest.name}) predates this step and its weights are " + (
            "finite" if is_finite(latest) else "NOT finite"
        )
    safe = next((path for path in complete if _step_of(path) < failed_step - 1 and is_finite(path)), None)
    if safe is None:
        return f"{verdict}; no earlier checkpoint has finite weights: lower optimizer.lr and start again"
    return (
        f"{verdict}; lower optimizer.lr and resume with checkpoint.restore_from={safe} "
        "(the last finite checkpoint before it)"
    )


__all__ = ["ResumedEpochLoader", "resume_advice", "weights_are_finite"]
