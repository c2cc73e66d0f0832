"""In-run acceptance evaluation of the packed V4.1 DSpark recipe.

``AcceptanceEvaluator`` runs the exact greedy replay (``evaluation.acceptance``) over the
validation loader every ``recipe_args.eval_every_steps`` optimizer steps and at each epoch's
end. The target forward is the recipe's own wrapper, so under CP and HybridEP evaluation
captures features exactly as training does; each data-parallel rank replays its share of the
validation set and the sums are all-reduced. Results go to ``metrics.jsonl`` as records with
``"split": "val"`` (``greedy_tau``, ``greedy_accept@k``) and to W&B under ``val/``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from nemo_automodel_ext.evaluation.acceptance import evaluate_greedy

logger = logging.getLogger("nemo_automodel_ext.progress")


def acceptance_metrics(summary: dict) -> dict[str, float]:
    """Flat metric names of an ``AcceptanceStats.summary()``: ``greedy_tau``, ``greedy_accept@k``, agreement."""
    metrics = {"greedy_tau": summary["tau"], "greedy_agreement": summary["agreement"]}
    metrics.update({f"greedy_accept@{k + 1}": rate for k, rate in enumerate(summary["acceptance"])})
    return metrics


class AcceptanceEvaluator:
    """Greedy acceptance of the draft in training, on the validation loader.

    Args:
        target: The recipe's ``DeepseekV41DSparkTargetModel`` (its CP mesh, if any, is used).
        draft: Zero-argument callable returning the bare draft module (unwrapped from DDP).
        batches: The validation loader (packed batches), or None to disable evaluation.
        every_steps: Evaluate every this many optimizer steps; None: at epoch ends only.
        root: The module the draft is parallelised under; an FSDP2 root is unsharded around the
            evaluation (the draft's own non-layer parameters live there).
        all_reduce: Sums a 1-D tensor over the data-parallel ranks (the recipe's ``_dp_allreduce``), or None.
        is_main: Whether this rank logs.
    """

    def __init__(
        self,
        target,
        draft: Callable[[], torch.nn.Module],
        batches: Iterable | None,
        every_steps: int | None,
        root: torch.nn.Module | None = None,
        all_reduce=None,
        is_main: bool = True,
    ) -> None:
        self.target, self.draft, self.batches, self.root = target, draft, batches, root
        self.every_steps, self.all_reduce, self.is_main = every_steps, all_reduce, is_main
        self.last: tuple[int, dict[str, float]] | None = None

    def due(self, step: int) -> bool:
        return self.batches is not None and bool(self.every_steps) and step % self.every_steps == 0

    def run(self, step: int) -> dict[str, float]:
        """Greedy acceptance metrics at ``step`` (a collective over the dp group; cached per step)."""
        if self.batches is None:
            return {}
        if self.last is not None and self.last[0] == step:
            return self.last[1]
        sharded = callable(getattr(self.root, "unshard", None))  # an FSDP2 root
        if sharded:
            self.root.unshard()
        try:
            with torch.no_grad():
                stats = evaluate_greedy(self.target, self.draft(), self.batches, all_reduce=self.all_reduce)
        finally:
            if sharded:
                self.root.reshard()
        metrics = acceptance_metrics(stats.summary())
        self.last = (step, metrics)
        if self.is_main:
            rates = " ".join(f"{metrics[f'greedy_accept@{k + 1}']:.2f}" for k in range(stats.block_size))
            logger.info(
                "eval step %d | greedy tau %.3f | accept@k %s | %d rounds on %d held-out answers",
                step,
                metrics["greedy_tau"],
                rates,
                stats.rounds,
                stats.sequences,
            )
        return metrics


__all__ = ["AcceptanceEvaluator", "acceptance_metrics"]
