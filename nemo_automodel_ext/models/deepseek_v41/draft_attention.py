"""Windowed attention for the V4.1 DSpark draft: each block reads its window, its block and the sink.

``WindowedDSparkAttention`` is upstream's ``_DeepseekV41DSparkAttention`` (same parameters, same
projections, RoPE, fp8 cache rounding and output projection) with one change: given a
``DraftWindows`` instead of a dense mask, it attends each block of ``block`` queries to
``window + block + 1`` keys (its window of the compact context, its own block, the sink), so
the logits are [batch, anchors, heads, block, window + block + 1] whatever the row length.
Given a tensor mask it runs the released dense path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nemo_automodel.components.models.deepseek_v41.attention import _apply_rope
from nemo_automodel.components.models.deepseek_v41.dspark import _DeepseekV41DSparkAttention
from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

from nemo_automodel_ext.models.deepseek_v41.draft_windows import DraftWindows


class WindowedDSparkAttention(_DeepseekV41DSparkAttention):
    """The released DSpark attention, computed per anchor window when given ``DraftWindows``.

    Adds no parameters or buffers: ``use_windowed_attention`` turns existing upstream
    instances into this class, so state-dict keys and initialisation are upstream's.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden_states: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | DraftWindows,
    ) -> torch.Tensor:
        """Attend draft blocks to their context windows and to themselves.

        Args:
            hidden_states: Draft tensor [batch, anchors * block, hidden].
            target_hidden_states: Projected compact context [batch, compact, hidden]: the row
                columns ``attention_mask.context_columns`` in that order.
            position_ids: Integer RoPE positions [batch, compact + anchors * block].
            attention_mask: ``DraftWindows`` of this forward, or the released dense additive mask
                [batch, 1, draft, context + draft] (then every argument has upstream's meaning).

        Returns:
            Tensor [batch, anchors * block, hidden]. Inputs are not mutated.
        """
        if isinstance(attention_mask, torch.Tensor):
            return super().forward(
                hidden_states, target_hidden_states, position_ids=position_ids, attention_mask=attention_mask
            )
        windows = attention_mask
        batch, draft_sequence, _ = hidden_states.shape
        compact = target_hidden_states.shape[1]
        anchors, window = windows.window_slots.shape[1:]
        block = draft_sequence // max(anchors, 1)
        if block * anchors != draft_sequence or windows.context_columns.shape != (batch, compact):
            raise ValueError(
                f"DSpark windows for {anchors} anchors over {windows.context_columns.shape[1]} context tokens do not "
                f"match draft states [batch={batch}, draft={draft_sequence}] and context [compact={compact}]"
            )
        if position_ids.shape != (batch, compact + draft_sequence):
            raise ValueError("DSpark position_ids must cover the compact context and the draft blocks")
        heads, head_dim = self.num_heads, self.head_dim

        draft_angles = self.rotary_emb(position_ids[:, compact:])
        query = self.wq_b(self.q_norm(self.wq_a(hidden_states))).unflatten(-1, (heads, head_dim))
        query = _apply_rope(query, draft_angles)
        context_kv = self._cached_kv(target_hidden_states, self.rotary_emb(position_ids[:, :compact]))
        draft_kv = self._cached_kv(hidden_states, draft_angles)

        # Keys of one block: its window, its own block, then the zero-valued sink key.
        keys = torch.cat(
            (
                windows.gather_windows(context_kv),
                draft_kv.view(batch, anchors, block, head_dim),
                draft_kv.new_zeros(batch, anchors, 1, head_dim),
            ),
            dim=2,
        )  # [batch, anchors, window + block + 1, head_dim]
        window_bias = torch.zeros(windows.window_valid.shape, device=keys.device).masked_fill_(
            ~windows.window_valid, float("-inf")
        )
        sink = self.sinks_param(query).float().view(1, 1, 1, heads, 1)
        bias = torch.cat(
            (
                window_bias.view(batch, anchors, 1, 1, window).expand(-1, -1, block, heads, -1),
                window_bias.new_zeros(1, 1, 1, 1, block).expand(batch, anchors, block, heads, -1),
                sink.expand(batch, anchors, block, -1, -1),
            ),
            dim=-1,
        )  # [batch, anchors, block, heads, window + block + 1]
        queries = query.view(batch, anchors, block, heads, head_dim)
        if self.backend.attn == "sdpa":
            # One KV head: the block's heads x block query rows are one head's rows against the block's keys.
            # SDPA's math path (the one CUDA takes here: head_dim 512 is beyond flash attention) would broadcast
            # a [anchors, 1, keys, head_dim] key to every head for its matmuls and their gradients: 55 MB an
            # anchor at Flash widths instead of 22 (docs/gpu_check.md). Folded, the keys are never copied.
            attended = F.scaled_dot_product_attention(
                queries.view(batch * anchors, 1, block * heads, head_dim),
                keys.flatten(0, 1).unsqueeze(1),
                keys.flatten(0, 1).unsqueeze(1),
                attn_mask=bias.view(batch * anchors, 1, block * heads, -1),
                dropout_p=self.attention_dropout if self.training else 0.0,
                scale=head_dim**-0.5,
            )
        else:
            logits = torch.einsum("baqhd,batd->baqht", queries.float(), keys.float()) * head_dim**-0.5
            probabilities = F.dropout((logits + bias).softmax(dim=-1), p=self.attention_dropout, training=self.training)
            attended = torch.einsum("baqht,batd->baqhd", probabilities, keys.float()).to(query.dtype)
        attended = attended.reshape(batch, draft_sequence, heads, head_dim)
        valid_tokens = torch.ones(batch, draft_sequence, dtype=torch.bool, device=hidden_states.device)
        return self._project_output(attended, draft_angles, valid_tokens)

    def _cached_kv(self, states: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The released single-head KV of ``states`` [batch, tokens, hidden]: RoPE, then fp8 cache rounding."""
        return quantize_cache(_apply_rope(self.kv_norm(self.wkv(states)), angles), format="fp8", block_size=32)


def use_windowed_attention(draft: torch.nn.Module) -> None:
    """Make every DSpark attention module of ``draft`` a ``WindowedDSparkAttention``, in place.

    The instances keep their parameters, buffers and hooks; only the class changes (as
    ``fully_shard`` does), since upstream builds them inside its released blocks.
    """
    for module in draft.modules():
        if type(module) is _DeepseekV41DSparkAttention:
            module.__class__ = WindowedDSparkAttention


__all__ = ["WindowedDSparkAttention", "use_windowed_attention"]
