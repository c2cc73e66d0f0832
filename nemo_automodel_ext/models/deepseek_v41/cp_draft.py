"""CP-native draft training: each context-parallel rank trains the anchors of its own shard.

Under context parallelism the target runs on contiguous shards of the aligned packed row
(``cp.py``): rank ``r`` of ``cp`` holds aligned columns ``[r * S, (r + 1) * S)``,
``S = aligned_sequence / cp``. A windowed draft block anchored at aligned column ``a`` reads

- target features at ``[a - sliding_window, a)`` (never before its document's start), and
- the target's last hidden state at its teacher columns ``[a, a + block)`` and the labels
  at ``(a, a + block]``.

Documents are contiguous in aligned coordinates (alignment padding only follows a
document's end), so a rank that trains exactly the anchors inside its shard needs two fixed
halos from its neighbours: ``before = sliding_window`` feature columns and ``after = block``
last-hidden columns. ``DraftShard`` describes that slice and fetches the halos point to
point (``exchange``); token-sized metadata (ids, masks, positions) is sliced from the full
batch every rank already holds. No rank holds more than ``S + before + after`` columns of
features, and the union of the ranks' anchors is exactly the CP=1 draw
(``select_packed_anchors`` with the same RNG on every CP rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_automodel_ext.models.deepseek_v41.anchors import cap_by_order, compact_anchors
from nemo_automodel_ext.models.deepseek_v41.packing import PackedSequenceLayout, document_bounds, gather_columns


@dataclass(frozen=True)
class DraftShard:
    """The aligned columns ``[start, stop)`` one CP rank trains the draft on.

    Attributes:
        layout: The full aligned layout of the batch (index tensors only: [batch, aligned_sequence]
            and [batch, sequence]); identical on every CP rank.
        rank: This rank's index in the CP group.
        size: CP group size; ``aligned_sequence`` is a multiple of it.
        before: Feature halo: columns read before the shard (the draft's ``sliding_window``).
        after: Teacher halo: columns read after the shard (the draft's block size).
        group: The CP process group (None only when ``size == 1``).
    """

    layout: PackedSequenceLayout
    rank: int
    size: int
    before: int
    after: int
    group: dist.ProcessGroup | None = None

    @property
    def width(self) -> int:
        """Aligned columns of the whole pack."""
        return self.layout.source_indices.shape[1]

    @property
    def shard_width(self) -> int:
        return self.width // self.size

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_width

    @property
    def shard_stop(self) -> int:
        return self.shard_start + self.shard_width

    @property
    def start(self) -> int:
        """First local column: the feature halo's start, clipped at the row start."""
        return max(0, self.shard_start - self.before)

    @property
    def stop(self) -> int:
        """One past the last local column: the teacher halo's end, clipped at the row end."""
        return min(self.width, self.shard_stop + self.after)

    def local(self, values: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """Slice a caller-coordinate tensor to this rank's aligned columns.

        Args:
            values: Tensor [batch, sequence, ...] in the caller's packed coordinates.
            fill: Value at alignment-padding columns.

        Returns:
            New tensor [batch, stop - start, ...]; ``values`` is not modified.
        """
        columns = self.layout.source_indices[:, self.start : self.stop]
        return gather_columns(values, columns, self.layout.input_positions.shape[1], fill, "values")

    def own_anchors(
        self,
        selected: torch.Tensor,
        seq_lens: torch.Tensor,
        cap_order: torch.Tensor | None = None,
        max_per_row: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The anchors of a caller-coordinate selection that lie in this rank's shard.

        With a row cap, this rank keeps at most its share, ``ceil(max_per_row / size)``, chosen by
        the cap's own uniform order (``cap_order``): one rank never trains every anchor of a row,
        and where the share does not bind the CP group trains exactly the CP=1 anchors.

        Args:
            selected: Boolean [batch, sequence - 1]: anchors chosen over the whole caller row
                (``select_packed_anchors``), identical on every CP rank.
            seq_lens: Document lengths [batch, documents] of the caller row.
            cap_order: The cap's order [batch, sequence - 1] (``select_packed_anchors``'
                ``with_cap_order``); needed with ``max_per_row``.
            max_per_row: The row's anchor cap, or None (no share).

        Returns:
            ``(anchors, keep, document_starts)`` [batch, anchors]: local columns (relative to
            ``start``) of the shard's anchors, kept ones ascending and first; the keep mask;
            and each anchor's document start as a local column, clipped at 0. One host read
            (the anchor count). New tensors.
        """
        aligned = self.layout.input_positions[:, : selected.shape[1]]
        mine = selected & (aligned >= self.shard_start) & (aligned < self.shard_stop)
        if max_per_row is not None and self.size > 1:
            mine = cap_by_order(mine, cap_order, -(-max_per_row // self.size))
        columns, keep = compact_anchors(mine)
        starts = document_bounds(seq_lens, columns).start
        positions = self.layout.input_positions
        anchors = (positions.gather(1, columns) - self.start).where(keep, 0)
        document_starts = (positions.gather(1, starts.clamp(max=positions.shape[1] - 1)) - self.start).clamp_min(0)
        return anchors, keep, document_starts.where(keep, 0)

    def exchange(self, captured: torch.Tensor, halo: str) -> torch.Tensor:
        """Extend this rank's captured shard with one halo from its CP peers, point to point.

        Every CP rank must call it with the same ``halo``, in the same order.

        Args:
            captured: Target activations [batch, shard_width, ...] of this rank's shard.
            halo: ``"before"`` (feature columns ``[start, shard_start)``) or ``"after"``
                (teacher columns ``[shard_stop, stop)``).

        Returns:
            New tensor [batch, stop - start, ...]: the shard and the requested halo in local
            columns, zeros in the other halo (never read). ``captured`` is not modified.
        """
        if halo not in ("before", "after"):
            raise ValueError(f"halo must be 'before' or 'after', got {halo!r}")
        batch, columns = captured.shape[:2]
        if columns != self.shard_width:
            raise ValueError(
                f"captured must have shape [batch, shard_width={self.shard_width}, ...], got {tuple(captured.shape)}"
            )
        trailing = captured.shape[2:]
        result = captured.new_zeros(batch, self.stop - self.start, *trailing)
        result[:, self.shard_start - self.start : self.shard_stop - self.start] = captured
        if self.size == 1:
            return result
        ops, received = [], []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            global_peer = dist.get_global_rank(self.group, peer)
            low, high = self._overlap(self._needs(self.rank, halo), peer)
            if low < high:
                buffer = captured.new_empty(batch, high - low, *trailing)
                ops.append(dist.P2POp(dist.irecv, buffer, global_peer, self.group))
                received.append((low, buffer))
            low, high = self._overlap(self._needs(peer, halo), self.rank)
            if low < high:
                piece = captured[:, low - self.shard_start : high - self.shard_start].contiguous()
                ops.append(dist.P2POp(dist.isend, piece, global_peer, self.group))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for low, buffer in received:
            result[:, low - self.start : low - self.start + buffer.shape[1]] = buffer
        return result

    def _needs(self, rank: int, halo: str) -> tuple[int, int]:
        """Aligned halo columns ``[low, high)`` that ``rank`` reads from its peers."""
        start, stop = rank * self.shard_width, (rank + 1) * self.shard_width
        if halo == "before":
            return max(0, start - self.before), start
        return stop, min(self.width, stop + self.after)

    def _overlap(self, columns: tuple[int, int], owner: int) -> tuple[int, int]:
        low, high = columns
        return max(low, owner * self.shard_width), min(high, (owner + 1) * self.shard_width)


def draft_shard(layout: PackedSequenceLayout, group: dist.ProcessGroup | None, before: int, after: int) -> DraftShard:
    """This rank's ``DraftShard`` of an aligned layout.

    Args:
        layout: The batch's full aligned layout (``aligned_sequence`` divisible by the group size).
        group: The CP process group, or None for one rank.
        before: Feature halo (the draft's ``sliding_window``), non-negative.
        after: Teacher halo (the draft's block size), non-negative.

    Returns:
        The shard of ``dist.get_rank(group)``.
    """
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    width = layout.source_indices.shape[1]
    if width % size:
        raise ValueError(f"aligned width {width} is not divisible by the CP size {size}")
    if before < 0 or after < 0:
        raise ValueError(f"halo sizes must be non-negative, got before={before}, after={after}")
    return DraftShard(layout, rank, size, int(before), int(after), group)


__all__ = ["DraftShard", "draft_shard"]
