"""Length-class rows: every caller token exactly once, rows about as wide as their documents, the same capture."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dspark_checks import assert_documents_match_alone, present_documents

from nemo_automodel_ext.models.deepseek_v41.length_classes import (
    class_widths,
    dense_forward_seconds,
    length_class_rows,
    relaying_pays,
)
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel

# Two rows of 160: short documents (narrowest class), one of each wider class, absent entries (0, -1000).
SEQ_LENS = torch.tensor([[5, 0, 70, 11, 7, 40, 27], [9, -1000, 14, 130, 0, 7, 0]])
SEQUENCE = 160


def _random_seq_lens(generator: torch.Generator, rows: int, sequence: int) -> torch.Tensor:
    """Rows of random documents (some absent) summing to ``sequence``."""
    out = []
    for _ in range(rows):
        lengths, left = [], sequence
        while left:
            length = min(left, int(torch.randint(1, sequence // 2, (1,), generator=generator)))
            lengths.append(length)
            left -= length
            if torch.rand(1, generator=generator) < 0.2:
                lengths.append(0 if torch.rand(1, generator=generator) < 0.5 else -1000)
        out.append(lengths)
    width = max(map(len, out))
    return torch.tensor([lengths + [0] * (width - len(lengths)) for lengths in out])


def test_class_widths():
    lengths = torch.tensor([1, 63, 64, 65, 128, 129, 300, 2048, 3000])
    assert class_widths(lengths, 2048).tolist() == [64, 64, 64, 128, 128, 256, 512, 2048, 3000]
    assert class_widths(lengths, 256, narrowest=16).tolist() == [16, 64, 64, 128, 128, 256, 300, 2048, 3000]


@pytest.mark.parametrize("seed", range(8))
def test_rows_hold_every_token_once_in_document_order(seed):
    generator = torch.Generator().manual_seed(seed)
    sequence = int(torch.randint(40, 700, (1,), generator=generator))
    seq_lens = _random_seq_lens(generator, 3, sequence)
    snapshot = seq_lens.clone()
    classes = length_class_rows(seq_lens, sequence, narrowest=16)
    assert torch.equal(seq_lens, snapshot)
    sources = torch.cat([rows.source[rows.source >= 0] for rows in classes])
    assert torch.equal(sources.sort().values, torch.arange(3 * sequence)), "every caller token exactly once"
    documents = {(row * sequence + start, length) for row, start, length in present_documents(seq_lens)}
    found = set()
    widths = [rows.source.shape[1] for rows in classes]
    assert widths == sorted(widths), "narrowest first"
    for rows in classes:
        assert torch.equal(
            rows.seq_lens.clamp_min(0).sum(1),
            torch.full((rows.seq_lens.shape[0],), rows.source.shape[1]),
        )
        for source, lengths in zip(rows.source.tolist(), rows.seq_lens.tolist()):
            column = 0
            for index, length in enumerate(lengths):
                if length <= 0:
                    continue
                span = source[column : column + length]
                if index == len(lengths) - 1:  # the trailing padding
                    assert span == [-1] * length
                else:
                    assert span == list(range(span[0], span[0] + length)), "a document's tokens in order"
                    found.add((span[0], length))
                column += length
        # A class's documents share its power of two; above the narrowest class each has a row of its own.
        members = rows.seq_lens[:, :-1]
        members = members[members > 0]
        assert len(set(class_widths(members, sequence, narrowest=16).tolist())) == 1
        width = int(class_widths(members[:1], sequence, narrowest=16))
        if width > 16:
            assert ((rows.seq_lens[:, :-1] > 0).sum(1) == 1).all()
            assert rows.source.shape[1] <= width
        else:
            assert rows.source.shape[1] < 1.5 * width
    assert found == documents


def test_pack_and_scatter_round_trip():
    values = torch.randn(2, SEQUENCE, 3)
    snapshot = values.clone()
    out = torch.full((2 * SEQUENCE, 3), float("nan"))
    for rows in length_class_rows(SEQ_LENS, SEQUENCE):
        packed = rows.pack(values, fill=7)
        assert packed.shape == (*rows.source.shape, 3)
        assert (packed[rows.source < 0] == 7).all()
        rows.scatter(packed, out)
    assert torch.equal(out.view(2, SEQUENCE, 3), values) and torch.equal(values, snapshot)


def test_relaying_pays_by_the_cost_model():
    short = torch.tensor([[30] * 16 + [32]] * 2)  # documents of 30 in rows of 512
    classes = length_class_rows(short, 512)
    assert relaying_pays(classes, 2, 512)
    relaid = sum(dense_forward_seconds(*rows.source.shape) for rows in classes)
    assert relaid < dense_forward_seconds(2, 512)
    # Rows of 64: one more forward of the same width costs more than it saves.
    assert not relaying_pays(length_class_rows(torch.tensor([[30, 34]] * 8), 64), 8, 64)


@pytest.fixture(scope="module")
def wrappers(tiny_target):
    layers = tiny_target.config.text_config.dspark_target_layer_ids
    return (
        DeepseekV41DSparkTargetModel(tiny_target, layers, length_classes="always"),
        DeepseekV41DSparkTargetModel(tiny_target, layers, length_classes="never"),
    )


def _tokens():
    # Any two layouts of a document (alone, packed rows, class rows) agree up to fp32 rounding, which the
    # indexer's FP4 rounding and top-k turn into another selection on a near-tie: on these documents, seed 1
    # moves a token of the packed rows 4.9e-5 from the document alone, seed 5 one of the class rows 8.4e-5.
    # Seed 0 has no near-tie, so both match alone within 1e-5, and the share a mix moves is measured by
    # benchmarks/capture_length_classes.py.
    return torch.randint(4, 500, (2, SEQUENCE), generator=torch.Generator().manual_seed(0))


def test_class_capture_equals_the_packed_rows_and_each_document_alone(wrappers):
    classes, packed = wrappers
    tokens, ones = _tokens(), torch.ones(2, SEQUENCE, dtype=torch.long)
    snapshot = tokens.clone(), SEQ_LENS.clone()
    widths = []
    handle = classes.model.model.register_forward_pre_hook(
        lambda _module, args, kwargs: widths.append(tuple((kwargs.get("input_ids") if not args else args[0]).shape)),
        with_kwargs=True,
    )
    try:
        ours = classes.generate_batch(tokens, ones, ones, seq_lens=SEQ_LENS)
    finally:
        handle.remove()
    theirs = packed.generate_batch(tokens, ones, ones, seq_lens=SEQ_LENS)
    assert torch.equal(tokens, snapshot[0]) and torch.equal(SEQ_LENS, snapshot[1])
    # One forward a class (64, 128 and 256 here), none as wide as the packed rows but the 130-token document's.
    assert len(widths) == 3 and all(width < 1.5 * 64 for _, width in widths[:1]) and widths[2][0] == 1
    for name in ("target_hidden_states", "target_last_hidden_states"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), atol=1e-5, rtol=0)
    assert ours.seq_lens is SEQ_LENS and ours.input_ids is tokens
    assert assert_documents_match_alone(packed, ours, tokens, SEQ_LENS) == 10


def test_when_length_classes_run(tiny_target, wrappers, monkeypatch):
    classes, packed = wrappers
    assert classes.runs_length_classes() and not packed.runs_length_classes()
    auto = DeepseekV41DSparkTargetModel(tiny_target, tiny_target.config.text_config.dspark_target_layer_ids)
    # Auto: rows of 160 on the tiny target: one forward is modelled cheaper than three.
    assert auto.runs_length_classes() and auto._length_classes(_tokens(), SEQ_LENS) == []
    assert auto._length_classes(_tokens(), None) == []
    for backend in (
        SimpleNamespace(attn="tilelang", dispatcher="torch"),
        SimpleNamespace(attn="eager", dispatcher="hybridep"),
    ):
        monkeypatch.setattr(tiny_target, "backend", backend)
        assert not classes.runs_length_classes()
    with pytest.raises(ValueError, match="length_classes must be 'auto', 'always' or 'never'"):
        DeepseekV41DSparkTargetModel(tiny_target, [1, 3, 5], length_classes=True)


def test_class_capture_refuses_what_the_packed_forward_refuses(wrappers):
    classes, _ = wrappers
    tokens = _tokens()
    with pytest.raises(ValueError, match="sum to the packed sequence length"):
        classes.generate_batch(tokens, tokens, tokens, seq_lens=SEQ_LENS - 1)
