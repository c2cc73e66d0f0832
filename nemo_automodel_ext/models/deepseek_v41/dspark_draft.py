"""The V4.1 DSpark draft on packed rows: every draft block stays inside its anchor's document.

nemo_automodel 0.7.0's ``DeepseekV41DSparkModel`` takes no packing metadata, so on packed
rows its anchor blocks would read context and labels of neighbouring documents (the
recipe refuses it for that reason). ``DeepseekV41PackedDSparkModel`` keeps the released
module, its weights and checkpoint keys, and adds the packed contract of upstream's
Qwen3 draft through the draft's own extension points:

- positions: the context uses the batch's document-local ``position_ids``; a block's
  positions continue from its anchor's (``common.create_position_ids``);
- attention: a block sees only context tokens of its anchor's document
  (``common.context_doc_ids``), on top of the released sliding-window mask;
- supervision: each block is truncated at its anchor's document end
  (``common.build_eval_mask`` with ``doc_remaining``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41DSparkConfig
from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
from nemo_automodel.components.speculative.dspark.common import (
    DSparkForwardOutput,
    build_eval_mask,
    context_doc_ids,
    create_position_ids,
)


@dataclasses.dataclass
class _PackedRows:
    """Packing metadata of the forward in flight; ``anchor_positions`` is recorded during it."""

    position_ids: torch.Tensor
    document_ids: torch.Tensor
    anchor_positions: torch.Tensor | None = None


class DeepseekV41PackedDSparkModel(DeepseekV41DSparkModel):
    """``DeepseekV41DSparkModel`` that also accepts packed rows (``seq_lens``).

    Same constructor, parameters and state-dict keys as upstream; unpacked calls are
    upstream's forward unchanged.
    """

    _packed: _PackedRows | None = None

    @classmethod
    def from_options(cls, options: DeepseekV41DSparkConfig, **kwargs: Any) -> DeepseekV41PackedDSparkModel:
        """Build from upstream's validated draft options.

        Args:
            options: ``DeepseekV41DSparkConfig``; its released-contract checks run first
                (on the meta device, so nothing is allocated twice).
            **kwargs: Extra constructor arguments (``backend``).

        Returns:
            A new, initialised packed draft.
        """
        with torch.device("meta"):
            reference = options.build()
        return cls(
            reference.config,
            num_anchors=reference.num_anchors,
            enable_confidence_head=reference.enable_confidence_head,
            confidence_head_stop_gradient=reference.confidence_head_stop_gradient,
            **kwargs,
        )

    def build_position_ids(self, anchor_positions: torch.Tensor, context_sequence: int) -> torch.Tensor:
        """Positions [batch, context_sequence + anchors * block_size]; document-local when packed."""
        if self._packed is None:
            return super().build_position_ids(anchor_positions, context_sequence)
        self._packed.anchor_positions = anchor_positions
        context = self._packed.position_ids
        draft = create_position_ids(anchor_positions, self.config.dspark_block_size, context)
        return torch.cat((context, draft), dim=1)

    def build_attention_mask(
        self,
        anchor_positions: torch.Tensor,
        block_keep_mask: torch.Tensor,
        context_sequence: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Released mask [batch, 1, draft, context + draft]; packed rows also hide other documents."""
        mask = super().build_attention_mask(anchor_positions, block_keep_mask, context_sequence, dtype)
        if self._packed is None:
            return mask
        documents = self._packed.document_ids
        anchor_document = documents.gather(1, anchor_positions).repeat_interleave(self.config.dspark_block_size, 1)
        foreign = documents.unsqueeze(1) != anchor_document.unsqueeze(2)  # [batch, draft, context]
        context_mask = mask[..., :context_sequence].masked_fill(foreign.unsqueeze(1), float("-inf"))
        return torch.cat((context_mask, mask[..., context_sequence:]), dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
    ) -> DSparkForwardOutput:
        """Run DSpark training for sampled anchors, packed or not.

        Args:
            input_ids: Target tokens [batch, sequence].
            target_hidden_states: Target features [batch, sequence, target_layers * hidden].
            loss_mask: Supervision mask [batch, sequence].
            target_last_hidden_states: Optional final target states [batch, sequence, hidden].
            position_ids: Packed only: document-local positions [batch, sequence].
            seq_lens: Packed only: document lengths [batch, documents], rows summing to sequence.
            doc_remaining: Packed only: real tokens after each slot in its document [batch, sequence].

        Returns:
            Upstream's DSparkForwardOutput; on packed rows ``eval_mask`` is truncated at each
            anchor's document end. Inputs are not modified.
        """
        if seq_lens is None:
            return super().forward(input_ids, target_hidden_states, loss_mask, target_last_hidden_states)
        batch, sequence = input_ids.shape
        for name, value in (("position_ids", position_ids), ("doc_remaining", doc_remaining)):
            if not isinstance(value, torch.Tensor) or value.shape != (batch, sequence):
                raise ValueError(
                    f"packed DSpark draft input needs {name} of shape [batch={batch}, sequence={sequence}]"
                )
        self._packed = _PackedRows(position_ids, context_doc_ids(seq_lens, sequence, input_ids.device))
        try:
            output = super().forward(input_ids, target_hidden_states, loss_mask, target_last_hidden_states)
            anchors = self._packed.anchor_positions
        finally:
            self._packed = None
        label_indices = anchors.unsqueeze(-1) + torch.arange(
            1, self.config.dspark_block_size + 1, device=anchors.device
        )
        safe_label_indices = label_indices.clamp(max=sequence - 1).masked_fill(~output.block_keep_mask.unsqueeze(-1), 0)
        eval_mask = build_eval_mask(
            seq_len=sequence,
            loss_mask=loss_mask,
            label_indices=label_indices,
            safe_label_indices=safe_label_indices,
            block_keep_mask=output.block_keep_mask,
            doc_remaining=doc_remaining,
            anchor_positions=anchors,
        )
        return dataclasses.replace(output, eval_mask=eval_mask)


__all__ = ["DeepseekV41PackedDSparkModel"]
