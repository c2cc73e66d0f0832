"""The packed V4.1 DSpark draft keeps every block inside its anchor's document."""

from __future__ import annotations

import pytest
import torch
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41DSparkConfig
from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
from nemo_automodel.components.speculative.dspark.common import sample_anchor_positions

from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.tiny import tiny_target_config

SEQ_LENS = torch.tensor([[10, 14, 0], [6, 8, 10]])
SEQUENCE = 24
ANCHORS = 12


def _options(num_anchors=ANCHORS):
    text = tiny_target_config().text_config
    return DeepseekV41DSparkConfig(
        text_config=text,
        num_draft_layers=text.num_nextn_predict_layers,
        target_layer_ids=tuple(text.dspark_target_layer_ids),
        block_size=text.dspark_block_size,
        num_anchors=num_anchors,
        mask_token_id=text.dspark_noise_token_id,
        markov_rank=text.dspark_markov_rank,
        markov_head_type="vanilla",
        confidence_head_alpha=1.0,
        confidence_head_with_markov=True,
    )


@pytest.fixture(scope="module")
def draft():
    torch.manual_seed(0)
    return DeepseekV41PackedDSparkModel.from_options(_options()).eval()


def _packing(seq_lens):
    rows = [[n for n in row if n > 0] for row in seq_lens.tolist()]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    remaining = torch.stack([torch.cat([torch.arange(n - 1, -1, -1) for n in row]) for row in rows])
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])
    return positions, remaining, documents


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(4, 500, (2, SEQUENCE), generator=generator),
        torch.randn(2, SEQUENCE, 48, generator=generator),
        torch.ones(2, SEQUENCE),
        torch.randn(2, SEQUENCE, 16, generator=generator),
    )


def _packed_forward(draft, inputs, seq_lens=SEQ_LENS, seed=5):
    positions, remaining, _ = _packing(seq_lens)
    torch.manual_seed(seed)
    return draft(*inputs, position_ids=positions, seq_lens=seq_lens, doc_remaining=remaining)


def test_same_parameters_and_keys_as_upstream(draft):
    reference = _options().build()
    assert isinstance(draft, DeepseekV41DSparkModel)
    assert list(draft.state_dict()) == list(reference.state_dict())
    assert draft.num_anchors == reference.num_anchors


def test_one_document_rows_equal_the_unpacked_forward(draft):
    inputs = _inputs()
    seq_lens = torch.tensor([[SEQUENCE], [SEQUENCE]])
    torch.manual_seed(5)
    unpacked = draft(*inputs)
    packed = _packed_forward(draft, inputs, seq_lens)
    assert torch.equal(packed.eval_mask, unpacked.eval_mask)
    torch.testing.assert_close(packed.draft_logits, unpacked.draft_logits, atol=0, rtol=0)


def test_supervision_never_crosses_a_document(draft):
    inputs = _inputs()
    torch.manual_seed(5)
    anchors, keep = sample_anchor_positions(seq_len=SEQUENCE, loss_mask=inputs[2], num_anchors=ANCHORS, device="cpu")
    output = _packed_forward(draft, inputs)
    _, _, documents = _packing(SEQ_LENS)
    labels = (anchors.unsqueeze(-1) + torch.arange(1, 5)).clamp(max=SEQUENCE - 1)
    same_document = documents.gather(1, labels.flatten(1)).view_as(labels) == documents.gather(1, anchors).unsqueeze(-1)
    assert not (output.eval_mask & ~same_document).any()
    torch.manual_seed(5)
    assert (draft(*inputs).eval_mask & ~same_document).any(), "unpacked blocks do cross documents here"


def test_blocks_ignore_other_documents(draft):
    inputs = _inputs()
    changed = [tensor.clone() for tensor in inputs]
    changed[0][:, :6] = torch.randint(4, 500, (2, 6))  # first document of each row
    changed[1][:, :6] += 3.0
    torch.manual_seed(5)
    anchors, keep = sample_anchor_positions(seq_len=SEQUENCE, loss_mask=inputs[2], num_anchors=ANCHORS, device="cpu")
    later = (anchors >= torch.tensor([[10], [6]])) & keep  # blocks anchored after the first document
    assert later.any()
    first = _packed_forward(draft, inputs)
    second = _packed_forward(draft, changed)
    torch.testing.assert_close(first.draft_logits[later], second.draft_logits[later], atol=1e-5, rtol=0)
    torch.manual_seed(5)
    unpacked_first = draft(*inputs)
    torch.manual_seed(5)
    unpacked_second = draft(*changed)
    assert (unpacked_first.draft_logits[later] - unpacked_second.draft_logits[later]).abs().max() > 1e-4


def test_packed_metadata_is_required(draft):
    inputs = _inputs()
    with pytest.raises(ValueError, match="position_ids"):
        draft(*inputs, seq_lens=SEQ_LENS, doc_remaining=_packing(SEQ_LENS)[1])
    with pytest.raises(ValueError, match="doc_remaining"):
        draft(*inputs, position_ids=_packing(SEQ_LENS)[0], seq_lens=SEQ_LENS)
