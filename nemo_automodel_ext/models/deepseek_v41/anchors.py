"""Anchor sampling for packed DSpark rows: a per-document budget, anchors only where they supervise.

Upstream samples ``num_anchors`` anchors per row. On an unpacked row that row is one document;
on a packed row of many documents the same number spreads over all of them, so packing cuts
the supervision per captured target token by the number of documents. Here every document of
a packed row gets up to ``per_document`` anchors (uniformly among its candidates), as it would
alone, optionally capped per row. Candidates are upstream's (``build_anchor_candidate_mask``
with ``doc_remaining``): the anchor and its first target are supervised and inside one document,
so every kept anchor supervises at least one slot.

Selection (``select_packed_anchors``) is a [batch, row - 1] mask with no host read, so context
parallel ranks can intersect it with their shard first; ``compact_anchors`` then turns a mask
into the sorted anchor tensor with one host read (the anchor count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nemo_automodel.components.speculative.dspark.common import build_anchor_candidate_mask, build_eval_mask

from nemo_automodel_ext.models.deepseek_v41.packing import document_bounds


def select_packed_anchors(
    loss_mask: torch.Tensor,
    doc_remaining: torch.Tensor,
    seq_lens: torch.Tensor,
    per_document: int,
    max_per_row: int | None = None,
    with_cap_order: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Choose the anchors of packed rows: up to ``per_document`` per document, uniformly.

    Draws ``torch.rand(batch, row - 1)`` from the default generator (twice with ``max_per_row``),
    so ranks with the same RNG state choose the same anchors.

    Args:
        loss_mask: Supervision mask [batch, row].
        doc_remaining: Real tokens after each column in its document [batch, row].
        seq_lens: Document lengths [batch, documents]; 0 and -1000 mark absent documents.
        per_document: Anchors each document may get (positive).
        max_per_row: Optional cap on a row's anchors; when it binds, a uniform subset of the
            chosen anchors is kept (an independent draw: every chosen anchor, of a short or a
            long document, is kept with the same probability).
        with_cap_order: Also return the cap's draw, so a part of the row can be capped again
            with it (``cap_by_order``: a CP rank's share of the cap).

    Returns:
        New boolean tensor [batch, row - 1]: True at chosen anchor columns; with
        ``with_cap_order``, ``(chosen, cap_order)``: int64 [batch, row - 1], a uniform random
        permutation of the candidate columns per row (the cap keeps the first chosen ones in this
        order), or None without ``max_per_row``.
    """
    batch, row = loss_mask.shape
    valid = build_anchor_candidate_mask(seq_len=row, loss_mask=loss_mask, doc_remaining=doc_remaining)
    candidates = valid.shape[1]
    if candidates == 0:
        cap_order = None if max_per_row is None else torch.zeros(batch, 0, dtype=torch.long, device=valid.device)
        return (valid.clone(), cap_order) if with_cap_order else valid.clone()
    device = valid.device
    columns = torch.arange(candidates, device=device)
    documents = seq_lens.shape[-1]
    group = document_bounds(seq_lens, columns.expand(batch, -1)).index.masked_fill_(~valid, documents)
    noise_order = torch.rand(batch, candidates, device=device).argsort(dim=1)
    # Candidates grouped by document (invalid ones last), in random order inside each document.
    order = noise_order.gather(1, group.gather(1, noise_order).argsort(dim=1, stable=True))
    sorted_group = group.gather(1, order)
    starts = sorted_group != F.pad(sorted_group[:, :-1], (1, 0), value=-1)
    rank = columns - columns.where(starts, 0).cummax(dim=1).values
    chosen = torch.zeros_like(valid).scatter_(1, order, (rank < per_document) & (sorted_group < documents))
    cap_order = None
    if max_per_row is not None:
        # A second, independent draw: the first one ranked each document's candidates, so a long
        # document's chosen anchors hold its smallest values and would crowd out a short one's.
        cap_order = torch.rand(batch, candidates, device=device).argsort(dim=1)
        chosen = cap_by_order(chosen, cap_order, max_per_row)
    return (chosen, cap_order) if with_cap_order else chosen


def cap_by_order(selected: torch.Tensor, order: torch.Tensor, cap: int) -> torch.Tensor:
    """Keep at most ``cap`` selected columns a row: the first ones in ``order``.

    Args:
        selected: Boolean [batch, candidates].
        order: int64 [batch, candidates], a permutation of the columns per row.
        cap: Columns kept a row at most.

    Returns:
        New boolean [batch, candidates]: a subset of ``selected``.
    """
    in_order = selected.gather(1, order)
    return torch.zeros_like(selected).scatter_(1, order, in_order & (in_order.cumsum(dim=1) <= cap))


def compact_anchors(selected: torch.Tensor, minimum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted anchor columns of a selection mask, sized by the largest row (one host read).

    Args:
        selected: Boolean [batch, candidates]; True at anchor columns.
        minimum: Least number of anchor slots returned (rows without anchors get dummies).

    Returns:
        ``(anchors, keep)``: new int64 [batch, anchors] columns, kept ones ascending and first,
        dummies 0; and bool [batch, anchors] marking the kept ones (upstream's sampler format).
    """
    batch, candidates = selected.shape
    counts = selected.sum(dim=1)
    size = max(int(counts.max()) if batch else 0, minimum)
    slot = (selected.cumsum(dim=1) - 1).masked_fill_(~selected, size)  # unchosen land in a spill slot
    anchors = selected.new_zeros(batch, size + 1, dtype=torch.long)
    anchors.scatter_(1, slot, torch.arange(candidates, device=selected.device).expand(batch, -1))
    keep = torch.arange(size, device=selected.device) < counts.unsqueeze(1)
    return anchors[:, :size].where(keep, 0), keep


def block_supervision(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    loss_mask: torch.Tensor,
    block: int,
    doc_remaining: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Label columns and supervised slots of the draft blocks seeded at ``anchors``.

    Args:
        anchors: Anchor columns [batch, anchors]; dummies (``keep`` false) are ignored.
        keep: Boolean [batch, anchors].
        loss_mask: Supervision mask [batch, row].
        block: Draft block size.
        doc_remaining: Packed rows: real tokens after each column in its document [batch, row];
            blocks then stop at their anchor's document end.

    Returns:
        New tensors [batch, anchors, block]: ``label_columns`` (anchor + 1 ... anchor + block),
        ``safe_columns`` (clamped into the row, 0 for dummies; safe to gather) and the bool
        ``eval_mask`` (upstream's ``build_eval_mask``: a supervised prefix of each block).
    """
    row = loss_mask.shape[1]
    label_columns = anchors.unsqueeze(-1) + torch.arange(1, block + 1, device=anchors.device)
    safe_columns = label_columns.clamp(max=row - 1).masked_fill_(~keep.unsqueeze(-1), 0)
    eval_mask = build_eval_mask(
        seq_len=row,
        loss_mask=loss_mask,
        label_indices=label_columns,
        safe_label_indices=safe_columns,
        block_keep_mask=keep,
        doc_remaining=doc_remaining,
        anchor_positions=anchors,
    )
    return label_columns, safe_columns, eval_mask


__all__ = ["block_supervision", "cap_by_order", "compact_anchors", "select_packed_anchors"]
