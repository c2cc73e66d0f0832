"""The V4.1 DSpark draft, windowed and packed: its cost follows its anchors, not the row.

nemo_automodel 0.7.0's ``DeepseekV41DSparkModel`` builds a dense additive mask [batch, 1,
anchors * block, row + anchors * block] and projects every row token as context, although a
block only reads the ``sliding_window`` tokens before its anchor; it also takes no packing
metadata. ``DeepseekV41PackedDSparkModel`` keeps the released module, weights and checkpoint
keys and changes what is computed:

- context: only the union of the anchors' windows is gathered and projected
  (``draft_windows``), and each block attends to its window, its block and the sink
  (``WindowedDSparkAttention``): memory and time are flat in the row at fixed anchors;
- packed rows (``seq_lens``): windows stop at the anchor's document start, positions are the
  batch's document-local ``position_ids``, supervision stops at the document end, and anchors
  are sampled per document (``anchors.select_packed_anchors``) only where they supervise;
- explicit anchors (``anchor_positions``): evaluation chooses them;
- one context-parallel shard (``forward_shard``): the CP=1 anchor draw restricted to the
  rank's shard, on the shard's features and halos (``cp_draft``).

Unpacked rows sample anchors with upstream's ``sample_anchor_positions`` (same RNG use), so
the released dense path is the reference the windowed one is tested against.
"""

from __future__ import annotations

from typing import Any

import torch
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41DSparkConfig, DeepseekV41TextConfig
from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
from nemo_automodel.components.speculative.dspark.common import (
    DSparkForwardOutput,
    create_noise_embed,
    create_position_ids,
    sample_anchor_positions,
)

from nemo_automodel_ext.models.deepseek_v41.anchors import block_supervision, compact_anchors, select_packed_anchors
from nemo_automodel_ext.models.deepseek_v41.cp_draft import DraftShard
from nemo_automodel_ext.models.deepseek_v41.draft_attention import use_windowed_attention
from nemo_automodel_ext.models.deepseek_v41.draft_windows import draft_windows
from nemo_automodel_ext.models.deepseek_v41.packing import document_bounds, gather_columns


class DeepseekV41PackedDSparkModel(DeepseekV41DSparkModel):
    """``DeepseekV41DSparkModel`` with windowed attention, packed rows and explicit anchors.

    Same constructor (plus the packed anchor budget), parameters and state-dict keys as upstream.

    Args:
        config, backend, num_anchors, enable_confidence_head, confidence_head_stop_gradient:
            upstream's. ``num_anchors`` is the anchor count of an unpacked row.
        anchors_per_document: Packed rows: anchors each document may get (default
            ``num_anchors``, the supervision it would get unpacked).
        max_anchors_per_row: Packed rows: optional cap on a row's anchors (a memory bound).
    """

    def __init__(
        self,
        config: DeepseekV41TextConfig,
        backend=None,
        *,
        num_anchors: int,
        enable_confidence_head: bool,
        confidence_head_stop_gradient: bool = False,
        anchors_per_document: int | None = None,
        max_anchors_per_row: int | None = None,
    ) -> None:
        super().__init__(
            config,
            backend,
            num_anchors=num_anchors,
            enable_confidence_head=enable_confidence_head,
            confidence_head_stop_gradient=confidence_head_stop_gradient,
        )
        use_windowed_attention(self)
        self.anchors_per_document = self.num_anchors if anchors_per_document is None else int(anchors_per_document)
        self.max_anchors_per_row = None if max_anchors_per_row is None else int(max_anchors_per_row)
        if self.anchors_per_document <= 0 or (self.max_anchors_per_row is not None and self.max_anchors_per_row <= 0):
            raise ValueError(
                f"anchors_per_document ({self.anchors_per_document}) and max_anchors_per_row "
                f"({self.max_anchors_per_row}) must be positive"
            )

    @classmethod
    def from_options(
        cls,
        options: DeepseekV41DSparkConfig,
        *,
        anchors_per_document: int | None = None,
        max_anchors_per_row: int | None = None,
        **kwargs: Any,
    ) -> DeepseekV41PackedDSparkModel:
        """Build from upstream's validated draft options.

        Args:
            options: ``DeepseekV41DSparkConfig``; its released-contract checks run first
                (on the meta device, so nothing is allocated twice).
            anchors_per_document, max_anchors_per_row: the packed anchor budget (see the class).
            **kwargs: Extra constructor arguments (``backend``).

        Returns:
            A new, initialised draft.
        """
        with torch.device("meta"):
            reference = options.build()
        return cls(
            reference.config,
            num_anchors=reference.num_anchors,
            enable_confidence_head=reference.enable_confidence_head,
            confidence_head_stop_gradient=reference.confidence_head_stop_gradient,
            anchors_per_document=anchors_per_document,
            max_anchors_per_row=max_anchors_per_row,
            **kwargs,
        )

    def sample_anchors(
        self,
        loss_mask: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training anchors of a batch, drawn from the default RNG.

        Args:
            loss_mask: Supervision mask [batch, row].
            seq_lens: Packed only: document lengths [batch, documents].
            doc_remaining: Packed only: real tokens after each column in its document [batch, row].

        Returns:
            ``(anchors, keep)`` [batch, anchors]: int64 columns, kept ones ascending and first,
            and the bool keep mask. Unpacked rows: upstream's ``sample_anchor_positions`` with
            ``num_anchors``; packed rows: ``anchors_per_document`` per document (one host read
            sizes the result).
        """
        if seq_lens is None:
            return sample_anchor_positions(
                seq_len=loss_mask.shape[1], loss_mask=loss_mask, num_anchors=self.num_anchors, device=loss_mask.device
            )
        return compact_anchors(self._select_packed(loss_mask, seq_lens, doc_remaining)[0])

    def _select_packed(
        self, loss_mask: torch.Tensor, seq_lens: torch.Tensor, doc_remaining: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed anchor draw (default RNG), shared by every rank of a CP group.

        Returns:
            ``select_packed_anchors``' ``(chosen [batch, row - 1] bool, cap_order or None)``.
        """
        return select_packed_anchors(
            loss_mask, doc_remaining, seq_lens, self.anchors_per_document, self.max_anchors_per_row, with_cap_order=True
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
        *,
        anchor_positions: torch.Tensor | None = None,
        block_keep_mask: torch.Tensor | None = None,
    ) -> DSparkForwardOutput:
        """Run DSpark training (or scoring) for sampled or given anchors, packed or not.

        Args:
            input_ids: Target tokens [batch, row].
            target_hidden_states: Target features [batch, row, target_layers * hidden].
            loss_mask: Supervision mask [batch, row].
            target_last_hidden_states: Optional final target states [batch, row, hidden], for the
                probability-distance loss.
            position_ids: Packed only: document-local positions [batch, row].
            seq_lens: Packed only: document lengths [batch, documents], in row order.
            doc_remaining: Packed only: real tokens after each column in its document [batch, row].
            anchor_positions: Optional anchors [batch, anchors] (kept ones ascending and first);
                sampled with ``sample_anchors`` when omitted.
            block_keep_mask: Optional bool [batch, anchors] for ``anchor_positions`` (all kept
                when omitted).

        Returns:
            Upstream's DSparkForwardOutput: draft logits [batch, anchors, block, vocab] (fp32),
            target ids, eval mask (truncated at each anchor's document end on packed rows) and
            confidence [batch, anchors, block], keep mask [batch, anchors], aligned target
            logits [batch, anchors, block, vocab] when ``target_last_hidden_states`` is given.
            New tensors; inputs are not modified.

        Raises:
            ValueError: naming the argument whose shape does not match ``input_ids``.
        """
        batch, row = input_ids.shape
        _require_shape("target_hidden_states", target_hidden_states, (batch, row))
        _require_shape("loss_mask", loss_mask, (batch, row))
        if target_last_hidden_states is not None:
            _require_shape("target_last_hidden_states", target_last_hidden_states, (batch, row))
        if seq_lens is not None:
            _require_shape("position_ids", position_ids, (batch, row), "packed DSpark draft input: ")
            _require_shape("doc_remaining", doc_remaining, (batch, row), "packed DSpark draft input: ")
            if not isinstance(seq_lens, torch.Tensor) or seq_lens.ndim != 2 or seq_lens.shape[0] != batch:
                raise ValueError(f"packed DSpark draft input needs seq_lens of shape [batch={batch}, documents]")
        else:
            position_ids = doc_remaining = None
        if anchor_positions is None:
            anchor_positions, block_keep_mask = self.sample_anchors(loss_mask, seq_lens, doc_remaining)
        else:
            if anchor_positions.ndim != 2 or anchor_positions.shape[0] != batch:
                raise ValueError(f"anchor_positions must have shape [batch={batch}, anchors]")
            if block_keep_mask is None:
                block_keep_mask = torch.ones_like(anchor_positions, dtype=torch.bool)
            elif block_keep_mask.shape != anchor_positions.shape:
                raise ValueError("block_keep_mask must have the shape of anchor_positions")
        anchors = anchor_positions.long()
        return self._forward_anchors(
            input_ids,
            target_hidden_states,
            loss_mask,
            target_last_hidden_states,
            anchors,
            block_keep_mask.bool(),
            position_ids,
            _document_starts(seq_lens, anchors),
            doc_remaining,
        )

    def forward_shard(
        self,
        shard: DraftShard,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None,
        position_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        doc_remaining: torch.Tensor,
    ) -> DSparkForwardOutput:
        """Train the anchors of one context-parallel rank's shard (``cp_draft``).

        Anchors are drawn over the whole caller row exactly as ``forward`` draws them (same
        RNG use), and this rank keeps those inside its shard, at most its share of
        ``max_anchors_per_row`` (``DraftShard.own_anchors``); where the share does not bind,
        the blocks across the CP group are the CP=1 blocks, each computed once.

        Args:
            shard: This rank's ``DraftShard``.
            input_ids, loss_mask, position_ids, doc_remaining: The whole packed batch
                [batch, sequence] in caller coordinates (token-sized; every CP rank holds it).
            target_hidden_states: Local target features [batch, shard.stop - shard.start,
                target_layers * hidden]: the shard and its feature halo (``shard.exchange``).
            target_last_hidden_states: Optional local final target states [batch,
                shard.stop - shard.start, hidden]: the shard and its teacher halo.
            seq_lens: Document lengths [batch, documents].

        Returns:
            DSparkForwardOutput of this rank's anchors (shapes as ``forward``'s, with this rank's
            anchor count). New tensors; inputs are not modified.

        Raises:
            ValueError: naming the argument whose shape does not match.
        """
        batch, row = input_ids.shape
        local = (batch, shard.stop - shard.start)
        for name, value in (("loss_mask", loss_mask), ("position_ids", position_ids), ("doc_remaining", doc_remaining)):
            _require_shape(name, value, (batch, row), "CP DSpark draft input: ")
        if tuple(shard.layout.input_positions.shape) != (batch, row):
            raise ValueError(
                f"CP DSpark draft: the shard's layout covers {tuple(shard.layout.input_positions.shape)}, "
                f"the batch is [batch={batch}, sequence={row}]"
            )
        _require_shape("target_hidden_states", target_hidden_states, local, "CP DSpark draft (shard + halo): ")
        if target_last_hidden_states is not None:
            _require_shape("target_last_hidden_states", target_last_hidden_states, local, "CP DSpark draft: ")
        selected, cap_order = self._select_packed(loss_mask, seq_lens, doc_remaining)
        anchors, keep, document_starts = shard.own_anchors(selected, seq_lens, cap_order, self.max_anchors_per_row)
        return self._forward_anchors(
            shard.local(input_ids),
            target_hidden_states,
            shard.local(loss_mask),
            target_last_hidden_states,
            anchors,
            keep,
            shard.local(position_ids),
            document_starts,
            shard.local(doc_remaining),
        )

    def _forward_anchors(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        position_ids: torch.Tensor | None,
        document_starts: torch.Tensor,
        doc_remaining: torch.Tensor | None,
    ) -> DSparkForwardOutput:
        """``forward`` once the anchors, keep mask and anchors' document starts [batch, anchors] are known.

        Other arguments as in ``forward``, in the coordinates of the anchors' row.
        """
        batch, row = input_ids.shape
        count = anchors.shape[1]
        block = self.config.dspark_block_size
        _, safe_columns, eval_mask = block_supervision(anchors, keep, loss_mask, block, doc_remaining)
        target_ids = input_ids.gather(1, safe_columns.view(batch, -1)).view(batch, count, block)
        # Teacher forcing: each slot's Markov input is the token before it (the anchor, then labels).
        previous_token_ids = torch.cat((input_ids.gather(1, anchors).unsqueeze(-1), target_ids[..., :-1]), dim=-1)
        backbone_output = self._run_backbone(
            input_ids, target_hidden_states, anchors, keep, position_ids, document_starts, previous_token_ids
        )
        if backbone_output.transition_logits is None:
            raise RuntimeError("The final DSpark stage did not produce Markov logits")

        aligned_target_logits = None
        if target_last_hidden_states is not None:
            # The target's state at column c predicts the token at c + 1.
            teacher = gather_columns(
                target_last_hidden_states.detach(),
                (safe_columns - 1).clamp_min(0).view(batch, -1),
                row,
                0,
                "target_last_hidden_states",
            )
            aligned_target_logits = self.compute_logits(teacher.view(batch, count, block, -1))
        normalized = backbone_output.normalized_hidden_states.view(batch, count, block, -1)
        transition = backbone_output.transition_logits.view(batch, count, block, -1)
        confidence = backbone_output.confidence_pred
        return DSparkForwardOutput(
            draft_logits=self.compute_logits(normalized) + transition.float(),
            target_ids=target_ids,
            eval_mask=eval_mask,
            block_keep_mask=keep,
            confidence_pred=None if confidence is None else confidence.view(batch, count, block),
            aligned_target_logits=aligned_target_logits,
        )

    def _run_backbone(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        position_ids: torch.Tensor | None,
        document_starts: torch.Tensor,
        previous_token_ids: torch.Tensor | None,
    ):
        """The released backbone over the anchors' blocks and the union of their windows.

        Args:
            input_ids, target_hidden_states, position_ids: as in ``forward``.
            anchors, keep: Anchor columns and keep mask [batch, anchors].
            document_starts: First column of each anchor's document [batch, anchors] (windows
                stop there).
            previous_token_ids: Markov inputs [batch, anchors, block], or None for states only.

        Returns:
            Upstream's backbone output: normalized states [batch, anchors * block, hidden] and,
            with ``previous_token_ids``, Markov logits and confidence.
        """
        batch, row = input_ids.shape
        block = self.config.dspark_block_size
        windows = draft_windows(anchors, keep, document_starts, self.config.sliding_window, row)
        noise_embeddings = create_noise_embed(
            self.embed_tokens,
            input_ids,
            anchors,
            keep,
            mask_token_id=self.config.dspark_noise_token_id,
            block_size=block,
        )
        row_positions = position_ids if position_ids is not None else torch.arange(row, device=anchors.device)
        context_positions = row_positions.expand(batch, row).gather(1, windows.context_columns.clamp_min(0))
        draft_positions = create_position_ids(anchors, block, position_ids)
        return super(DeepseekV41DSparkModel, self).forward(
            noise_embeddings,
            windows.gather_context(target_hidden_states.detach(), row),
            position_ids=torch.cat((context_positions, draft_positions), dim=1),
            attention_mask=windows,
            previous_token_ids=None if previous_token_ids is None else previous_token_ids.reshape(batch, -1),
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_stop_gradient=self.confidence_head_stop_gradient,
        )

    def block_logits(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        anchor_positions: torch.Tensor,
        block_keep_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Proposal logits of the blocks seeded at ``anchor_positions``, without the Markov term.

        A block's states depend on its anchor token, the mask token and the target context before
        the anchor only, so decoding adds ``markov_logits`` of its own previous proposal to slot k:
        ``draft_logits[..., k, :] == block_logits[..., k, :] + markov_logits(previous token)``.

        Args:
            input_ids: Tokens [batch, row]; only anchor tokens are read.
            target_hidden_states: Target features [batch, row, target_layers * hidden]; only the
                anchors' windows are read.
            anchor_positions: Anchors [batch, anchors], kept ones ascending and first.
            block_keep_mask: Optional bool [batch, anchors] (all kept when omitted).
            position_ids, seq_lens: Packed rows, as in ``forward``.

        Returns:
            New fp32 tensor [batch, anchors, block, vocab].
        """
        anchors = anchor_positions.long()
        keep = torch.ones_like(anchors, dtype=torch.bool) if block_keep_mask is None else block_keep_mask.bool()
        output = self._run_backbone(
            input_ids, target_hidden_states, anchors, keep, position_ids, _document_starts(seq_lens, anchors), None
        )
        states = output.normalized_hidden_states.view(*anchors.shape, self.config.dspark_block_size, -1)
        return self.compute_logits(states)

    def markov_logits(self, previous_token_ids: torch.Tensor) -> torch.Tensor:
        """The Markov head's fp32 transition logits [..., vocab] for preceding tokens [...]."""
        return self.mtp[-1].markov_head(previous_token_ids)[0].float()


def _document_starts(seq_lens: torch.Tensor | None, anchors: torch.Tensor) -> torch.Tensor:
    """First column of each anchor's document [batch, anchors] (zeros for an unpacked row)."""
    return torch.zeros_like(anchors) if seq_lens is None else document_bounds(seq_lens, anchors).start


def _require_shape(name: str, value: object, leading: tuple[int, ...], prefix: str = "") -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape[: len(leading)]) != leading:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        dims = ", ".join(f"{axis}={size}" for axis, size in zip(("batch", "sequence"), leading))
        raise ValueError(f"{prefix}{name} must have shape [{dims}, ...], got {got}")


__all__ = ["DeepseekV41PackedDSparkModel"]
