"""Packed anchor sampling: per-document budget, uniform within a document, only where anchors supervise."""

from __future__ import annotations

import pytest
import torch
from nemo_automodel.components.speculative.dspark.common import build_anchor_candidate_mask

from nemo_automodel_ext.models.deepseek_v41.anchors import block_supervision, compact_anchors, select_packed_anchors

SEQ_LENS = torch.tensor([[6, 10, 0, 8]])


def _packing(seq_lens):
    lengths = [n for n in seq_lens[0].tolist() if n > 0]
    remaining = torch.cat([torch.arange(n - 1, -1, -1) for n in lengths]).unsqueeze(0)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    return remaining, documents


def test_budget_per_document_and_only_valid_candidates():
    remaining, documents = _packing(SEQ_LENS)
    loss_mask = torch.ones(1, 24)
    loss_mask[0, 6:9] = 0
    valid = build_anchor_candidate_mask(seq_len=24, loss_mask=loss_mask, doc_remaining=remaining)
    for seed in range(30):
        torch.manual_seed(seed)
        chosen = select_packed_anchors(loss_mask, remaining, SEQ_LENS, per_document=3)
        assert not (chosen & ~valid).any()
        per_document = torch.zeros(3, dtype=torch.long).scatter_add_(0, documents[0, :23], chosen[0].long())
        candidates = torch.zeros(3, dtype=torch.long).scatter_add_(0, documents[0, :23], valid[0].long())
        assert per_document.tolist() == candidates.clamp(max=3).tolist()


def test_uniform_within_a_document():
    """Every candidate of a 10-token document is chosen with probability 3/9, within 5 standard errors."""
    remaining, _ = _packing(SEQ_LENS)
    loss_mask = torch.ones(1, 24)
    torch.manual_seed(0)
    trials = 3000
    counts = torch.zeros(23)
    for _ in range(trials):
        counts += select_packed_anchors(loss_mask, remaining, SEQ_LENS, per_document=3)[0].float()
    frequency = counts[6:15] / trials  # the 9 candidates of document 2 (columns 6..14)
    p = 3 / 9
    assert (frequency - p).abs().max() < 5 * (p * (1 - p) / trials) ** 0.5, frequency


def test_same_rng_same_anchors_and_cap_keeps_a_subset():
    remaining, _ = _packing(SEQ_LENS)
    loss_mask = torch.ones(1, 24)
    torch.manual_seed(7)
    first = select_packed_anchors(loss_mask, remaining, SEQ_LENS, per_document=4)
    torch.manual_seed(7)
    assert torch.equal(first, select_packed_anchors(loss_mask, remaining, SEQ_LENS, per_document=4))
    torch.manual_seed(7)
    capped = select_packed_anchors(loss_mask, remaining, SEQ_LENS, per_document=4, max_per_row=5)
    assert int(capped.sum()) == 5 and not (capped & ~first).any()


def test_compact_anchors_matches_upstream_format():
    selected = torch.tensor([[False, True, False, True, True], [False, False, False, False, True]])
    anchors, keep = compact_anchors(selected)
    assert anchors.tolist() == [[1, 3, 4], [4, 0, 0]]
    assert keep.tolist() == [[True, True, True], [True, False, False]]
    anchors, keep = compact_anchors(torch.zeros(2, 5, dtype=torch.bool))
    assert anchors.shape == (2, 1) and not keep.any()


def test_block_supervision_stops_at_the_document_end():
    remaining, _ = _packing(SEQ_LENS)
    anchors = torch.tensor([[3, 13, 0]])
    keep = torch.tensor([[True, True, False]])
    labels, safe, mask = block_supervision(anchors, keep, torch.ones(1, 24), 4, remaining)
    assert labels[0, 0].tolist() == [4, 5, 6, 7] and safe[0, 2].tolist() == [0, 0, 0, 0]
    assert mask.tolist() == [[[True, True, False, False], [True, True, False, False], [False] * 4]]


def _row(lengths):
    """A packed row of fully supervised documents: (loss_mask, doc_remaining, seq_lens)."""
    remaining = torch.cat([torch.arange(length - 1, -1, -1) for length in lengths]).unsqueeze(0)
    return torch.ones_like(remaining), remaining, torch.tensor([lengths])


@pytest.mark.parametrize(
    "lengths,per_document,cap,expected",
    [([100, 2], 1, 1, [0.5, 0.5]), ([60, 8, 8, 8], 4, 8, [2.0, 2.0, 2.0, 2.0])],
)
def test_row_cap_keeps_a_uniform_subset_of_the_chosen_anchors(lengths, per_document, cap, expected):
    """Every chosen anchor survives the cap equally often: no document starves (issue 17 item 5)."""
    loss_mask, remaining, seq_lens = _row(lengths)
    starts = torch.tensor([0, *lengths]).cumsum(0)
    torch.manual_seed(0)
    trials = 4000
    totals = torch.zeros(len(lengths))
    for _ in range(trials):
        chosen = select_packed_anchors(loss_mask, remaining, seq_lens, per_document, cap)[0]
        assert int(chosen.sum()) == cap
        totals += torch.stack([chosen[starts[i] : starts[i + 1]].sum() for i in range(len(lengths))]).float()
    means = totals / trials
    # Binomial-like spread: 5 standard errors of a per-document count in [0, per_document].
    assert torch.allclose(means, torch.tensor(expected), atol=5 * per_document / trials**0.5), means
