"""Property tests of the packed layouts: thousands of generated packs, every invariant checked.

The differential test in test_packing.py pins the layout to upstream's; these state what the
layout means, so a bug shared with upstream would still fail here.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_automodel_ext.models.deepseek_v41.dspark_target import aligned_packed_layout
from nemo_automodel_ext.models.deepseek_v41.packing import packed_layout, round_up

PROPERTY_SETTINGS = settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def packs(draw, padded_spans=True):
    """(seq_lens, seq_lens_padded or None, (batch, sequence), alignment, minimum_length)."""
    batch = draw(st.integers(1, 3))
    documents = draw(st.integers(1, 5))
    alignment = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    use_padded = padded_spans and draw(st.booleans())
    lengths = draw(
        st.lists(
            st.lists(
                st.one_of(st.integers(1, 30), st.sampled_from([0, -1000])), min_size=documents, max_size=documents
            ),
            min_size=batch,
            max_size=batch,
        )
    )
    spans = [
        [length + (draw(st.integers(0, 4)) if use_padded and length > 0 else 0) if length > 0 else 0 for length in row]
        for row in lengths
    ]
    sequence = max(sum(row) for row in spans) + draw(st.integers(0, 6))
    minimum = draw(st.sampled_from([0, sequence, sequence + draw(st.integers(0, 20))]))
    return (
        torch.tensor(lengths),
        torch.tensor(spans) if use_padded else None,
        (batch, sequence),
        alignment,
        minimum,
    )


def _documents(seq_lens, spans):
    """(row, document_id, caller_start, length) of every present document."""
    spans = seq_lens if spans is None else spans
    for row, (lengths, physical) in enumerate(zip(seq_lens.tolist(), spans.tolist())):
        start = 0
        for document, (length, span) in enumerate(zip(lengths, physical), start=1):
            if length > 0:
                yield row, document, start, length
                start += span


def check_layout(layout, seq_lens, spans, input_shape, alignment, minimum):
    batch, sequence = input_shape
    width = layout.source_indices.shape[1]
    real_in_row = torch.zeros(batch, dtype=torch.long)
    for row, document, start, length in _documents(seq_lens, spans):
        columns = (layout.sequence_ids[row] == document).nonzero().squeeze(1)
        # One contiguous run per document, starting on an alignment boundary.
        assert columns.numel() == length
        assert int(columns[0]) % alignment == 0
        assert torch.equal(columns, torch.arange(int(columns[0]), int(columns[0]) + length))
        # Document-local positions and the reversible coordinates.
        assert torch.equal(layout.position_ids[row, columns], torch.arange(length))
        assert torch.equal(layout.source_indices[row, columns], torch.arange(start, start + length))
        assert torch.equal(layout.input_positions[row, start : start + length], columns)
        real_in_row[row] += round_up(length, alignment)
    padding = layout.sequence_ids == 0
    assert (layout.source_indices[padding] == -1).all() and (layout.position_ids[padding] == 0).all()
    # Sequence ids never decrease along a row (ignoring padding).
    for row in range(batch):
        ids = layout.sequence_ids[row][layout.sequence_ids[row] > 0]
        assert (ids[1:] >= ids[:-1]).all()
    # Minimal width: the widest aligned row, the minimum and one group, rounded to the alignment.
    assert width == round_up(max(int(real_in_row.max()), minimum, 1), alignment)
    # Every caller column maps to its aligned column or -1, and the maps invert each other.
    real = layout.input_positions >= 0
    rows = torch.arange(batch).unsqueeze(1).expand_as(layout.input_positions)
    assert torch.equal(layout.source_indices[rows[real], layout.input_positions[real]], real.nonzero()[:, 1])
    assert int(real.sum()) == int(seq_lens.clamp_min(0).sum())


@PROPERTY_SETTINGS
@given(packs())
def test_packed_layout_invariants(case):
    seq_lens, spans, input_shape, alignment, minimum = case
    check_layout(packed_layout(seq_lens, spans, input_shape, alignment, minimum), *case)


@PROPERTY_SETTINGS
@given(packs(), st.integers(0, 3))
def test_round_trip_on_real_tokens(case, trailing):
    seq_lens, spans, input_shape, alignment, minimum = case
    layout = packed_layout(seq_lens, spans, input_shape, alignment, minimum)
    values = torch.randn(*input_shape, *([2] * trailing), dtype=torch.float64)
    restored = layout.restore(layout.pack(values, fill=float("nan")))
    real = layout.input_positions >= 0
    assert torch.equal(restored[real], values[real])
    assert (restored[~real] == 0).all()


@PROPERTY_SETTINGS
@given(packs(padded_spans=False))
def test_aligned_layout_is_the_full_width_packed_layout(case):
    seq_lens, _, input_shape, alignment, _ = case
    layout = aligned_packed_layout(seq_lens, input_shape, alignment, sync_across_ranks=False)
    check_layout(layout, seq_lens, None, input_shape, alignment, input_shape[1])
