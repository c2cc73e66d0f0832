"""Packed DSpark capture on a tiny V4.1 target: per-document equivalence, freezing, refusals, ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dspark_checks import assert_documents_match_alone
from nemo_automodel.components.models.deepseek_v41 import packing as upstream
from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

from nemo_automodel_ext.models.deepseek_v41.dspark_target import (
    aligned_packed_layout,
    compression_alignment,
    dspark_packed_forward,
    max_over_ranks,
)
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, tiny_target_config

WORKER = Path(__file__).with_name("gloo_dspark_target.py")
FIELDS = ("source_indices", "input_positions", "position_ids", "sequence_ids")

# Lengths that are not multiples of the alignment (4), absent documents (0 and -1000) in the
# middle and at the end, and rows of different aligned widths (trailing padding in row 1).
SEQ_LENS = torch.tensor([[5, 0, 11, 7], [9, -1000, 14, 0]])
SEQUENCE = 23


@pytest.fixture(scope="module")
def wrapper(tiny_target):
    return DeepseekV41DSparkTargetModel(tiny_target, tiny_target.config.text_config.dspark_target_layer_ids)


def _tokens(batch=2, sequence=SEQUENCE, seed=0):
    return torch.randint(4, 500, (batch, sequence), generator=torch.Generator().manual_seed(seed))


def _alone(wrapper, tokens):
    ones = torch.ones_like(tokens)
    return wrapper.generate_batch(tokens, ones, ones)


def test_alignment_is_lcm_of_active_ratios(tiny_target):
    assert compression_alignment(tiny_target) == 4
    config = tiny_target_config(compress_ratios=[0, 0, 2, 2, 3, 3, 0])
    assert compression_alignment(build_tiny_target(config=config)) == 6
    # Ratios of layers past num_hidden_layers (the DSpark draft layers) do not count.
    config = tiny_target_config(compress_ratios=[0, 0, 4, 4, 1, 1, 8])
    assert compression_alignment(build_tiny_target(config=config)) == 4


def test_aligned_layout_matches_upstream_full_width_layout():
    layout = aligned_packed_layout(SEQ_LENS, (2, SEQUENCE), 4, sync_across_ranks=False)
    expected = upstream.packed_layout(
        SEQ_LENS, seq_lens_padded=None, input_shape=(2, SEQUENCE), alignment=4, minimum_length=SEQUENCE
    )
    for field in FIELDS:
        assert torch.equal(getattr(layout, field), getattr(expected, field)), field
    assert layout.source_indices.shape[1] >= SEQUENCE
    assert (layout.position_ids[layout.sequence_ids > 0] >= 0).all()


def test_aligned_layout_without_process_group_acts_as_one_rank():
    synced = aligned_packed_layout(SEQ_LENS, (2, SEQUENCE), 4, sync_across_ranks=True)
    local = aligned_packed_layout(SEQ_LENS, (2, SEQUENCE), 4, sync_across_ranks=False)
    assert all(torch.equal(getattr(synced, field), getattr(local, field)) for field in FIELDS)
    assert max_over_ranks(7) == 7


def test_aligned_layout_restores_zero_at_caller_padding():
    # Rows of 12 caller tokens with 3 trailing padding tokens each.
    seq_lens = torch.tensor([[5, 4], [9, 0]])
    layout = aligned_packed_layout(seq_lens, (2, 12), 4, sync_across_ranks=False)
    values = torch.randn(2, layout.source_indices.shape[1], 3) + 10
    restored = layout.restore(values)
    assert (restored[:, 9:] == 0).all()
    assert (restored[:, :9] != 0).all()


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"alignment": 0}, "alignment"),
        ({"seq_lens": SEQ_LENS.float()}, "seq_lens"),
        ({"seq_lens": torch.tensor([[30, 0, 0, 0], [1, 0, 0, 0]])}, "input row"),
        ({"seq_lens": torch.tensor([[5, -3, 0, 0], [1, 0, 0, 0]])}, "negative"),
        ({"input_shape": (3, SEQUENCE)}, "seq_lens"),
        ({"sync_across_ranks": 1}, "sync_across_ranks"),
    ],
)
def test_aligned_layout_refusals(kwargs, fragment):
    arguments = {"seq_lens": SEQ_LENS, "input_shape": (2, SEQUENCE), "alignment": 4, "sync_across_ranks": False}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=fragment):
        aligned_packed_layout(**arguments)


def test_packed_features_equal_each_document_alone(wrapper):
    tokens = _tokens()
    batch = wrapper.generate_batch(tokens, torch.ones_like(tokens), torch.ones_like(tokens), seq_lens=SEQ_LENS)
    hidden = wrapper.model.config.text_config.hidden_size
    assert batch.target_hidden_states.shape == (2, SEQUENCE, 3 * hidden)
    assert batch.target_last_hidden_states.shape == (2, SEQUENCE, hidden)
    assert assert_documents_match_alone(wrapper, batch, tokens, SEQ_LENS) == 5


def test_packing_changes_features_without_alignment(wrapper):
    """Guard for the test above: the same pack without aligned starts does leak across documents."""
    tokens = _tokens()
    unaligned = upstream.packed_layout(SEQ_LENS, seq_lens_padded=None, input_shape=(2, SEQUENCE), alignment=1)
    captured = {}
    module = wrapper._target_feature_modules[-1]
    handle = module.register_forward_pre_hook(lambda _m, inputs: captured.update(x=inputs[0].mean(2)))
    try:
        with torch.no_grad():
            wrapper.model(
                unaligned.pack(tokens, fill=2),
                attention_mask=unaligned.sequence_ids > 0,
                position_ids=unaligned.position_ids,
                packed_seq_ids=unaligned.sequence_ids,
                logits_to_keep=1,
            )
    finally:
        handle.remove()
    features = unaligned.restore(captured["x"])
    row, start, length = 0, 5, 11  # starts at column 5: not a compression-group boundary
    alone = _alone(wrapper, tokens[row : row + 1, start : start + length]).target_hidden_states[0, :, -16:]
    assert (features[row, start : start + length] - alone).abs().max() > 1e-4


def test_unpacked_batch_matches_upstream_wrapper(tiny_target, wrapper):
    tokens = _tokens(seed=3)
    mask = torch.ones_like(tokens)
    mask[1, 17:] = 0
    ours = wrapper.generate_batch(tokens, mask, mask)
    theirs = HFDSparkTargetModel(tiny_target, tiny_target.config.text_config.dspark_target_layer_ids).generate_batch(
        tokens, mask, mask
    )
    torch.testing.assert_close(ours.target_hidden_states, theirs.target_hidden_states, atol=0, rtol=0)
    torch.testing.assert_close(ours.target_last_hidden_states, theirs.target_last_hidden_states, atol=0, rtol=0)
    assert ours.input_ids is tokens and ours.loss_mask is mask


def test_upstream_wrapper_cannot_run_packed_v41(tiny_target):
    """The gap this plugin fills: upstream feeds V4.1 a 4-D mask and packed positions it refuses."""
    tokens = _tokens()
    seq_lens = torch.tensor([[5, 11, 7], [9, 14, 0]])  # upstream's mask builder has no -1000 marker
    upstream_wrapper = HFDSparkTargetModel(tiny_target, tiny_target.config.text_config.dspark_target_layer_ids)
    positions = upstream.packed_layout(seq_lens, seq_lens_padded=None, input_shape=(2, SEQUENCE), alignment=1)
    with pytest.raises(ValueError, match="DeepSeek V4.1"):  # per-document positions or the 4-D mask
        upstream_wrapper.generate_batch(
            tokens,
            torch.ones_like(tokens),
            torch.ones_like(tokens),
            position_ids=positions.position_ids,
            seq_lens=seq_lens,
        )
    ours = DeepseekV41DSparkTargetModel(tiny_target, tiny_target.config.text_config.dspark_target_layer_ids)
    batch = ours.generate_batch(tokens, torch.ones_like(tokens), torch.ones_like(tokens), seq_lens=seq_lens)
    assert torch.isfinite(batch.target_hidden_states).all()


def test_lm_head_sees_one_position_per_row(tiny_target):
    seen = []
    handle = tiny_target.lm_head.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].shape))
    try:
        dspark_packed_forward(tiny_target, _tokens(), SEQ_LENS)
    finally:
        handle.remove()
    assert seen == [torch.Size([2, 1, tiny_target.config.text_config.hidden_size])]


def test_target_stays_frozen():
    model = build_tiny_target(seed=1)
    model.requires_grad_(True)
    captured = []
    handle = model.model.norm.register_forward_hook(lambda _m, _i, output: captured.append(output))
    try:
        with torch.enable_grad():
            dspark_packed_forward(model, _tokens(), SEQ_LENS)
    finally:
        handle.remove()
    assert not captured[0].requires_grad and captured[0].grad_fn is None
    assert all(parameter.grad is None for parameter in model.parameters())
    DeepseekV41DSparkTargetModel(model, [1, 3, 5])
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_returned_layout_maps_aligned_captures(tiny_target):
    tokens = _tokens()
    layout = dspark_packed_forward(tiny_target, tokens, SEQ_LENS)
    assert layout.source_indices.shape[1] % 4 == 0
    starts = layout.sequence_ids[:, 1:] != layout.sequence_ids[:, :-1]
    starts = torch.cat([torch.ones(2, 1, dtype=torch.bool), starts], 1) & (layout.sequence_ids > 0)
    assert (starts.nonzero()[:, 1] % 4 == 0).all(), "every document starts on a compression-group boundary"
    assert torch.equal(layout.restore(layout.pack(tokens)), tokens)


def test_inputs_never_mutated(wrapper):
    tokens = _tokens()
    seq_lens = SEQ_LENS.clone()
    snapshot = tokens.clone(), seq_lens.clone()
    wrapper.generate_batch(tokens, torch.ones_like(tokens), torch.ones_like(tokens), seq_lens=seq_lens)
    assert torch.equal(tokens, snapshot[0]) and torch.equal(seq_lens, snapshot[1])


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"seq_lens": torch.tensor([[5, 0, 11, 6], [9, -1000, 14, 0]])}, "sum to the packed sequence length"),
        ({"seq_lens": SEQ_LENS.float()}, "seq_lens must be an int32/int64"),
        ({"seq_lens": SEQ_LENS[0]}, r"seq_lens must have shape \[batch=2"),
        ({"seq_lens": SEQ_LENS[:1]}, r"seq_lens must have shape \[batch=2"),
        ({"input_ids": _tokens().float()}, "input_ids must be an int32/int64"),
        ({"input_ids": _tokens()[0]}, "input_ids must be"),
        ({"input_ids": _tokens().index_fill(1, torch.tensor([3]), 511)}, "image token"),
        ({"model": torch.nn.Linear(2, 2)}, "DeepseekV41ForCausalLM"),
        ({"input_ids": _tokens()[:0], "seq_lens": SEQ_LENS[:0]}, "at least one row"),
        ({"input_ids": _tokens()[:, :0]}, "at least one row and one token"),
        ({"seq_lens": torch.zeros(2, 4, dtype=torch.long)}, "sum to the packed sequence length"),
        ({"seq_lens": torch.tensor([[5, 0, 11, 7], [9, -1000, 14, 0]], dtype=torch.int16)}, "int32/int64"),
    ],
)
def test_forward_refusals(tiny_target, change, fragment):
    arguments = {"model": tiny_target, "input_ids": _tokens(), "seq_lens": SEQ_LENS}
    arguments.update(change)
    with pytest.raises(ValueError, match=fragment):
        dspark_packed_forward(**arguments)


def test_wrapper_refusals(tiny_target, wrapper):
    tokens = _tokens()
    with pytest.raises(ValueError, match="text-only"):
        wrapper.generate_batch(tokens, tokens, tokens, pixel_values=torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="DeepseekV41ForCausalLM"):
        DeepseekV41DSparkTargetModel(torch.nn.Linear(2, 2), [0])
    with pytest.raises(ValueError, match="strictly increasing"):
        DeepseekV41DSparkTargetModel(tiny_target, [3, 1])


def test_two_ranks_sync_layout_width(gloo):
    gloo(WORKER, "layout")


def test_two_ranks_hybridep_forward_features(gloo):
    gloo(WORKER, "forward")


def test_two_ranks_cp_features_and_loss_match_single_rank(gloo):
    gloo(Path(__file__).with_name("gloo_cp.py"))


def _host_reads(model, tokens, seq_lens) -> int:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from host_syncs import count_host_syncs

    with count_host_syncs() as sites:
        dspark_packed_forward(model, tokens, seq_lens)
    return sum(sites.values())


def test_seed_function_takes_the_packed_indexer_on_a_plain_target(monkeypatch):
    """``dspark_packed_forward`` on upstream's own ``DeepseekV41ForCausalLM`` (the seed's contract): the plugin's
    indexer is installed inside the call, so a 2,048-token row's host reads do not grow from 2 to 128 documents
    (upstream's per-document selection: 25 and 529), and the features equal upstream's forward where no
    top-k tie exists: the indexer's mxfp4 quantisation replaced by ``abs`` in both, so every query-key product is
    positive and no score is a ReLU zero (with upstream's quantisation, zero scores tie and the two keep
    different tied keys: docs/evaluation.md)."""
    from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention

    from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs
    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import PackedIndexer

    plain = build_tiny_target(seed=0, packed_indexer=False)
    assert not any(isinstance(module, PackedIndexer) for module in plain.modules())
    row = 2048
    tokens = torch.randint(4, 500, (1, row), generator=torch.Generator().manual_seed(3))
    reads = {}
    for documents in (2, 128):
        lengths = torch.full((1, documents), row // documents)
        reads[documents] = _host_reads(plain, tokens, lengths)
    assert any(isinstance(module, PackedIndexer) for module in plain.modules())
    assert reads[2] == reads[128], reads
    reference = build_tiny_target(seed=0, packed_indexer=False)  # stays upstream's: called directly below
    quantize = upstream_attention.quantize_cache

    def tie_free(values, *, format, block_size):
        return values.abs() if format == "mxfp4" else quantize(values, format=format, block_size=block_size)

    monkeypatch.setattr(upstream_attention, "quantize_cache", tie_free)
    seq_lens = torch.tensor([[700, 300, 1048]])

    def features(model, run):
        captured = []
        handle = model.model.norm.register_forward_hook(lambda _m, _i, output: captured.append(output))
        try:
            layout = run()
        finally:
            handle.remove()
        return layout.restore(captured[0])

    def upstream_forward():
        layout, inputs = prepare_packed_inputs(reference, tokens, seq_lens)
        with torch.no_grad():
            reference(**inputs, logits_to_keep=1)
        return layout

    ours = features(plain, lambda: dspark_packed_forward(plain, tokens, seq_lens))
    theirs = features(reference, upstream_forward)
    assert not any(isinstance(module, PackedIndexer) for module in reference.modules())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
