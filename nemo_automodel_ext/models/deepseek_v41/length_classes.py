"""Length classes: a packed batch's documents re-laid into rows about as wide as they are.

Upstream's eager and SDPA attention (the CPU fallbacks of ``attention.py``) score every query against
its whole row, a dense [row, row + row / ratio] matrix a head masked to the document and window, so a
token's cost grows with the row's width, not with its document (``benchmarks/target_row_width.py``: 9.5x
a token at 2,048 against 128). The packed path keeps every document to itself, so a frozen capture gives
each document the same features in any row (up to fp32 rounding: docs/packing.md, "The capture path"), and
the wrapper may run a packed batch's documents in narrower rows: ``length_class_rows`` sorts them into
power-of-two classes (``class_widths``), a row a document above the narrowest class and shared rows of under
1.5 times its width in it. A class is one more forward, and a forward of the small V4.1 models a CPU runs has
a fixed cost of milliseconds, so ``relaying_pays`` keeps the packed rows unless a cost model of the dense
forward (calibrated on the demo target, checked against measurement by ``benchmarks/capture_length_classes.py``)
says the classes are faster. TileLang's sparse path reads indices and keeps the packed rows as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: A dense-fallback forward of the demo target on one CPU thread takes FORWARD_S + slots x (SLOT_S + COLUMN_S x
#: width) seconds for ``slots`` tokens (padding included) in rows of ``width``: FORWARD_S is an 8-token
#: forward; SLOT_S and COLUMN_S are the straight line through 56.2 and 533 us a token at widths 128 and 2,048
#: (benchmarks/target_row_width.py). ``benchmarks/capture_length_classes.py`` prints the model beside the
#: measurement.
FORWARD_S = 12.6e-3
SLOT_S = 24.4e-6
COLUMN_S = 0.248e-6


def dense_forward_seconds(rows: int, width: int) -> float:
    """Modelled CPU seconds of one dense-fallback forward on ``rows`` rows of ``width`` tokens."""
    return FORWARD_S + rows * width * (SLOT_S + COLUMN_S * width)


def relaying_pays(classes: list[ClassRows], rows: int, sequence: int) -> bool:
    """Whether one forward a class of ``classes`` is modelled faster than one forward on ``rows`` packed rows
    of ``sequence`` tokens (``dense_forward_seconds``)."""
    relaid = sum(dense_forward_seconds(*laid.source.shape) for laid in classes)
    return relaid < dense_forward_seconds(rows, sequence)


def class_widths(lengths: torch.Tensor, widest: int, narrowest: int = 64) -> torch.Tensor:
    """Each length's class: the power of two at or above it, at least ``narrowest``, at most ``widest``.

    Args:
        lengths: Positive integer lengths [n].
        widest: The widest class; a longer length is its own class (as wide as it).
        narrowest: The narrowest class (a power of two).

    Returns:
        New int64 tensor [n] on ``lengths.device``.
    """
    lengths = lengths.long()
    powers = torch.exp2(torch.ceil(torch.log2(lengths.clamp_min(1).double()))).long()
    classes = powers.clamp(min=narrowest, max=widest)
    return torch.where(lengths > widest, lengths, classes)


@dataclass(frozen=True)
class ClassRows:
    """One length class's rows, in caller token coordinates.

    Attributes:
        source: int64 [rows, width]: the flat caller token (``row * sequence + column``) each slot holds,
            -1 at a row's trailing padding.
        seq_lens: int64 [rows, documents]: each row's documents in order, then its trailing padding
            (zero where the row is full); every row sums to ``width``.
    """

    source: torch.Tensor
    seq_lens: torch.Tensor

    def pack(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """Gather caller values into the class rows.

        Args:
            values: [batch, sequence, ...] in caller coordinates (read only).
            fill: Value at trailing padding slots.

        Returns:
            New tensor [rows, width, ...].
        """
        flat = values.reshape(-1, *values.shape[2:])
        packed = flat[self.source.clamp_min(0)]
        padding = (self.source < 0).view(*self.source.shape, *([1] * (values.ndim - 2)))
        return packed.masked_fill(padding, fill)

    def scatter(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write class-row values back to their caller tokens.

        Args:
            values: [rows, width, ...] in class-row coordinates.
            out: [batch * sequence, ...] in flat caller coordinates, written in place at this class's tokens.
        """
        held = self.source >= 0
        out[self.source[held]] = values[held].to(out.dtype)


def length_class_rows(seq_lens: torch.Tensor, sequence: int, narrowest: int = 64) -> list[ClassRows]:
    """Lay the documents of packed rows out again, by length class, in rows about as wide as they are.

    A document of ``n`` tokens goes to class ``w = class_widths(n, sequence, narrowest)``. A class's
    documents keep their caller order and run back to back; a document whose offset in that run falls in
    ``[k * w / 2, (k + 1) * w / 2)`` goes to row ``k``. Every document above the narrowest class is longer
    than ``w / 2``, so it has a row of its own; the narrowest class shares rows of under ``1.5 * w`` tokens.
    A class's rows are as wide as its fullest row. One loop a class (at most ``log2(sequence)`` of them),
    none a document.

    Args:
        seq_lens: Integer document lengths [batch, documents]; each row sums to ``sequence``; zero and
            negative entries are absent documents.
        sequence: The packed rows' width.
        narrowest: Narrowest class (a power of two).

    Returns:
        One ``ClassRows`` a class present, narrowest first, new tensors on ``seq_lens.device``; together
        their sources cover every caller token exactly once.
    """
    lengths = seq_lens.long().clamp_min(0)
    row_starts = torch.arange(seq_lens.shape[0], device=seq_lens.device).unsqueeze(1) * sequence
    starts = lengths.cumsum(1) - lengths + row_starts
    present = lengths > 0
    lengths, starts = lengths[present], starts[present]
    widths = class_widths(lengths, sequence, narrowest)
    laid_out = []
    for width in torch.unique(widths).tolist():
        members = widths == width
        laid_out.append(_class_rows(lengths[members], starts[members], width))
    return laid_out


def _class_rows(lengths: torch.Tensor, starts: torch.Tensor, width: int) -> ClassRows:
    """``ClassRows`` of one class's documents ``lengths`` [n] starting at flat caller tokens ``starts`` [n]."""
    offsets = lengths.cumsum(0) - lengths
    rows = torch.div(offsets, max(1, width // 2), rounding_mode="floor")
    rows = torch.unique_consecutive(rows, return_inverse=True)[1]  # no empty rows
    count = int(rows[-1]) + 1
    first = torch.full((count,), offsets.numel(), dtype=torch.long, device=lengths.device)
    first = first.scatter_reduce(0, rows, torch.arange(offsets.numel(), device=lengths.device), "amin")
    columns = offsets - offsets[first][rows]
    filled = torch.zeros(count, dtype=torch.long, device=lengths.device).index_add_(0, rows, lengths)
    row_width = int(filled.max())
    # Token level: slot rows * row_width + column + j holds caller token start + j, j < length.
    tokens = int(lengths.sum())
    document = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    within = torch.arange(tokens, device=lengths.device) - offsets[document]
    source = torch.full((count * row_width,), -1, dtype=torch.long, device=lengths.device)
    source[(rows * row_width + columns)[document] + within] = starts[document] + within
    # Documents a row, in order, then the trailing padding.
    slot = torch.arange(lengths.numel(), device=lengths.device) - first[rows]
    per_row = int((slot.max() + 1).item()) if lengths.numel() else 0
    seq_lens = torch.zeros(count, per_row + 1, dtype=torch.long, device=lengths.device)
    seq_lens[rows, slot] = lengths
    seq_lens[:, -1] = row_width - filled
    return ClassRows(source=source.view(count, row_width), seq_lens=seq_lens)


__all__ = ["ClassRows", "class_widths", "dense_forward_seconds", "length_class_rows", "relaying_pays"]
