"""Upstream's DSpark trainer module, with CP-native steps: each CP rank trains its shard's anchors.

``compute_dspark_loss`` (nemo_automodel 0.7.0) already normalises every loss term by its
denominator all-reduced over the whole world and scales by the world size, so once the
draft's gradients are averaged over dp x cp (``recipes/parallel.py``) a CP rank that sums
only its own anchors' terms contributes exactly its share of the CP=1 gradient.

What the CP step adds is the reporting: upstream's metric window reduces over dp only, so
each rank's metrics are made CP-wide here, with one small all-reduce over the CP group per
micro-batch (no host read): every CP peer reports the value a CP=1 rank would report on the
same batch (loss, CE, TV and confidence terms as global ratios; acceptance sums summed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from nemo_automodel.components.speculative.dspark.core import DSparkStepMetrics, DSparkTrainerModule
from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

from nemo_automodel_ext.models.deepseek_v41.cp_draft import DraftShard

_EPSILON = 1e-6  # upstream's denominator guard in compute_dspark_loss


class PackedDSparkTrainerModule(DSparkTrainerModule):
    """``DSparkTrainerModule`` that also runs one context-parallel shard of a packed batch.

    Constructor arguments are upstream's. Without ``shard`` the forward is upstream's.
    """

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
        shard: DraftShard | None = None,
    ) -> DSparkStepMetrics:
        """Run the draft and compute the DSpark loss; with ``shard``, on this CP rank's anchors.

        Args:
            input_ids, loss_mask, position_ids, seq_lens, doc_remaining: The batch [batch,
                sequence] (with a shard: the whole packed batch, identical on every CP rank).
            target_hidden_states, target_last_hidden_states: Target captures [batch, sequence,
                ...], or with a shard the local [batch, shard.stop - shard.start, ...] slices.
            shard: This rank's ``DraftShard`` under CP-native training.

        Returns:
            Upstream's DSparkStepMetrics. With a shard: ``loss`` back-propagates this rank's
            anchors' terms (global normaliser) and its value, like every other metric, is the
            CP-wide one, equal on every CP peer.
        """
        if shard is None:
            return super().forward(
                input_ids,
                target_hidden_states,
                loss_mask,
                target_last_hidden_states,
                position_ids,
                seq_lens,
                doc_remaining,
            )
        outputs = self.draft_model.forward_shard(
            shard,
            input_ids,
            target_hidden_states,
            loss_mask,
            target_last_hidden_states,
            position_ids,
            seq_lens,
            doc_remaining,
        )
        loss, terms = compute_dspark_loss(
            outputs=outputs,
            loss_decay_gamma=self.loss_decay_gamma,
            ce_loss_alpha=self.ce_loss_alpha,
            l1_loss_alpha=self.l1_loss_alpha,
            confidence_head_alpha=self.confidence_head_alpha,
            return_terms=True,
        )
        return cp_step_metrics(loss, terms, slot_weights(outputs.eval_mask, self.loss_decay_gamma), shard)


def slot_weights(eval_mask: torch.Tensor, loss_decay_gamma: float | None) -> torch.Tensor:
    """The loss normaliser of a micro-batch: the sum of upstream's per-slot loss weights.

    Args:
        eval_mask: Supervised slots [batch, anchors, block].
        loss_decay_gamma: Upstream's slot decay (slot k weighs ``exp(-k / gamma)``); None or
            <= 0 weighs every slot 1.

    Returns:
        New fp32 scalar tensor: the denominator of the CE (and TV, confidence) term.
    """
    counts = eval_mask.to(torch.float32).sum(dim=(0, 1))
    if loss_decay_gamma is not None and loss_decay_gamma > 0:
        slots = torch.arange(counts.shape[0], device=counts.device, dtype=torch.float32)
        counts = counts * torch.exp(-slots / float(loss_decay_gamma))
    return counts.sum()


def cp_step_metrics(
    loss: torch.Tensor, terms: dict[str, torch.Tensor], weights: torch.Tensor, shard: DraftShard
) -> DSparkStepMetrics:
    """CP-wide step metrics from one CP rank's share (one all-reduce over the CP group).

    Args:
        loss: This rank's backward loss (upstream's: its terms over the world-reduced
            normalisers, times the world size), a scalar with autograd history.
        terms: ``compute_dspark_loss(..., return_terms=True)``'s terms of this rank's anchors.
        weights: ``slot_weights`` of this rank's anchors (scalar).
        shard: This rank's ``DraftShard`` (its group and size).

    Returns:
        DSparkStepMetrics whose values equal a CP=1 rank's on the whole batch: the loss value
        is the mean over the CP group of the backward losses (its gradient stays this rank's),
        CE/TV/confidence are ratios of CP-summed numerators and normalisers, and the
        acceptance sums are CP sums. New tensors.
    """
    ratios = ("ce_loss", "l1_loss", "confidence_loss")
    sums = (
        "tau_num",
        "tau_den",
        "confidence_abs_error_num",
        "confidence_bias_num",
        "confidence_cumprod_bias_num",
        "confidence_diag_den",
    )
    block = terms["accept_rate_per_pos_num"].shape[0]
    packed = torch.cat(
        [
            torch.stack(
                [loss.detach().float(), weights.float()]
                + [terms[name].float() * (weights + _EPSILON) for name in ratios]
                + [terms[name].float() for name in sums]
            ),
            terms["accept_rate_per_pos_num"].float(),
            terms["accept_rate_per_pos_den"].float(),
        ]
    )
    if shard.size > 1:
        dist.all_reduce(packed, group=shard.group)
    values = dict(zip(("loss", "weights", *ratios, *sums), packed[: 2 + len(ratios) + len(sums)], strict=True))
    total = values["weights"] + _EPSILON
    reported = values["loss"] / shard.size
    accept = packed[2 + len(ratios) + len(sums) :]
    return DSparkStepMetrics(
        loss=loss + (reported - loss.detach()),
        ce_loss=values["ce_loss"] / total,
        l1_loss=values["l1_loss"] / total,
        confidence_loss=values["confidence_loss"] / total,
        accept_rate_per_pos_num=accept[:block],
        accept_rate_per_pos_den=accept[block:],
        **{name: values[name] for name in sums},
    )


__all__ = ["PackedDSparkTrainerModule", "cp_step_metrics", "slot_weights"]
