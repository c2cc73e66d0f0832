"""Differential and contract tests for the vectorised V4.1 packed layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nemo_automodel.components.models.deepseek_v41 import packing as upstream
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_automodel_ext.models.deepseek_v41.packing import PackedSequenceLayout, document_bounds, packed_layout

FIELDS = ("source_indices", "input_positions", "position_ids", "sequence_ids")


@st.composite
def packed_cases(draw):
    """Valid packed_layout arguments, covering absent documents, padded spans and trailing padding."""
    batch = draw(st.integers(0, 4))
    documents = draw(st.integers(0, 6))
    alignment = draw(st.sampled_from([1, 2, 3, 4, 8, 64, 128]))
    use_padded = draw(st.booleans())
    lengths, spans = [], []
    for _ in range(batch):
        row_lengths, row_spans = [], []
        for _ in range(documents):
            if draw(st.integers(0, 4)) == 0:
                row_lengths.append(draw(st.sampled_from([0, -1000])))
                row_spans.append(draw(st.sampled_from([0, -1000])) if use_padded else row_lengths[-1])
            else:
                length = draw(st.integers(1, 40))
                row_lengths.append(length)
                row_spans.append(length + (draw(st.integers(0, 6)) if use_padded else 0))
        lengths.append(row_lengths)
        spans.append(row_spans)
    used = max([sum(max(span, 0) for span in row) for row in spans] + [0])
    sequence = used + draw(st.integers(0, 9))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seq_lens = torch.tensor(lengths, dtype=dtype).view(batch, documents)
    seq_lens_padded = torch.tensor(spans, dtype=torch.int64).view(batch, documents) if use_padded else None
    if batch == 1 and draw(st.booleans()):
        seq_lens = seq_lens[0]
        seq_lens_padded = None if seq_lens_padded is None else seq_lens_padded[0]
    minimum_length = draw(st.sampled_from([0, 1, sequence, sequence + 5, 300]))
    return seq_lens, seq_lens_padded, (batch, sequence), alignment, minimum_length


def upstream_layout(seq_lens, seq_lens_padded, input_shape, alignment, minimum_length=0):
    return upstream.packed_layout(
        seq_lens,
        seq_lens_padded=seq_lens_padded,
        input_shape=input_shape,
        alignment=alignment,
        minimum_length=minimum_length,
    )


def assert_same_layout(expected, actual):
    for field in FIELDS:
        want, got = getattr(expected, field), getattr(actual, field)
        assert got.dtype == torch.long, field
        assert got.device == want.device, field
        assert got.shape == want.shape, (field, got.shape, want.shape)
        assert torch.equal(got, want), field


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packed_cases())
def test_matches_upstream_layout(case):
    seq_lens, seq_lens_padded, input_shape, alignment, minimum_length = case
    before = seq_lens.clone(), None if seq_lens_padded is None else seq_lens_padded.clone()
    actual = packed_layout(seq_lens, seq_lens_padded, input_shape, alignment, minimum_length)
    assert_same_layout(upstream_layout(*case), actual)
    assert torch.equal(seq_lens, before[0])
    if seq_lens_padded is not None:
        assert torch.equal(seq_lens_padded, before[1])


def test_keyword_call_matches_upstream_signature():
    seq_lens = torch.tensor([[3, 0, 5], [7, -1000, 0]])
    actual = packed_layout(seq_lens, seq_lens_padded=None, input_shape=(2, 9), alignment=4, minimum_length=0)
    assert_same_layout(upstream_layout(seq_lens, None, (2, 9), 4), actual)
    # Document 1 occupies aligned columns 0..2, document 3 starts at the next boundary (4).
    assert actual.sequence_ids[0].tolist() == [1, 1, 1, 0, 3, 3, 3, 3, 3, 0, 0, 0]
    assert actual.position_ids[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]
    assert actual.input_positions[1].tolist() == [0, 1, 2, 3, 4, 5, 6, -1, -1]


def test_padded_spans_drop_existing_padding():
    seq_lens = torch.tensor([[2, 3]])
    spans = torch.tensor([[4, 3]])
    layout = packed_layout(seq_lens, spans, (1, 8), 2)
    assert layout.source_indices[0].tolist() == [0, 1, 4, 5, 6, -1]
    assert layout.input_positions[0].tolist() == [0, 1, -1, -1, 2, 3, 4, -1]


BAD_INPUTS = [
    # (description, kwargs, error message fragment)
    ("zero alignment", dict(alignment=0), "alignment"),
    ("negative alignment", dict(alignment=-4), "alignment"),
    ("fractional alignment", dict(alignment=2.5), "alignment"),
    ("float lengths", dict(seq_lens=torch.tensor([[3.0, 2.0]])), "seq_lens"),
    ("bool lengths", dict(seq_lens=torch.tensor([[True, False]])), "seq_lens"),
    ("int16 lengths", dict(seq_lens=torch.tensor([[3, 2]], dtype=torch.int16)), "seq_lens"),
    ("float spans", dict(seq_lens_padded=torch.tensor([[3.0, 2.0]])), "seq_lens_padded"),
    ("batch mismatch", dict(input_shape=(2, 8)), "seq_lens"),
    ("3-D lengths", dict(seq_lens=torch.tensor([[[3, 2]]])), "seq_lens"),
    ("0-D lengths", dict(seq_lens=torch.tensor(3)), "seq_lens"),
    ("span shape mismatch", dict(seq_lens_padded=torch.tensor([[3, 2, 0]])), "seq_lens_padded"),
    ("negative length", dict(seq_lens=torch.tensor([[3, -2]])), "negative"),
    ("span shorter than length", dict(seq_lens_padded=torch.tensor([[2, 2]])), "seq_lens_padded"),
    ("spans past the row", dict(seq_lens=torch.tensor([[6, 3]])), "input row"),
    ("padded spans past the row", dict(seq_lens_padded=torch.tensor([[6, 3]])), "input row"),
    ("absent with span", dict(seq_lens=torch.tensor([[3, 0]]), seq_lens_padded=torch.tensor([[3, 2]])), "absent"),
    (
        "absent -1000 with span",
        dict(seq_lens=torch.tensor([[-1000, 2]]), seq_lens_padded=torch.tensor([[1, 2]])),
        "absent",
    ),
]


@pytest.mark.parametrize("description,overrides,fragment", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_refusals_match_upstream(description, overrides, fragment):
    kwargs = dict(
        seq_lens=torch.tensor([[3, 2]]), seq_lens_padded=None, input_shape=(1, 8), alignment=4, minimum_length=0
    )
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=fragment):
        packed_layout(**kwargs)
    if description != "fractional alignment":  # upstream fails later with a TypeError there
        with pytest.raises(ValueError):
            upstream_layout(**kwargs)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(seq_lens=[[3, 2]]), "seq_lens must be a torch.Tensor"),
        (dict(input_shape=(1,)), "input_shape"),
        (dict(input_shape=(1, -3)), "input_shape"),
        (dict(minimum_length=1.5), "minimum_length"),
    ],
)
def test_argument_type_refusals(kwargs, fragment):
    arguments = dict(seq_lens=torch.tensor([[3, 2]]), seq_lens_padded=None, input_shape=(1, 8), alignment=4)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=fragment):
        packed_layout(**arguments)


def _layout_and_values(trailing=(3,), requires_grad=True):
    seq_lens = torch.tensor([[3, 0, 5], [6, 2, -1000]])
    spans = torch.tensor([[4, 0, 5], [6, 2, 0]])
    layout = packed_layout(seq_lens, spans, (2, 11), 4)
    values = torch.randn(2, 11, *trailing, dtype=torch.float64, requires_grad=requires_grad)
    return layout, values


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
def test_pack_matches_upstream_and_fills_padding(trailing):
    layout, values = _layout_and_values(trailing, requires_grad=False)
    reference = upstream.PackedSequenceLayout(*(getattr(layout, field) for field in FIELDS))
    packed = layout.pack(values, fill=-7.5)
    assert torch.equal(packed, reference.pack(values, fill=-7.5))
    padding = layout.source_indices < 0
    assert (packed[padding] == -7.5).all()
    restored = layout.restore(packed)
    assert torch.equal(restored, reference.restore(packed))
    real = layout.input_positions >= 0
    assert torch.equal(restored[real], values[real])
    assert (restored[~real] == 0).all()


def test_pack_of_integer_ids_uses_fill():
    layout, _ = _layout_and_values()
    ids = torch.arange(22).view(2, 11)
    packed = layout.pack(ids, fill=2)
    assert packed.dtype == ids.dtype
    assert packed[0].tolist()[:8] == [0, 1, 2, 2, 4, 5, 6, 7]


def test_gradients_reach_real_tokens_only():
    layout, values = _layout_and_values((3,))
    weights = torch.randn(2, 11, 3, dtype=torch.float64)
    (layout.restore(layout.pack(values, fill=5.0)) * weights).sum().backward()
    real = (layout.input_positions >= 0).unsqueeze(-1)
    assert torch.equal(values.grad, weights * real)


def test_gradients_through_packed_side():
    layout, values = _layout_and_values((2,))
    packed_weights = torch.randn(2, layout.source_indices.shape[1], 2, dtype=torch.float64)
    (layout.pack(values) * packed_weights).sum().backward()
    expected = layout.restore(packed_weights)
    assert torch.equal(values.grad, expected)


def test_inputs_never_mutated_and_outputs_independent():
    layout, values = _layout_and_values((3,), requires_grad=False)
    snapshot = values.clone()
    fields = [getattr(layout, field).clone() for field in FIELDS]
    packed = layout.pack(values, fill=1.0)
    restored = layout.restore(packed)
    packed.zero_()
    assert torch.equal(values, snapshot)
    assert restored.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
    assert all(torch.equal(getattr(layout, field), field_copy) for field, field_copy in zip(FIELDS, fields))


def test_non_contiguous_values():
    layout, values = _layout_and_values((4,), requires_grad=False)
    transposed = values.transpose(0, 1).contiguous().transpose(0, 1)  # batch-minor storage
    assert not transposed.is_contiguous()
    assert torch.equal(layout.pack(transposed, fill=3), layout.pack(values, fill=3))


def test_pack_refuses_wrong_shapes():
    layout, values = _layout_and_values()
    with pytest.raises(ValueError, match="values must have shape"):
        layout.pack(values[:, :-1])
    with pytest.raises(ValueError, match="values must have shape"):
        layout.restore(values)
    with pytest.raises(ValueError, match="values must have shape"):
        layout.pack(values[0, 0])
    with pytest.raises(ValueError, match="torch.Tensor"):
        layout.pack([[1, 2]])


def test_empty_and_all_absent_rows():
    layout = packed_layout(torch.zeros(2, 0, dtype=torch.long), None, (2, 5), 4)
    assert_same_layout(upstream_layout(torch.zeros(2, 0, dtype=torch.long), None, (2, 5), 4), layout)
    assert layout.source_indices.shape == (2, 4)  # minimum_length 0 still keeps one aligned group
    assert layout.pack(torch.ones(2, 5), fill=9).eq(9).all()
    assert layout.restore(torch.ones(2, 4)).eq(0).all()
    empty = packed_layout(torch.zeros(0, 3, dtype=torch.long), None, (0, 0), 2)
    assert empty.pack(torch.ones(0, 0, 7)).shape == (0, 2, 7)


def test_empty_batches_keep_the_autograd_graph():
    """A pack of 0 rows stays connected to its input (zero gradient), as upstream's does."""
    seq_lens = torch.zeros(0, 3, dtype=torch.long)
    values = torch.ones(0, 0, 7, requires_grad=True)
    reference = upstream_layout(seq_lens, None, (0, 0), 2).pack(values)
    packed = packed_layout(seq_lens, None, (0, 0), 2).pack(values, fill=3)
    assert reference.grad_fn is not None and packed.grad_fn is not None
    assert packed.shape == reference.shape == (0, 2, 7)
    packed.sum().backward()
    assert values.grad is not None and values.grad.shape == values.shape


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_for(batch, documents):
    seq_lens = torch.full((batch, documents), 5)
    with _OpCounter() as counter:
        packed_layout(seq_lens, None, (batch, 5 * documents), 4, 0)
    return counter.ops


def test_no_python_loop_over_rows_or_documents():
    """The dispatched op sequence is the same for 1 or 8 rows and 2 or 300 documents."""
    reference = _ops_for(1, 2)
    assert _ops_for(8, 300) == reference
    assert _ops_for(3, 17) == reference
    assert not any("_local_scalar_dense" in op or "item" in op for op in reference)


def test_layout_is_frozen_dataclass():
    layout = packed_layout(torch.tensor([2]), None, (1, 2), 2)
    assert isinstance(layout, PackedSequenceLayout)
    with pytest.raises(AttributeError):
        layout.position_ids = None


def test_document_bounds_match_a_walk_over_the_row():
    """Start, end and slot of each column's document; absent entries (0, -1000) split nothing."""
    seq_lens = torch.tensor([[3, 0, 4, -1000, 2], [5, 5, 0, 0, 0]], dtype=torch.int32)
    columns = torch.arange(11).expand(2, -1)
    bounds = document_bounds(seq_lens, columns)
    expected = {0: [], 1: []}
    for row, lengths in enumerate(seq_lens.tolist()):
        start = 0
        for slot, length in enumerate(lengths):
            if length > 0:
                expected[row] += [(slot, start, start + length)] * length
                start += length
        expected[row] += [(len(lengths), start, start)] * (11 - start)
    for row in range(2):
        got = list(zip(bounds.index[row].tolist(), bounds.start[row].tolist(), bounds.end[row].tolist()))
        assert got == expected[row]
