"""Draft windows: the compact context is exactly the union of the windows, and every window maps into it."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_automodel_ext.models.deepseek_v41.draft_windows import draft_windows


@st.composite
def window_cases(draw):
    batch = draw(st.integers(1, 3))
    row = draw(st.integers(1, 48))
    count = draw(st.integers(1, 10))
    window = draw(st.integers(1, 12))
    anchors = torch.zeros(batch, count, dtype=torch.long)
    keep = torch.zeros(batch, count, dtype=torch.bool)
    starts = torch.zeros(batch, count, dtype=torch.long)
    for r in range(batch):
        columns = sorted(draw(st.sets(st.integers(0, row - 1), max_size=min(count, row))))
        cuts = sorted(draw(st.sets(st.integers(0, row - 1), max_size=4)) | {0})
        for i, column in enumerate(columns):
            anchors[r, i], keep[r, i] = column, True
            starts[r, i] = max(cut for cut in cuts if cut <= column)
    return anchors, keep, starts, window, row


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window_cases())
def test_windows_match_brute_force(case):
    anchors, keep, starts, window, row = case
    windows = draft_windows(anchors, keep, starts, window, row)
    batch, count = anchors.shape
    assert windows.context_columns.shape == (batch, max(1, min(row, count * window)))
    for r in range(batch):
        visible = [
            [column for column in range(anchors[r, i] - window, anchors[r, i]) if column >= max(starts[r, i], 0)]
            if keep[r, i]
            else []
            for i in range(count)
        ]
        union = sorted({column for columns in visible for column in columns})
        compact = windows.context_columns[r].tolist()
        assert compact[: len(union)] == union and all(column == -1 for column in compact[len(union) :])
        for i in range(count):
            for offset in range(window):
                column = int(anchors[r, i]) - window + offset
                assert bool(windows.window_valid[r, i, offset]) == (column in visible[i])
                if column in visible[i]:
                    assert compact[windows.window_slots[r, i, offset]] == column


def test_gathers_follow_the_slots():
    anchors = torch.tensor([[3, 9, 0]])
    keep = torch.tensor([[True, True, False]])
    windows = draft_windows(anchors, keep, torch.tensor([[0, 5, 0]]), 4, 12)
    values = torch.arange(12.0).view(1, 12, 1).requires_grad_()
    compact = windows.gather_context(values, 12)
    assert compact[0, :7, 0].tolist() == [0.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0]  # [0, 3) and [5, 9)
    assert windows.context_columns[0, 7:].eq(-1).all() and compact[0, 7:].eq(0).all()
    per_anchor = windows.gather_windows(compact)
    assert per_anchor[0, 1, :, 0][windows.window_valid[0, 1]].tolist() == [5.0, 6.0, 7.0, 8.0]
    assert not windows.window_valid[0, 2].any()  # a dummy anchor reads no context
    compact.sum().backward()
    assert values.grad[0, :, 0].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0]
