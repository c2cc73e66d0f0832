"""Indexer top-k selection of packed V4.1 rows: vectorised over documents, ties broken by position.

nemo_automodel 0.7.0's ``_Indexer._select_packed`` loops over every document of every row
(``sequence_ids[row].unique().tolist()``, two ``torch.where`` and a top-k per document: host reads
and small kernels that grow with the documents per row), and breaks score ties with
``torch.topk``, whose choice among equal scores depends on the physical width of the tensor it
runs on. The indexer's keys and queries are mxfp4-quantised, so exact ties are common in small
models: appending one token to a row then changes the keys an *earlier* query selects, so the
target's full forward is not prefix-consistent (``docs/evaluation.md``) and a one-forward greedy
replay differs from decoding that commits tokens round by round.

``segmented_select`` gives upstream's result without the loop: every query's top-k among its own
document's visible keys (scores outside the document are already ``-inf``, so a whole-row
selection *is* the per-document one), candidate blocks counted from each document's first
compressed key, ``-1`` fill. Ties are broken by the lower compressed index, so a query's selection
depends only on the scores it can see, never on the row width: the forward is prefix-consistent.
On tie-free scores (what real scores give) the selected index sets equal upstream's. Query rows are
ranked in chunks (``CHUNK_ELEMENTS``), so the int64 ranking keys stay bounded whatever the row width.

``packed_indexer.PackedIndexer`` runs it on each band of keys its queries can see; it is installed
when the plugin builds or wraps a target (``install_packed_indexer``), never at import time.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention

_INT32_MAGNITUDE = 0x7FFFFFFF
#: Score elements ranked at once (queries are processed in chunks of rows): int64 keys of about 256 MiB.
CHUNK_ELEMENTS = 1 << 25


def tie_broken_keys(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 sort keys of ``scores`` [..., width]: higher score first, then lower index.

    Args:
        scores: Float scores [..., width] (BF16 or FP32; ``-inf``/``+inf`` allowed).

    Returns:
        New int64 tensor [..., width]; ``key_a > key_b`` iff ``a``'s score is larger, or equal
        with a lower index. ``-0.0`` and ``0.0`` compare equal, as in ``torch.topk``.
    """
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits < 0, bits ^ _INT32_MAGNITUDE, bits).to(torch.int64)
    width = scores.shape[-1]
    rank = width - 1 - torch.arange(width, device=scores.device)
    return ordered * (1 << 32) + rank


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` largest ``scores`` [..., width], ties to the lower index (unsorted)."""
    return tie_broken_keys(scores).topk(k, dim=-1, sorted=False).indices


def document_key_blocks(
    compressed_seq_ids: torch.Tensor, compressed_valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, int]:
    """Candidate-block id of every compressed key, blocks counted from each document's first key.

    A document's keys are its complete groups (``compressed_valid``) with its id; upstream's
    ``_select_packed`` numbers them 0, 1, ... and cuts blocks of ``block_size`` from key 0.

    Args:
        compressed_seq_ids: Document ids of the compressed keys [batch, width], 0 for padding;
            a document's complete groups are contiguous (it starts on a group boundary).
        compressed_valid: Complete compression groups [batch, width] (bool).
        block_size: Compressed keys per candidate block.

    Returns:
        ``(blocks, count)``: new int64 [batch, width] block ids, unique per (row, document,
        block) and below ``count - 1``; keys of no document get ``count - 1``; ``count`` is
        ``width + 1`` (a block holds at least one key).
    """
    batch, width = compressed_seq_ids.shape
    member = (compressed_seq_ids > 0) & compressed_valid
    documents = compressed_seq_ids.where(member, 0).long()
    # Documents numbered 1.. by their runs of keys, so the document axis is [batch, width + 1].
    columns = torch.arange(width, device=documents.device).expand(batch, -1)
    change = member & (documents != F.pad(documents[:, :-1], (1, 0), value=-1))
    ordinal = change.long().cumsum(dim=1).where(member, 0)  # 1.. per run of one id, 0 elsewhere
    seen = member.long().cumsum(dim=1)  # members up to and including each column
    first = torch.full((batch, width + 1), width, dtype=torch.long, device=documents.device)
    first = first.scatter_reduce(1, ordinal, columns, reduce="amin", include_self=True)
    position = seen - seen.gather(1, first.clamp_max(width - 1).gather(1, ordinal))
    keys = torch.zeros(batch, width + 1, dtype=torch.long, device=documents.device)
    keys = keys.scatter_add(1, ordinal, member.long())
    keys[:, 0] = 0
    per_document = (keys + block_size - 1) // block_size
    offset = per_document.cumsum(dim=1) - per_document
    blocks = offset.gather(1, ordinal) + position // block_size
    count = width + 1
    return blocks.where(member, count - 1), count


def segmented_select(
    scores: torch.Tensor,
    sequence_ids: torch.Tensor,
    state: upstream_attention.DeepseekV41AttentionState,
    *,
    topk: int,
    is_candidate_source: bool,
    uses_candidates: bool,
    candidate_topk_blocks: int,
    candidate_block_size: int,
) -> upstream_attention.DeepseekV41AttentionState:
    """Packed indexer selection (see the module): upstream's ``_select_packed`` result, vectorised.

    Args:
        scores: Causal, document-masked scores [batch, local_sequence, global_compressed]
            (``-inf`` where a query may not read a key). Not modified.
        sequence_ids: Document ids of the local queries [batch, local_sequence], 0 for padding.
        state: Attention state with ``compressed_seq_ids`` and ``compressed_valid`` [batch,
            global_compressed], and ``candidates`` [batch, local_sequence, global_compressed] when
            ``uses_candidates``.
        topk: The indexer's ``index_topk``.
        is_candidate_source: This layer chooses candidate blocks for later layers.
        uses_candidates: This layer selects among an earlier layer's candidates.
        candidate_topk_blocks: Blocks kept per query (candidate source).
        candidate_block_size: Compressed keys per block (candidate source).

    Returns:
        New state with ``topk_indices`` [batch, local_sequence, min(topk, global_compressed)]:
        each query's selected global key indices ascending, then ``-1`` fill; and, for a
        candidate source, new ``candidates`` [batch, local_sequence, global_compressed].

    Raises:
        ValueError: when ``uses_candidates`` and the state holds no candidates of ``scores``' shape.
    """
    batch, queries, width = scores.shape
    if uses_candidates and (state.candidates is None or state.candidates.shape != scores.shape):
        raise ValueError("A hierarchical Reindex layer requires candidates from its source layer")
    blocks = None
    if is_candidate_source:
        blocks = document_key_blocks(state.compressed_seq_ids, state.compressed_valid, candidate_block_size)
    k = min(topk, width)
    # Query rows in chunks: the int64 ranking keys stay near CHUNK_ELEMENTS whatever the row width.
    rows = max(1, CHUNK_ELEMENTS // max(batch * width, 1))
    parts = [
        _select_rows(
            scores[:, begin : begin + rows],
            state.candidates[:, begin : begin + rows] if uses_candidates else None,
            blocks,
            k,
            candidate_topk_blocks,
        )
        for begin in range(0, queries, rows)
    ]
    indices = torch.cat([part[0] for part in parts], dim=1) if parts else scores.new_zeros(batch, 0, k).long()
    candidates = state.candidates
    if is_candidate_source:
        candidates = (
            torch.cat([part[1] for part in parts], dim=1) if parts else torch.zeros_like(scores, dtype=torch.bool)
        )
    return replace(state, topk_indices=indices, candidates=candidates)


def _select_rows(
    scores: torch.Tensor,
    candidates: torch.Tensor | None,
    blocks: tuple[torch.Tensor, int] | None,
    k: int,
    candidate_topk_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``segmented_select`` for a chunk of query rows.

    Args:
        scores: Scores [batch, rows, width]. Not modified.
        candidates: An earlier layer's candidates [batch, rows, width] (a user layer), else None.
        blocks: ``document_key_blocks``' (ids [batch, width], count) for a candidate source, else None.
        k: Keys selected per query.
        candidate_topk_blocks: Blocks kept per query (candidate source).

    Returns:
        New ``(indices [batch, rows, k], candidates [batch, rows, width] or None)``.
    """
    width = scores.shape[-1]
    finite = torch.isfinite(scores)
    chosen_candidates = None
    if blocks is not None:
        ids, count = blocks
        index = ids.unsqueeze(1).expand_as(scores)
        block_scores = scores.new_full((*scores.shape[:2], count), -torch.inf)
        block_scores = block_scores.scatter_reduce(-1, index, scores, reduce="amax", include_self=True)
        # The query's latest visible key's block is always kept (upstream's last_block).
        latest = finite.long().cumsum(dim=-1).argmax(dim=-1, keepdim=True)  # first column reaching the count
        latest_block = index.gather(-1, latest)
        forced = finite.any(dim=-1, keepdim=True)
        block_scores = block_scores.scatter(-1, latest_block, torch.inf).where(forced, block_scores)
        block_scores[..., count - 1] = -torch.inf
        chosen = stable_topk_indices(block_scores, min(candidate_topk_blocks, count))
        keep = torch.zeros_like(block_scores, dtype=torch.bool)
        keep = keep.scatter(-1, chosen, block_scores.gather(-1, chosen) > -torch.inf)
        chosen_candidates = keep.gather(-1, index) & finite
    elif candidates is not None:
        scores = scores.masked_fill(~candidates, -torch.inf)
        finite = finite & candidates
    chosen = stable_topk_indices(scores, k)
    chosen = torch.where(finite.gather(-1, chosen), chosen, width).sort(dim=-1).values
    return chosen.masked_fill(chosen == width, -1), chosen_candidates


__all__ = [
    "document_key_blocks",
    "segmented_select",
    "stable_topk_indices",
    "tie_broken_keys",
]
