"""Segmented indexer selection against upstream's per-document ``_Indexer._select_packed`` loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention

from nemo_automodel_ext.models.deepseek_v41.packed_indexer import PackedIndexer, install_packed_indexer
from nemo_automodel_ext.models.deepseek_v41.selection import stable_topk_indices


def packed_scores(lengths, ratio, gaps, seed, local=None):
    """Random tie-free indexer scores of one packed row, masked as upstream's indexer masks them.

    Documents of ``lengths`` tokens start on multiples of ``ratio``; ``gaps`` padding tokens (id 0)
    follow each. ``local`` = (start, stop) keeps those query columns only (a CP shard).
    Returns (scores [1, queries, keys], query ids [1, queries], state).
    """
    ids, positions = [], []
    for document, (length, gap) in enumerate(zip(lengths, gaps), start=1):
        ids += [document] * length + [0] * ((-length) % ratio + gap * ratio)
        positions += list(range(length)) + [0] * ((-length) % ratio + gap * ratio)
    ids, positions = torch.tensor([ids]), torch.tensor([positions])
    width = ids.shape[1] // ratio
    groups = ids[:, : width * ratio].view(1, width, ratio)
    key_ids = groups[..., 0]
    valid = (groups == key_ids.unsqueeze(-1)).all(-1) & (key_ids > 0)
    key_position = torch.zeros_like(key_ids)  # index of a key inside its document
    for j in range(1, width):
        key_position[0, j] = key_position[0, j - 1] + 1 if key_ids[0, j] == key_ids[0, j - 1] else 0
    allowed = (
        (ids.unsqueeze(-1) == key_ids.unsqueeze(1))
        & (ids.unsqueeze(-1) > 0)
        & valid.unsqueeze(1)
        & (key_position.unsqueeze(1) < ((positions + 1) // ratio).unsqueeze(-1))
    )
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(allowed.shape, generator=generator).masked_fill(~allowed, -torch.inf)
    if local is not None:
        scores, ids = scores[:, local[0] : local[1]], ids[:, local[0] : local[1]]
    state = upstream_attention.DeepseekV41AttentionState(
        compressed_valid=valid, compressed_seq_ids=key_ids, compression_ratio=ratio
    )
    return scores, ids, state


def settings_of(topk, source, uses, blocks=2, block_size=2):
    return SimpleNamespace(
        topk=topk,
        is_candidate_source=source,
        uses_candidates=uses,
        candidate_topk_blocks=blocks,
        candidate_block_size=block_size,
    )


def upstream_select(scores, ids, state, layer):
    return upstream_attention._Indexer._select_packed(layer, scores, ids, state)


def ours(scores, ids, state, layer):
    """The plugin's indexer method, on the same layer settings as upstream's."""
    return PackedIndexer._select_packed(layer, scores, ids, state)


def assert_same_selection(expected, got):
    """Same selected keys per query in the same ascending order, the same number of -1; same candidates."""
    assert got.topk_indices.shape == expected.topk_indices.shape
    for want, have in zip(expected.topk_indices.flatten(0, 1).tolist(), got.topk_indices.flatten(0, 1).tolist()):
        assert [i for i in have if i >= 0] == sorted(i for i in want if i >= 0)
        assert have.count(-1) == want.count(-1)
    if expected.candidates is not None:
        assert torch.equal(got.candidates, expected.candidates)


documents = st.lists(st.integers(1, 23), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    lengths=documents,
    ratio=st.sampled_from([1, 2, 4]),
    topk=st.integers(1, 6),
    blocks=st.integers(1, 3),
    block_size=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_segmented_select_equals_upstream_loop(lengths, ratio, topk, blocks, block_size, seed, data):
    gaps = data.draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
    scores, ids, state = packed_scores(lengths, ratio, gaps, seed)
    if scores.shape[-1] == 0:
        return
    source = settings_of(topk, True, False, blocks, block_size)
    expected = upstream_select(scores, ids, state, source)
    got = ours(scores, ids, state, source)
    assert_same_selection(expected, got)
    # A later layer selects among the source's candidates.
    user = settings_of(topk, False, True, blocks, block_size)
    later, _, _ = packed_scores(lengths, ratio, gaps, seed + 1)
    assert_same_selection(
        upstream_select(later, ids, expected, user), ours(later, ids, replace_state(got, state), user)
    )
    plain = settings_of(topk, False, False)
    assert_same_selection(upstream_select(scores, ids, state, plain), ours(scores, ids, state, plain))


def replace_state(selection, state):
    from dataclasses import replace

    return replace(state, candidates=selection.candidates)


def test_cp_shard_selects_like_the_whole_row():
    """Local queries of a shard against global keys: the shard's rows of the whole-row selection."""
    lengths, gaps = [9, 3, 14, 1, 6], [0, 1, 0, 2, 0]
    whole, ids, state = packed_scores(lengths, 2, gaps, 7)
    layer = settings_of(3, True, False)
    full = ours(whole, ids, state, layer)
    half = ids.shape[1] // 2
    for start, stop in ((0, half), (half, ids.shape[1])):
        shard = ours(whole[:, start:stop], ids[:, start:stop], state, layer)
        assert torch.equal(shard.topk_indices, full.topk_indices[:, start:stop])
        assert torch.equal(shard.candidates, full.candidates[:, start:stop])
        assert_same_selection(upstream_select(whole[:, start:stop], ids[:, start:stop], state, layer), shard)


def test_documents_without_keys_and_padding_get_no_selection():
    # Documents shorter than one group (ratio 4) have no complete compressed key; padding has id 0.
    scores, ids, state = packed_scores([3, 2, 9], 4, [1, 0, 1], 3)
    got = ours(scores, ids, state, settings_of(4, True, False))
    short = (ids[0] == 1) | (ids[0] == 2) | (ids[0] == 0)
    assert (got.topk_indices[0, short] == -1).all()
    assert not got.candidates[0, short].any()
    assert_same_selection(upstream_select(scores, ids, state, settings_of(4, True, False)), got)


def test_ties_go_to_the_lower_index_whatever_the_width():
    """Equal scores: the lower key index wins, and appending keys never changes an earlier choice."""
    scores = torch.tensor([[0.5, 1.0, 1.0, 0.5, 1.0, -torch.inf, -torch.inf]])
    for width in range(5, 8):
        assert sorted(stable_topk_indices(scores[:, :width], 2)[0].tolist()) == [1, 2]
    negative_zero = torch.tensor([[-0.0, 0.0, -1.0]])
    assert sorted(stable_topk_indices(negative_zero, 1)[0].tolist()) == [0]


def test_inputs_not_modified_and_install_is_idempotent(tiny_target):
    scores, ids, state = packed_scores([7, 5], 1, [0, 0], 1)
    before = scores.clone()
    ours(scores, ids, state, settings_of(2, True, False))
    assert torch.equal(scores, before)
    import copy

    model = copy.deepcopy(tiny_target)
    count = sum(isinstance(m, upstream_attention._Indexer) for m in model.modules())
    assert count > 0
    assert install_packed_indexer(model) == count
    assert install_packed_indexer(model) == count
    assert all(isinstance(m, PackedIndexer) for m in model.modules() if isinstance(m, upstream_attention._Indexer))


@pytest.mark.parametrize("length", [100, 137])
def test_demo_target_is_prefix_consistent_with_segmented_selection(length):
    """Appending a token never changes an earlier column's logits (upstream's loop: up to ~1 logit)."""
    from nemo_automodel_ext.demo.demo_target import load_demo_target
    from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs

    model = load_demo_target()
    generator = torch.Generator().manual_seed(length)
    tokens = torch.randint(10, 300, (1, length + 1), generator=generator)

    def logits(count):
        layout, inputs = prepare_packed_inputs(model, tokens[:, :count], torch.tensor([[count]]))
        with torch.no_grad():
            return layout.restore(model(**inputs).logits)

    short, long = logits(length), logits(length + 1)
    assert (short - long[:, :length]).abs().max() < 1e-3
    assert torch.equal(short.argmax(-1), long[:, :length].argmax(-1))


def test_chunks_of_query_rows_select_as_the_whole(monkeypatch):
    """Chunking bounds the int64 ranking keys; one query row per chunk gives the same result."""
    from nemo_automodel_ext.models.deepseek_v41 import selection

    scores, ids, state = packed_scores([9, 3, 14, 1, 6], 2, [0, 1, 0, 2, 0], 11)
    for layer in (settings_of(3, True, False), settings_of(3, False, False)):
        whole = ours(scores, ids, state, layer)
        monkeypatch.setattr(selection, "CHUNK_ELEMENTS", scores.shape[-1])  # one row per chunk
        rows = ours(scores, ids, state, layer)
        monkeypatch.undo()
        assert torch.equal(rows.topk_indices, whole.topk_indices)
        if layer.is_candidate_source:
            assert torch.equal(rows.candidates, whole.candidates)
