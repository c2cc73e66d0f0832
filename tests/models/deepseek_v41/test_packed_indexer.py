"""The plugin's packed indexer (banded scores, segmented selection) against upstream's ``_Indexer.forward``.

Upstream's indexer quantises queries and keys to mxfp4, so equal scores are common and which tied key
``torch.topk`` keeps depends on the tensor width. These tests compare selections on tie-free scores:
``quantize_cache`` is replaced by the identity inside the test (both implementations call upstream's
module function, so both see the same scores), and weights, inputs and rotary angles are drawn so
that query-key products are positive (no ReLU zeros, which would tie).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_automodel_ext.models.deepseek_v41 import packed_indexer
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import (
    BandedCandidates,
    PackedIndexer,
    indexer_bands,
    install_packed_indexer,
)
from nemo_automodel_ext.models.deepseek_v41.tiny import tiny_target_config


@pytest.fixture
def tie_free(monkeypatch):
    monkeypatch.setattr(upstream_attention, "quantize_cache", lambda values, **_: values)


def layers(topk=3, blocks=2, block_size=2, ratio=1):
    """Upstream indexers of a candidate source (owns its keys) and a later candidate user, and their copies."""
    text = tiny_target_config(
        compress_ratios=[0, 0, ratio, ratio, ratio, 0],
        kv_source_layer_ids=[2],
        index_source_layer_ids=[2, 4],
        candidate_source_layer_id=2,
        index_topk=topk,
        candidate_topk_blocks=blocks,
        candidate_block_size=block_size,
        dspark_target_layer_ids=[1, 3],
    ).text_config
    generator = torch.Generator().manual_seed(topk * 100 + blocks * 10 + block_size)
    built = []
    for layer_idx in (2, 4):
        layer = upstream_attention._Indexer(text, layer_idx=layer_idx, dtype=torch.float32)
        for parameter in layer.parameters():
            parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.1)
        ours = copy.deepcopy(layer)
        install_packed_indexer(ours)
        built.append((layer, ours))
    return text, built


def packed_row(text, lengths, gaps, ratio, seed, more_rows=()):
    """Inputs of packed rows as upstream's attention gives them to its indexer.

    ``lengths`` and ``gaps`` make the first row; ``more_rows`` holds (lengths, gaps) of further rows.
    Rows are padded (id 0) to the longest.
    """
    rows = []
    for row_lengths, row_gaps in ((lengths, gaps), *more_rows):
        ids = []
        for document, (length, gap) in enumerate(zip(row_lengths, row_gaps), start=1):
            ids += [document] * length + [0] * ((-length) % ratio + gap * ratio)
        rows.append(ids)
    longest = max(len(row) for row in rows)
    ids = torch.tensor([row + [0] * (longest - len(row)) for row in rows])
    batch, sequence = ids.shape
    width = sequence // ratio
    generator = torch.Generator().manual_seed(seed)
    groups = ids[:, : width * ratio].view(batch, width, ratio)
    state = upstream_attention.DeepseekV41AttentionState(
        compressed_valid=(groups > 0).all(-1),
        compressed_seq_ids=ids[:, : width * ratio : ratio],
        compression_ratio=ratio,
    )
    pairs = text.qk_rope_head_dim // 2
    inputs = dict(
        hidden_states=torch.rand(batch, sequence, text.hidden_size, generator=generator),
        query_latent=torch.rand(batch, sequence, text.q_lora_rank, generator=generator),
        latent=torch.rand(batch, width, text.head_dim, generator=generator),
        angles=0.2 * torch.rand(batch, sequence, pairs, generator=generator),
        compressed_angles=0.2 * torch.rand(batch, width, pairs, generator=generator),
        position_ids=torch.arange(sequence).expand(batch, -1),
        packed_seq_ids=ids,
    )
    return inputs, state


def assert_same(expected, got):
    """Same selected keys per query (ascending, then -1), the same candidates."""
    assert got.topk_indices.shape == expected.topk_indices.shape
    for want, have in zip(expected.topk_indices.flatten(0, 1).tolist(), got.topk_indices.flatten(0, 1).tolist()):
        assert [i for i in have if i >= 0] == sorted(i for i in want if i >= 0)
        assert have.count(-1) == want.count(-1)
    assert torch.equal(got.index_keys, expected.index_keys)
    if isinstance(got.candidates, BandedCandidates):
        assert torch.equal(got.candidates.dense(), expected.candidates)


def run_both(built, inputs, state):
    """Source then user layer, upstream's and the plugin's, each on its own state."""
    (source, our_source), (user, our_user) = built
    expected = source(**inputs, state=state)
    got = our_source(**inputs, state=state)
    assert_same(expected, got)
    user_inputs = dict(inputs, latent=None)
    assert_same(user(**user_inputs, state=expected), our_user(**user_inputs, state=got))
    return got


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    ratio=st.sampled_from([1, 2, 4]),
    topk=st.integers(1, 6),
    blocks=st.integers(1, 3),
    block_size=st.integers(1, 3),
    tile=st.sampled_from([4, 8, 16, 10**6]),
    band_elements=st.sampled_from([1, 200, 2**26]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_banded_indexer_equals_upstream(lengths, ratio, topk, blocks, block_size, tile, band_elements, seed, data):
    gaps = data.draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
    second = data.draw(st.lists(st.integers(1, 40), min_size=0, max_size=4))  # a second row when drawn
    more_rows = ((second, [0] * len(second)),) if second else ()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(upstream_attention, "quantize_cache", lambda values, **_: values)
        patch.setattr(packed_indexer, "MIN_TILE", tile)
        patch.setattr(packed_indexer, "BAND_ELEMENTS", band_elements)  # one tile a call, or stacked
        text, built = layers(topk, blocks, block_size, ratio)
        inputs, state = packed_row(text, lengths, gaps, ratio, seed, more_rows)
        if inputs["packed_seq_ids"].shape[1] // ratio == 0:
            return
        run_both(built, inputs, state)


def test_local_queries_of_a_cp_shard_select_like_the_whole_row(tie_free, monkeypatch):
    """A CP shard: local queries with global positions against the global keys."""
    monkeypatch.setattr(packed_indexer, "MIN_TILE", 8)
    text, built = layers(ratio=2)
    inputs, state = packed_row(text, [30, 9, 3, 41, 17], [0, 1, 2, 0, 1], 2, 5)
    (source, _), (user, our_user) = built
    whole = run_both(built, inputs, state)
    sequence = inputs["packed_seq_ids"].shape[1]
    for begin, end in ((0, sequence // 2), (sequence // 2, sequence)):
        local = {
            name: value[:, begin:end] if name not in ("latent", "compressed_angles") else value
            for name, value in inputs.items()
        }
        local["latent"] = None
        shard_state = replace(state, index_keys=whole.index_keys, candidates=None)
        expected = user(**local, state=replace(shard_state, candidates=whole.candidates.dense()[:, begin:end]))
        ours_source = copy.deepcopy(built[0][1])
        ours_source.owns_keys = False  # keys come from the state, as on a rank that gathered them
        shard = ours_source(**local, state=shard_state)
        assert torch.equal(shard.topk_indices, whole.topk_indices[:, begin:end])
        assert torch.equal(shard.candidates.dense(), whole.candidates.dense()[:, begin:end])
        assert_same(expected, our_user(**local, state=shard))


def test_padding_short_documents_and_a_reused_id_fall_back_or_select_nothing(tie_free, monkeypatch):
    monkeypatch.setattr(packed_indexer, "MIN_TILE", 4)
    text, built = layers(ratio=4)
    inputs, state = packed_row(text, [3, 2, 9, 6], [1, 0, 1, 0], 4, 3)
    got = run_both(built, inputs, state)
    ids = inputs["packed_seq_ids"][0]
    keyless = (ids == 0) | (ids == 1) | (ids == 2)  # padding, and documents shorter than one group
    assert (got.topk_indices[0, keyless] == -1).all()
    # One id on two runs of keys: one band over the row, still upstream's selection.
    reused = inputs["packed_seq_ids"].clone()
    reused[reused == 3] = 1
    reused_state = replace(state, compressed_seq_ids=reused[:, ::4])
    bands = indexer_bands(inputs["position_ids"], reused, reused_state.compressed_seq_ids, compression_ratio=4)
    assert bands.tiles == ((0, reused.shape[1], 0, reused.shape[1] // 4),)
    run_both(built, dict(inputs, packed_seq_ids=reused), reused_state)


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_packed_row_never_allocates_queries_by_global_keys(tie_free):
    """32 documents of 64 tokens: no tensor near [local_sequence, global_compressed]; upstream has several."""
    text, built = layers(ratio=1)
    inputs, state = packed_row(text, [64] * 32, [0] * 32, 1, 0)
    sequence = inputs["packed_seq_ids"].shape[1]
    (source, ours), _ = built
    sizes = {}
    for name, layer in (("upstream", source), ("plugin", ours)):
        with _LargestTensor() as mode:
            layer(**inputs, state=state)
        sizes[name] = mode.largest
    assert sizes["upstream"] >= sequence * sequence
    # Tiles of 256 queries (MAX_TILES 32 not binding) read bands of at most 256 + 63 keys; the 8 tiles
    # are stacked in one call (per-head products included).
    assert sizes["plugin"] <= sequence * (256 + 64) * text.index_n_heads < sizes["upstream"] / 6
    assert indexer_bands(
        inputs["position_ids"], inputs["packed_seq_ids"], state.compressed_seq_ids, compression_ratio=1
    ).scored <= sequence * (256 + 64)


def test_one_long_document_scores_no_more_than_the_whole_row(monkeypatch):
    ids = torch.ones(1, 4096, dtype=torch.long)
    positions = torch.arange(4096).unsqueeze(0)
    # A budget for the whole row: one call, every tile against the widest band (the whole row, no more).
    monkeypatch.setattr(packed_indexer, "BAND_ELEMENTS", 1 << 26)
    bands = indexer_bands(positions, ids, ids[:, ::2], compression_ratio=2)
    assert len(bands.tiles) == 16 and bands.groups == ((0, 16, 2048),) and bands.scored == 4096 * 2048
    monkeypatch.undo()
    bands = indexer_bands(positions, ids, ids[:, ::2], compression_ratio=2)  # the default budget
    assert bands.scored <= 4096 * 2048
    budget = packed_indexer.band_elements("cpu")
    assert budget == 1 << 22 and packed_indexer.band_elements("cuda") == 1 << 26
    assert all((last - first) * bands.tile * keys <= budget for first, last, keys in bands.groups)
    # Where the whole row does not fit one call, tiles go one by one: the causal triangle only.
    monkeypatch.setattr(packed_indexer, "BAND_ELEMENTS", 256 * 2048)
    bands = indexer_bands(positions, ids, ids[:, ::2], compression_ratio=2)
    assert len(bands.groups) > 8 and bands.scored <= 4096 * 2048 * 0.6
    assert all((last - first) * bands.tile * keys <= 256 * 2048 for first, last, keys in bands.groups)


def test_inputs_not_modified_and_unpacked_rows_run_upstream(tie_free):
    text, built = layers()
    inputs, state = packed_row(text, [20, 11], [0, 0], 1, 2)
    before = {name: value.clone() for name, value in inputs.items()}
    (source, ours), _ = built
    ours(**inputs, state=state)
    assert all(torch.equal(before[name], inputs[name]) for name in inputs)
    unpacked = dict(inputs, packed_seq_ids=None)
    plain = replace(state, compressed_seq_ids=None)
    assert torch.equal(source(**unpacked, state=plain).topk_indices, ours(**unpacked, state=plain).topk_indices)
    assert isinstance(ours, PackedIndexer)
