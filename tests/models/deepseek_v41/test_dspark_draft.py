"""The V4.1 DSpark draft: windowed attention equals the released dense path; packed blocks stay in their document."""

from __future__ import annotations

import pytest
import torch
from nemo_automodel.components.models.deepseek_v41 import dspark as upstream_dspark
from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
from nemo_automodel.components.speculative.dspark.common import build_eval_mask, create_position_ids
from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend, released_draft_options, tiny_target_config

SEQ_LENS = torch.tensor([[10, 14, 0], [6, 8, 10]])
SEQUENCE = 24
ANCHORS = 12
WINDOW = tiny_target_config().text_config.sliding_window  # 8


def _options(num_anchors=ANCHORS):
    return released_draft_options(tiny_target_config().text_config, num_anchors)


def _backend(attn):
    return cpu_backend(attn=attn, experts="torch")


@pytest.fixture(scope="module")
def draft():
    torch.manual_seed(0)
    return DeepseekV41PackedDSparkModel.from_options(_options()).eval()


class DensePackedReference(DeepseekV41DSparkModel):
    """Naive reference: upstream's dense draft plus a document mask and document-local positions."""

    documents: torch.Tensor
    positions: torch.Tensor

    def build_position_ids(self, anchor_positions, context_sequence):
        draft = create_position_ids(anchor_positions, self.config.dspark_block_size, self.positions)
        return torch.cat((self.positions, draft), dim=1)

    def build_attention_mask(self, anchor_positions, block_keep_mask, context_sequence, dtype):
        mask = super().build_attention_mask(anchor_positions, block_keep_mask, context_sequence, dtype)
        anchor_document = self.documents.gather(1, anchor_positions).repeat_interleave(self.config.dspark_block_size, 1)
        foreign = self.documents.unsqueeze(1) != anchor_document.unsqueeze(2)
        context = mask[..., :context_sequence].masked_fill(foreign.unsqueeze(1), float("-inf"))
        return torch.cat((context, mask[..., context_sequence:]), dim=-1)


def _packing(seq_lens):
    rows = [[n for n in row if n > 0] for row in seq_lens.tolist()]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    remaining = torch.stack([torch.cat([torch.arange(n - 1, -1, -1) for n in row]) for row in rows])
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])
    return positions, remaining, documents


def _inputs(seed=0, sequence=SEQUENCE, batch=2):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(4, 500, (batch, sequence), generator=generator),
        torch.randn(batch, sequence, 48, generator=generator),
        torch.ones(batch, sequence),
        torch.randn(batch, sequence, 16, generator=generator),
    )


def _loss(output):
    return compute_dspark_loss(
        outputs=output, loss_decay_gamma=None, ce_loss_alpha=0.5, l1_loss_alpha=0.5, confidence_head_alpha=0.1
    )


def _pair(attn):
    torch.manual_seed(0)
    mine = DeepseekV41PackedDSparkModel.from_options(_options(), backend=_backend(attn))
    reference = DensePackedReference(
        mine.config, backend=_backend(attn), num_anchors=ANCHORS, enable_confidence_head=True
    )
    reference.load_state_dict(mine.state_dict())
    return mine, reference


def _assert_same_grads(mine, reference):
    for (name, ours), (_, theirs) in zip(mine.named_parameters(), reference.named_parameters(), strict=True):
        if ours.grad is None or theirs.grad is None:
            assert ours.grad is None and theirs.grad is None, name
        else:
            torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_same_parameters_and_keys_as_upstream(draft):
    reference = _options().build()
    assert isinstance(draft, DeepseekV41DSparkModel)
    assert list(draft.state_dict()) == list(reference.state_dict())
    assert draft.num_anchors == reference.num_anchors


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unpacked_windowed_equals_the_released_dense_draft(attn):
    """Same weights, same RNG: upstream's dense DeepseekV41DSparkModel gives the same outputs, loss and grads.

    Rows of 40 with a window of 8 cover windows clipped at the row start (anchors < 8), right
    padding (row 1), and dummy anchors (row 1 has fewer candidates than anchors at 36).
    """
    torch.manual_seed(0)
    mine = DeepseekV41PackedDSparkModel.from_options(_options(num_anchors=36), backend=_backend(attn))
    dense = DeepseekV41DSparkModel(mine.config, backend=_backend(attn), num_anchors=36, enable_confidence_head=True)
    dense.load_state_dict(mine.state_dict())
    input_ids, features, loss_mask, last = _inputs(1, sequence=40)
    loss_mask[1, 30:] = 0
    torch.manual_seed(5)
    ours = mine(input_ids, features, loss_mask, last)
    torch.manual_seed(5)
    theirs = dense(input_ids, features, loss_mask, last)
    assert not ours.block_keep_mask[1].all(), "row 1 must have dummy anchors"
    assert torch.equal(ours.eval_mask, theirs.eval_mask) and torch.equal(ours.target_ids, theirs.target_ids)
    for field in ("draft_logits", "aligned_target_logits", "confidence_pred"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), atol=1e-5, rtol=1e-5)
    loss_ours, loss_theirs = _loss(ours), _loss(theirs)
    torch.testing.assert_close(loss_ours, loss_theirs, atol=1e-6, rtol=1e-6)
    loss_ours.backward()
    loss_theirs.backward()
    _assert_same_grads(mine, dense)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_windowed_equals_a_dense_document_masked_reference(attn, monkeypatch):
    """Explicit anchors covering every edge: windows clipped at a document start, anchors in the
    first ``sliding_window`` tokens, blocks cut at a document end, and dummy anchors."""
    seq_lens = torch.tensor([[3, 17, 12, 0], [30, 2, -1000, 0]])  # a -1000 marker mid-row in row 1
    sequence = 32
    positions, remaining, documents = _packing(seq_lens)
    anchors = torch.tensor([[0, 1, 3, 5, 12, 18, 19, 20, 25, 30, 0, 0], [0, 2, 7, 9, 20, 27, 28, 29, 30, 0, 0, 0]])
    keep = torch.tensor([[True] * 10 + [False] * 2, [True] * 9 + [False] * 3])
    mine, reference = _pair(attn)
    reference.documents, reference.positions = documents, positions
    monkeypatch.setattr(upstream_dspark, "sample_anchor_positions", lambda **_: (anchors, keep))
    input_ids, features, loss_mask, last = _inputs(2, sequence=sequence)
    ours = mine(
        input_ids,
        features,
        loss_mask,
        last,
        position_ids=positions,
        seq_lens=seq_lens,
        doc_remaining=remaining,
        anchor_positions=anchors,
        block_keep_mask=keep,
    )
    theirs = reference(input_ids, features, loss_mask, last)
    label_columns = anchors.unsqueeze(-1) + torch.arange(1, 5)
    safe = label_columns.clamp(max=sequence - 1).masked_fill(~keep.unsqueeze(-1), 0)
    theirs.eval_mask = build_eval_mask(
        seq_len=sequence,
        loss_mask=loss_mask,
        label_indices=label_columns,
        safe_label_indices=safe,
        block_keep_mask=keep,
        doc_remaining=remaining,
        anchor_positions=anchors,
    )
    assert torch.equal(ours.eval_mask, theirs.eval_mask)
    assert not ours.eval_mask[0, 1].all() and ours.eval_mask[0, 1, 0], "block at column 1 is cut at its document end"
    for field in ("draft_logits", "aligned_target_logits", "confidence_pred"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), atol=1e-5, rtol=1e-5)
    loss_ours, loss_theirs = _loss(ours), _loss(theirs)
    torch.testing.assert_close(loss_ours, loss_theirs, atol=1e-6, rtol=1e-6)
    loss_ours.backward()
    loss_theirs.backward()
    _assert_same_grads(mine, reference)


class LargestAllocation(TorchDispatchMode):
    """Largest storage (in elements) that an op output owns; views of ``inputs`` do not count."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {tensor.untyped_storage().data_ptr() for tensor in inputs}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in self.inputs:
                self.largest = max(self.largest, value.untyped_storage().nbytes() // value.element_size())
        return result


def test_no_tensor_grows_with_the_row_at_fixed_anchors(monkeypatch):
    """No allocation is sized [queries, row]: the largest one is the same at rows of 256 and 4096."""
    from nemo_automodel.components.moe import experts

    # The MoE activation is torch.compile'd, which refuses a dispatch mode: trace its eager body.
    eager = experts.swiglu_clamped_deepep._torchdynamo_orig_callable
    monkeypatch.setattr(experts, "swiglu_clamped_deepep", eager)
    torch.manual_seed(0)
    draft = DeepseekV41PackedDSparkModel.from_options(_options()).eval()

    largest = {}
    for sequence in (256, 4096):
        input_ids, features, loss_mask, last = _inputs(3, sequence=sequence, batch=1)
        anchors = torch.linspace(16, sequence - 8, ANCHORS).long().unsqueeze(0)
        mode = LargestAllocation((input_ids, features, loss_mask, last))
        with torch.no_grad(), mode:
            draft(input_ids, features, loss_mask, last, anchor_positions=anchors)
        largest[sequence] = mode.largest
    queries = ANCHORS * draft.config.dspark_block_size
    assert largest[4096] == largest[256] < queries * 4096, largest  # the dense mask alone is queries x (row + queries)


def test_supervision_never_crosses_a_document(draft):
    inputs = _inputs()
    positions, remaining, documents = _packing(SEQ_LENS)
    torch.manual_seed(5)
    output = draft(*inputs, position_ids=positions, seq_lens=SEQ_LENS, doc_remaining=remaining)
    torch.manual_seed(5)
    anchors, keep = draft.sample_anchors(inputs[2], SEQ_LENS, remaining)
    assert keep.any()
    # Every supervised slot predicts a token of the anchor's own document.
    labels = (anchors.unsqueeze(-1) + torch.arange(1, 5)).clamp(max=SEQUENCE - 1)
    same = documents.gather(1, labels.flatten(1)).view_as(labels) == documents.gather(1, anchors).unsqueeze(-1)
    assert torch.equal(keep, output.block_keep_mask)
    assert not (output.eval_mask & ~same).any()


def test_every_kept_anchor_supervises_a_slot(draft):
    """Packed anchors are sampled with doc_remaining: none lands on a document's last token."""
    seq_lens = torch.tensor([[5, 5, 5, 5, 4], [1, 5, 5, 5, 8]])
    positions, remaining, _ = _packing(seq_lens)
    inputs = _inputs(4)
    for seed in range(20):
        torch.manual_seed(seed)
        output = draft(*inputs, position_ids=positions, seq_lens=seq_lens, doc_remaining=remaining)
        assert output.eval_mask[..., 0][output.block_keep_mask].all()


def test_packed_rows_get_the_per_document_budget():
    """Each document gets min(anchors_per_document, its candidates); a row cap keeps a uniform subset."""
    torch.manual_seed(0)
    per_document = DeepseekV41PackedDSparkModel.from_options(_options(num_anchors=3))
    capped = DeepseekV41PackedDSparkModel.from_options(_options(num_anchors=3), max_anchors_per_row=4)
    seq_lens = torch.tensor([[10, 14, 0], [6, 8, 10]])
    _, remaining, documents = _packing(seq_lens)
    loss_mask = torch.ones(2, SEQUENCE)
    loss_mask[1, 6:9] = 0
    for seed in range(10):
        torch.manual_seed(seed)
        anchors, keep = per_document.sample_anchors(loss_mask, seq_lens, remaining)
        assert anchors.shape[1] == 9 and keep.sum(1).tolist() == [6, 9]
        counts = torch.zeros(2, 3, dtype=torch.long).scatter_add_(1, documents.gather(1, anchors), keep.long())
        assert counts.tolist() == [[3, 3, 0], [3, 3, 3]]
        assert all(torch.equal(a[k], a[k].sort().values) for a, k in zip(anchors, keep))
        torch.manual_seed(seed)
        capped_anchors, capped_keep = capped.sample_anchors(loss_mask, seq_lens, remaining)
        assert capped_keep.sum(1).tolist() == [4, 4]
        chosen = {(row, column) for row in range(2) for column in anchors[row][keep[row]].tolist()}
        assert {(row, c) for row in range(2) for c in capped_anchors[row][capped_keep[row]].tolist()} <= chosen


def test_blocks_ignore_other_documents(draft):
    inputs = _inputs()
    changed = [tensor.clone() for tensor in inputs]
    changed[0][:, :6] = torch.randint(4, 500, (2, 6))  # first document of each row
    changed[1][:, :6] += 3.0
    positions, remaining, _ = _packing(SEQ_LENS)
    torch.manual_seed(5)
    anchors, keep = draft.sample_anchors(inputs[2], SEQ_LENS, remaining)
    later = (anchors >= torch.tensor([[10], [6]])) & keep  # blocks anchored after the first document
    assert later.any()
    packed = dict(position_ids=positions, seq_lens=SEQ_LENS, doc_remaining=remaining, anchor_positions=anchors)
    first = draft(*inputs, block_keep_mask=keep, **packed)
    second = draft(*changed, block_keep_mask=keep, **packed)
    torch.testing.assert_close(first.draft_logits[later], second.draft_logits[later], atol=1e-5, rtol=0)
    unpacked_first = draft(*inputs, anchor_positions=anchors, block_keep_mask=keep)
    unpacked_second = draft(*changed, anchor_positions=anchors, block_keep_mask=keep)
    assert (unpacked_first.draft_logits[later] - unpacked_second.draft_logits[later]).abs().max() > 1e-4


def test_absent_marker_mid_row_keeps_documents_apart(draft):
    """A -1000 (absent) entry between two documents must not merge them (upstream's context_doc_ids does)."""
    seq_lens = torch.tensor([[8, -1000, 16]])
    sequence = 24
    positions, remaining, _ = _packing(seq_lens)
    input_ids, features, loss_mask, last = _inputs(6, sequence=sequence, batch=1)
    anchors = torch.tensor([[9, 12, 20]])  # all in the second document, windows reaching back past column 8
    changed = features.clone()
    changed[:, :8] += 5.0
    packed = dict(position_ids=positions, seq_lens=seq_lens, doc_remaining=remaining, anchor_positions=anchors)
    first = draft(input_ids, features, loss_mask, last, **packed)
    second = draft(input_ids, changed, loss_mask, last, **packed)
    torch.testing.assert_close(first.draft_logits, second.draft_logits, atol=1e-5, rtol=0)


def test_packed_metadata_is_required(draft):
    inputs = _inputs()
    with pytest.raises(ValueError, match="position_ids"):
        draft(*inputs, seq_lens=SEQ_LENS, doc_remaining=_packing(SEQ_LENS)[1])
    with pytest.raises(ValueError, match="doc_remaining"):
        draft(*inputs, position_ids=_packing(SEQ_LENS)[0], seq_lens=SEQ_LENS)
    with pytest.raises(ValueError, match="target_hidden_states"):
        draft(inputs[0], inputs[1][:, :5], inputs[2])


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="anchors_per_document"):
        DeepseekV41PackedDSparkModel.from_options(_options(), anchors_per_document=0)


def test_block_logits_plus_markov_is_the_training_logit(draft):
    """Decoding composes slot k from the block's states and the Markov term of the token before it."""
    input_ids, features, loss_mask, last = _inputs(7)
    positions, remaining, _ = _packing(SEQ_LENS)
    anchors = torch.tensor([[2, 12, 15], [1, 7, 16]])
    packed = dict(position_ids=positions, seq_lens=SEQ_LENS)
    output = draft(input_ids, features, loss_mask, doc_remaining=remaining, anchor_positions=anchors, **packed)
    base = draft.block_logits(input_ids, features, anchors, **packed)
    previous = torch.cat((input_ids.gather(1, anchors).unsqueeze(-1), output.target_ids[..., :-1]), dim=-1)
    torch.testing.assert_close(base + draft.markov_logits(previous), output.draft_logits, atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_wraps_the_layers_and_keeps_loss_keys_and_grads():
    """``distributed.activation_checkpointing`` (upstream's draft wrap, as the recipe applies it) changes nothing."""
    from nemo_automodel.recipes.llm._spec_train_utils import apply_draft_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    torch.manual_seed(0)
    plain = DeepseekV41PackedDSparkModel.from_options(_options())
    wrapped = DeepseekV41PackedDSparkModel.from_options(_options())
    wrapped.load_state_dict(plain.state_dict())
    apply_draft_activation_checkpointing(wrapped, True)
    assert all(
        isinstance(layer.attn, CheckpointWrapper) and isinstance(layer.ffn, CheckpointWrapper)
        for layer in wrapped.layers
    )
    assert list(wrapped.state_dict()) == list(plain.state_dict())  # released checkpoint keys
    positions, remaining, _ = _packing(SEQ_LENS)
    ids, hidden, mask, last = _inputs()
    losses = []
    for model in (plain, wrapped):
        torch.manual_seed(1)
        output = model(
            ids,
            hidden,
            mask,
            target_last_hidden_states=last,
            position_ids=positions,
            seq_lens=SEQ_LENS,
            doc_remaining=remaining,
        )
        loss = _loss(output)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    _assert_same_grads(wrapped, plain)


def test_sdpa_never_broadcasts_the_single_kv_head_to_every_head():
    """Under SDPA's math kernel (CUDA's for the released head_dim of 512), no tensor of the draft's forward and
    backward is as large as the block's keys copied to every head, [anchors, heads, keys, head_dim]: the
    broadcast that made the Flash draft step 1.78x its calibration at 256 anchors on an H200."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    # Flash's 64 heads to a single KV head; the tiny widths elsewhere.
    options = released_draft_options(tiny_target_config(num_attention_heads=64).text_config, ANCHORS)
    draft = DeepseekV41PackedDSparkModel.from_options(options, backend=_backend("sdpa"))
    attention = next(m for m in draft.modules() if type(m).__name__ == "WindowedDSparkAttention")
    input_ids, features, loss_mask, last = _inputs(3, sequence=256, batch=1)
    anchors = torch.linspace(16, 248, ANCHORS).long().unsqueeze(0)

    keys = draft.config.sliding_window + draft.config.dspark_block_size + 1
    broadcast = ANCHORS * attention.num_heads * keys * attention.head_dim
    mode = LargestAllocation(())

    def enter(*_):  # the attention's forward under the mode; returning None leaves its inputs and output
        mode.__enter__()

    def leave(*_):
        mode.__exit__(None, None, None)

    handles = [attention.register_forward_pre_hook(enter), attention.register_forward_hook(leave)]
    with sdpa_kernel([SDPBackend.MATH]):
        out = draft(input_ids, features, loss_mask, last, anchor_positions=anchors)
        for handle in handles:
            handle.remove()
        with mode:
            _loss(out).backward()
    assert 0 < mode.largest < broadcast / 2, (mode.largest, broadcast)  # unfolded: exactly the broadcast
