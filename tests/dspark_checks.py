"""Checks shared by in-process tests and gloo worker scripts (``tests/`` is on their import path)."""

from __future__ import annotations

import torch


def packing_tensors(seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """position_ids, doc_remaining and a loss mask (first two tokens of each document unsupervised)."""
    rows = [[n for n in row if n > 0] for row in seq_lens.tolist()]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    remaining = torch.stack([torch.cat([torch.arange(n - 1, -1, -1) for n in row]) for row in rows])
    return positions, remaining, (positions >= 2).long()


def present_documents(seq_lens: torch.Tensor):
    """Yield (row, start, length) of every present document of ``seq_lens`` [batch, documents]."""
    for row, lengths in enumerate(seq_lens.tolist()):
        start = 0
        for length in lengths:
            if length > 0:
                yield row, start, length
                start += length


def assert_documents_match_alone(
    wrapper, batch, input_ids: torch.Tensor, seq_lens: torch.Tensor, alone_wrapper=None
) -> int:
    """Every document's packed captures equal the captures of that document run alone (fp32, 1e-5).

    Args:
        wrapper: ``DeepseekV41DSparkTargetModel``.
        batch: ``DSparkTargetBatch`` of the packed run.
        input_ids: Packed token IDs [batch, sequence].
        seq_lens: Document lengths [batch, documents].
        alone_wrapper: Wrapper that runs each document alone (default ``wrapper``); under a
            rank-synchronised (HybridEP) target, one that does not sync, since ranks hold different
            numbers of documents.

    Returns:
        Number of documents checked.
    """
    checked = 0
    for row, start, length in present_documents(seq_lens):
        tokens = input_ids[row : row + 1, start : start + length]
        # Alone: its own packed forward, one document (the packed path's indexer selection; unpacked
        # batches keep upstream's forward, whose top-k ties depend on the row width).
        ones = torch.ones_like(tokens)
        alone = (alone_wrapper or wrapper).generate_batch(tokens, ones, ones, seq_lens=torch.tensor([[length]]))
        for name in ("target_hidden_states", "target_last_hidden_states"):
            torch.testing.assert_close(
                getattr(batch, name)[row, start : start + length], getattr(alone, name)[0], atol=1e-5, rtol=0
            )
        checked += 1
    return checked
