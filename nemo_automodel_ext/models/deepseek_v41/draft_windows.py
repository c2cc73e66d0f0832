"""Which target-context tokens each DSpark draft block reads: per-anchor sliding windows.

A V4.1 draft block anchored at row column ``a`` attends to at most ``sliding_window`` context
tokens before ``a`` (never before its document's start), to its own block and to the sink.
The released training path materialises that as a dense additive mask [batch, 1, anchors *
block, row + anchors * block]. ``draft_windows`` describes the same visibility by index:

- ``context_columns``: the row columns that at least one window reads, ascending and each
  once (the union of the windows), so the context projections run once per needed token;
- ``window_slots``: for every anchor and window offset, the slot of that token in
  ``context_columns``.

Everything is built from the sorted anchors alone, ``O(anchors * window)``; nothing is sized
by the row except the union itself, which never exceeds ``min(row, anchors * window)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_automodel_ext.models.deepseek_v41.packing import gather_columns


@dataclass(frozen=True)
class DraftWindows:
    """Per-anchor context windows of one draft forward, as indices into a compact context.

    Attributes:
        context_columns: Row columns [batch, compact] that some window reads, ascending, each
            once; -1 marks unused slots past the union (``compact = min(row, anchors * window)``).
        window_slots: Compact slot [batch, anchors, window] of each window token; 0 where
            ``window_valid`` is false. Window offset ``t`` is row column ``anchor - window + t``.
        window_valid: Boolean [batch, anchors, window]: the token is visible (inside the row,
            the anchor's document and the window, and the anchor is kept).
    """

    context_columns: torch.Tensor
    window_slots: torch.Tensor
    window_valid: torch.Tensor

    @property
    def window(self) -> int:
        return self.window_slots.shape[2]

    def gather_context(self, values: torch.Tensor, columns: int) -> torch.Tensor:
        """The compact context of a row tensor.

        Args:
            values: Tensor [batch, columns, ...] in row coordinates.
            columns: Its required size along dimension 1 (the row length).

        Returns:
            New tensor [batch, compact, ...]; zeros at unused slots, gradients reach gathered
            entries only. ``values`` is not modified.
        """
        return gather_columns(values, self.context_columns, columns, 0, "target_hidden_states")

    def gather_windows(self, compact: torch.Tensor) -> torch.Tensor:
        """Expand a compact context [batch, compact, ...] to per-anchor windows [batch, anchors, window, ...]."""
        batch, anchors, window = self.window_slots.shape
        flat = self.window_slots.reshape(batch, anchors * window)
        trailing = compact.shape[2:]
        index = flat.view(batch, anchors * window, *([1] * len(trailing))).expand(-1, -1, *trailing)
        return compact.gather(1, index).view(batch, anchors, window, *trailing)


def draft_windows(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    document_starts: torch.Tensor,
    window: int,
    row_length: int,
) -> DraftWindows:
    """Index the sliding windows of a draft forward's anchors.

    Args:
        anchors: Integer anchor columns [batch, anchors]; the kept ones ascending and first
            (the order ``sample_anchor_positions`` and the packed sampler return).
        keep: Boolean [batch, anchors]; dropped (dummy) anchors read no context.
        document_starts: First column [batch, anchors] of each anchor's document (zeros for
            unpacked rows); windows never reach before it.
        window: The draft's ``sliding_window`` (positive).
        row_length: Columns of the row the anchors index.

    Returns:
        DraftWindows on ``anchors.device``; every tensor is new and inputs are not modified.
    """
    batch, count = anchors.shape
    anchors = anchors.long()
    # Window [low, high) of each anchor. Dummies repeat the last kept end with an empty window,
    # so ``high`` is non-decreasing along the anchors, and so is ``low``.
    high = anchors.where(keep, 0).cummax(dim=1).values
    low = torch.maximum(anchors - window, document_starts.long()).where(keep, high)
    # The union as disjoint segments: anchor i adds [max(low_i, high_{i-1}), high_i). A gap in
    # the union can only lie before low_{i-1} <= low_i, so this is exactly the new part.
    segment_low = torch.maximum(low, F.pad(high[:, :-1], (1, 0)))
    segment_length = (high - segment_low).clamp_min(0)
    segment_end = segment_length.cumsum(dim=1)
    segment_offset = segment_end - segment_length

    compact = max(1, min(row_length, count * window))
    slots = torch.arange(compact, device=anchors.device).expand(batch, compact)
    owner = torch.searchsorted(segment_end, slots.contiguous(), right=True).clamp_(max=count - 1)
    context_columns = segment_low.gather(1, owner) + (slots - segment_offset.gather(1, owner))
    context_columns = context_columns.masked_fill_(slots >= segment_end[:, -1:], -1)

    columns = anchors.unsqueeze(2) + torch.arange(-window, 0, device=anchors.device)  # [batch, anchors, window]
    window_valid = (columns >= low.unsqueeze(2)) & keep.unsqueeze(2)
    # A visible column c < anchor_i lies in the segment of the first anchor k with high_k > c.
    segment = torch.searchsorted(high, columns.view(batch, -1), right=True).clamp_(max=count - 1)
    window_slots = segment_offset.gather(1, segment) + columns.view(batch, -1) - segment_low.gather(1, segment)
    window_slots = window_slots.view(batch, count, window).masked_fill_(~window_valid, 0)
    return DraftWindows(context_columns, window_slots, window_valid)


__all__ = ["DraftWindows", "draft_windows"]
