"""CP-native draft training (``cp_draft.py``, ``cp_trainer.py``): each CP rank trains its shard's anchors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_automodel_ext.models.deepseek_v41.anchors import compact_anchors, select_packed_anchors
from nemo_automodel_ext.models.deepseek_v41.cp_draft import DraftShard, draft_shard
from nemo_automodel_ext.models.deepseek_v41.packing import document_bounds, packed_layout

WORKER = Path(__file__).with_name("gloo_cp_draft.py")


def _batch(lengths: list[list[int]], alignment: int, cp: int):
    seq_lens = torch.tensor(lengths)
    sequence = int(seq_lens.clamp_min(0).sum(1)[0])
    natural = sum(-(-n // alignment) * alignment for n in lengths[0] if n > 0)
    width = -(-natural // (cp * alignment)) * cp * alignment
    layout = packed_layout(seq_lens, None, (seq_lens.shape[0], sequence), alignment, minimum_length=width)
    assert layout.source_indices.shape[1] == width
    positions = layout.restore(layout.position_ids.unsqueeze(-1)).squeeze(-1)
    remaining = torch.stack(
        [torch.cat([torch.arange(n - 1, -1, -1) for n in row if n > 0]) for row in seq_lens.tolist()]
    )
    return seq_lens, layout, positions, remaining


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=5),
    alignment=st.sampled_from([1, 4, 8]),
    cp=st.integers(1, 4),
    per_document=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_shards_partition_the_cp1_anchor_draw(lengths, alignment, cp, per_document, seed):
    """Every CP=1 anchor is trained by exactly one rank, at its aligned column, with its document start."""
    seq_lens, layout, _, remaining = _batch([lengths], alignment, cp)
    loss_mask = torch.ones_like(remaining)
    torch.manual_seed(seed)
    selected = select_packed_anchors(loss_mask, remaining, seq_lens, per_document)
    expected, keep = compact_anchors(selected)
    expected = expected[keep]
    owned, starts, expected_starts = [], [], []
    truth = layout.input_positions[0, document_bounds(seq_lens, expected.unsqueeze(0)).start[0]]
    for rank in range(cp):
        shard = DraftShard(layout, rank, cp, before=7, after=4)
        anchors, kept, document_starts = shard.own_anchors(selected, seq_lens)
        aligned = anchors[kept] + shard.start
        assert ((aligned >= shard.shard_start) & (aligned < shard.shard_stop)).all()
        owned.append(aligned)
        starts.append(document_starts[kept] + shard.start)
        # A document start before the local slice is clipped to it (windows never reach further).
        mine = (layout.input_positions[0, expected] >= shard.shard_start) & (
            layout.input_positions[0, expected] < shard.shard_stop
        )
        expected_starts.append(truth[mine].clamp_min(shard.start))
    assert torch.equal(torch.cat(owned), layout.input_positions[0, expected])
    assert torch.equal(torch.cat(starts), torch.cat(expected_starts))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    cp=st.integers(2, 4),
    cap=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_each_rank_trains_at_most_its_share_of_the_row_cap(lengths, cp, cap, seed):
    """With ``max_anchors_per_row``, a rank keeps at most ceil(cap / cp) anchors, a subset of the CP=1 draw;
    where no share binds, the ranks train exactly the CP=1 anchors."""
    seq_lens, layout, _, remaining = _batch([lengths], 4, cp)
    torch.manual_seed(seed)
    selected, cap_order = select_packed_anchors(
        torch.ones_like(remaining), remaining, seq_lens, 9, max_per_row=cap, with_cap_order=True
    )
    whole = set(layout.input_positions[0, selected[0].nonzero().squeeze(1)].tolist())
    owned, bound = [], False
    for rank in range(cp):
        shard = DraftShard(layout, rank, cp, before=7, after=4)
        anchors, kept, _ = shard.own_anchors(selected, seq_lens, cap_order, max_per_row=cap)
        assert int(kept.sum()) <= -(-cap // cp)
        mine = (layout.input_positions[0, :-1][selected[0]] >= shard.shard_start) & (
            layout.input_positions[0, :-1][selected[0]] < shard.shard_stop
        )
        bound |= int(mine.sum()) > -(-cap // cp)
        owned += (anchors[kept] + shard.start).tolist()
    assert set(owned) <= whole and len(owned) == len(set(owned))
    if not bound:
        assert set(owned) == whole


def test_the_share_of_the_cap_is_a_uniform_subset():
    """All 7 anchor candidates of a row in rank 0's shard, cap 4 over 2 ranks: rank 0 keeps 2, each equally often."""
    seq_lens, layout, _, remaining = _batch([[40, 4]], 4, 2)  # the 40-token document fills rank 0's shard
    loss_mask = torch.zeros_like(remaining)
    loss_mask[0, :8] = 1
    counts = torch.zeros(remaining.shape[1])
    shard = DraftShard(layout, 0, 2, before=7, after=4)
    torch.manual_seed(0)
    for _ in range(2000):
        selected, cap_order = select_packed_anchors(
            loss_mask, remaining, seq_lens, 8, max_per_row=4, with_cap_order=True
        )
        anchors, kept, _ = shard.own_anchors(selected, seq_lens, cap_order, max_per_row=4)
        assert int(kept.sum()) == 2
        counts[anchors[kept] + shard.start] += 1
    chosen = counts[counts > 0]
    assert len(chosen) == 7 and (chosen / 2000 - 2 / 7).abs().max() < 0.05


def test_local_slices_caller_tensors_to_the_shard_and_its_halos():
    seq_lens, layout, positions, _ = _batch([[5, 17, 18]], 4, 2)  # aligned 8 + 20 + 20 = 48
    shard = DraftShard(layout, 1, 2, before=8, after=4)
    assert (shard.shard_start, shard.shard_stop, shard.start, shard.stop) == (24, 48, 16, 48)
    local = shard.local(positions, fill=-1)
    assert local.shape == (1, 32)
    assert torch.equal(local, layout.position_ids[:, 16:48].where(layout.sequence_ids[:, 16:48] > 0, -1))
    alone = DraftShard(layout, 0, 1, before=8, after=4)  # one rank: nothing to receive
    assert torch.equal(alone.exchange(torch.ones(1, 48, 3), "after"), torch.ones(1, 48, 3))


def test_refusals_name_the_rule(monkeypatch):
    _, layout, _, _ = _batch([[5, 17, 18]], 4, 2)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda group=None: 5)
    monkeypatch.setattr("torch.distributed.get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="not divisible by the CP size 5"):
        draft_shard(layout, object(), 8, 4)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="non-negative"):
        draft_shard(layout, None, -1, 4)
    shard = draft_shard(layout, None, 8, 4)
    with pytest.raises(ValueError, match="shard_width=48"):
        shard.exchange(torch.zeros(1, 40, 2), "before")
    with pytest.raises(ValueError, match="'before' or 'after'"):
        shard.exchange(torch.zeros(1, 48, 2), "left")


@pytest.mark.parametrize("ranks", [2, 3])
def test_cp_native_draft_equals_cp1_loss_metrics_and_gradients(ranks):
    """Loss, metrics and summed gradients of CP-native steps equal CP=1 (windows 8 and 40, shards of 24/16)."""
    from conftest import run_gloo

    run_gloo(WORKER, world_size=ranks)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_cp_native_draft_stays_one_model_over_dp_x_cp(strategy):
    """Gradients reduce over dp x cp: CP peers hold identical parameters, equal to CP=1 training."""
    from conftest import run_gloo

    run_gloo(WORKER, "train", strategy, world_size=2)
