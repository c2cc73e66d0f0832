"""One packed text layout for direct forwards and contiguous context parallelism.

The layout is element-for-element the one that
``nemo_automodel.components.models.deepseek_v41.packing.packed_layout`` builds, so
features captured on it line up with the released V4.1 model, but it is built with
tensor ops only: no Python loop over rows or documents, and one device-to-host read
(the row width, fused with the validation flags). It runs unchanged on CUDA tensors.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

# Upstream marks an absent document with either of these lengths.
ABSENT_LENGTHS = (0, -1000)
_INTEGER_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class PackedSequenceLayout:
    """Compression-aligned packed rows and reversible token coordinates.

    Attributes:
        source_indices: Original token columns [batch, padded_sequence]; -1 marks padding.
        input_positions: Aligned columns [batch, original_sequence]; -1 marks discarded padding.
        position_ids: Document-local RoPE positions [batch, padded_sequence].
        sequence_ids: Document IDs [batch, padded_sequence], starting at one; zero marks padding.
    """

    source_indices: torch.Tensor
    input_positions: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor

    def pack(self, values: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """Insert alignment padding without changing real token order.

        Args:
            values: Tensor of shape [batch, original_sequence, ...], with arbitrary trailing axes.
            fill: Value for padding slots.

        Returns:
            Independent tensor [batch, padded_sequence, ...], preserving gradients of real tokens.
            It is the only tensor of that size allocated; ``values`` is never modified.
        """
        return gather_columns(values, self.source_indices, self.input_positions.shape[1], fill, "values")

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """Restore caller coordinates, returning zeros at original padding slots.

        Args:
            values: Tensor of shape [batch, padded_sequence, ...], with arbitrary trailing axes.

        Returns:
            Independent tensor [batch, original_sequence, ...] retaining real-token gradients.
            It is the only tensor of that size allocated; ``values`` is never modified.
        """
        return gather_columns(values, self.input_positions, self.source_indices.shape[1], 0, "values")


def gather_columns(
    values: torch.Tensor, index: torch.Tensor, expected_columns: int, fill: int | float, name: str
) -> torch.Tensor:
    """Gather ``values[b, index[b, j]]`` into one fresh tensor, writing ``fill`` where ``index`` is -1.

    Args:
        values: Tensor of shape [batch, expected_columns, ...].
        index: Integer tensor of shape [batch, columns]; -1 marks slots without a source.
        expected_columns: Required size of ``values`` along dimension 1.
        fill: Value written at slots whose index is -1.
        name: Argument name used in error messages.

    Returns:
        New tensor [batch, columns, ...] on ``values.device``; gradients flow to gathered entries only.
    """
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    batch, columns = index.shape
    if values.ndim < 2 or values.shape[0] != batch or values.shape[1] != expected_columns:
        raise ValueError(
            f"{name} must have shape [batch={batch}, sequence={expected_columns}, ...], got {tuple(values.shape)}"
        )
    trailing = values.shape[2:]
    index = index.to(values.device, non_blocking=True)
    valid = (index >= 0).view(batch, columns, *([1] * len(trailing)))
    if values.shape[1] == 0 or batch == 0:
        # Nothing to gather from: every slot is padding. The result still hangs off ``values``
        # in autograd (zero gradient), as upstream's gather does, so callers' graphs stay whole.
        padding = values.new_full((batch, columns, *trailing), fill)
        return padding + values.reshape(-1)[:0].sum() if values.requires_grad else padding
    if batch == 1 or values.stride(0) == values.stride(1) * values.shape[1]:
        # Rows merge into one axis without a copy: index_select is the cheapest gather and
        # its backward is a single index_add.
        rows = torch.arange(0, batch * values.shape[1], values.shape[1], device=values.device).unsqueeze(1)
        flat_index = (index.clamp_min(0) + rows).view(-1)
        result = values.flatten(0, 1).index_select(0, flat_index).view(batch, columns, *trailing)
    else:
        rows = torch.arange(batch, device=values.device).unsqueeze(1)
        result = values[rows, index.clamp_min(0)]
    # In place on the fresh gather output: no second full-size allocation, and autograd
    # zeroes the gradient of padding slots.
    if result.device.type == "cpu":
        # A CPU masked_fill_ rewrites every element; filling just the padding rows is ~10x
        # cheaper, and nonzero() costs no device sync here.
        padding = (~valid).view(-1).nonzero().squeeze(1)
        return result.view(batch * columns, *trailing).index_fill_(0, padding, fill).view(result.shape)
    return result.masked_fill_(~valid, fill)


class DocumentBounds(NamedTuple):
    """The document holding each queried column of a packed row (see ``document_bounds``).

    Attributes:
        index: Document slot [batch, n] along the ``seq_lens`` axis; ``documents`` past the last one.
        start: First column [batch, n] of that document.
        end: One past its last column [batch, n]; ``start == end`` past the last document.
    """

    index: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor


def document_bounds(seq_lens: torch.Tensor, columns: torch.Tensor) -> DocumentBounds:
    """Locate the documents of a directly concatenated packed row that hold ``columns``.

    Args:
        seq_lens: Integer lengths [batch, documents] in row order; 0 and -1000 mark absent
            documents, which hold no column and never split their neighbours.
        columns: Integer columns [batch, n] of the caller's row.

    Returns:
        DocumentBounds of new int64 tensors [batch, n] on ``columns.device``. The search is
        ``O(n log documents)``: no [n, documents] table is built. Inputs are not modified.
    """
    lengths = seq_lens.to(device=columns.device, dtype=torch.long)
    real = lengths.where((lengths != ABSENT_LENGTHS[0]) & (lengths != ABSENT_LENGTHS[1]), 0).clamp_min(0)
    ends = real.cumsum(1)
    index = torch.searchsorted(ends, columns.long().contiguous(), right=True)
    if real.shape[1] == 0:
        zero = torch.zeros_like(index)
        return DocumentBounds(index, zero, zero)
    slot = index.clamp(max=real.shape[1] - 1)
    end = ends.gather(1, slot)
    start = end - real.gather(1, slot)
    # Past the last document the clamped slot ends at the row's total: an empty span there.
    return DocumentBounds(index, start.where(index < real.shape[1], end), end)


def _take(owner: torch.Tensor, shape: tuple[int, int], table: torch.Tensor) -> torch.Tensor:
    """Read ``table[owner]`` as a new tensor of ``shape`` (index_select beats advanced indexing)."""
    return table.index_select(0, owner).view(shape)


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _document_matrix(values: object, name: str, batch: int, device: torch.device) -> torch.Tensor:
    """Validate one [batch, documents] (or [documents] for batch one) integer length tensor."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of document lengths, got {type(values).__name__}")
    if values.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{name} must contain integer document lengths (int32 or int64), got {values.dtype}")
    matrix = values.unsqueeze(0) if values.ndim == 1 else values
    if matrix.ndim != 2 or matrix.shape[0] != batch:
        raise ValueError(
            f"{name} must have shape [batch={batch}, documents] (or [documents] when batch is one), "
            f"got {tuple(values.shape)}"
        )
    return matrix.to(device=device, dtype=torch.long)


def round_up(values: torch.Tensor | int, alignment: int) -> torch.Tensor | int:
    """Round lengths up to a multiple of ``alignment``.

    Args:
        values: Integer tensor of any shape, or a Python int; non-negative.
        alignment: Positive multiple.

    Returns:
        New tensor of the same shape (or an int), each entry the least multiple of
        ``alignment`` that is not smaller than the input.
    """
    return (values + (alignment - 1)) // alignment * alignment


@dataclass(frozen=True)
class PackedLayoutPlan:
    """Validated per-document tables of a pack, before the row width is fixed.

    ``packed_layout`` is ``plan_packed_layout(...).build(width)``; callers that must agree on a
    width first (HybridEP's equal token count, a CP budget) read ``widest``, settle the width,
    then build.

    Attributes:
        real: Real lengths [batch, documents], zero for absent documents.
        physical: Physical spans in the caller's row [batch, documents], zero for absent documents.
        aligned: Aligned spans [batch, documents], ``real`` rounded up to ``alignment``.
        input_shape: Original [batch, sequence] dimensions.
        alignment: Positive multiple of every aligned span.
        widest: Widest row's aligned length (host int), without any minimum.
    """

    real: torch.Tensor
    physical: torch.Tensor
    aligned: torch.Tensor
    input_shape: tuple[int, int]
    alignment: int
    widest: int

    def width(self, minimum_length: int = 0) -> int:
        """Row width of the built layout: the widest row, at least ``minimum_length`` and one group."""
        return round_up(max(_as_int(minimum_length, "minimum_length"), 1, self.widest), self.alignment)

    def build(self, width: int) -> PackedSequenceLayout:
        """Materialise the layout with rows of exactly ``width`` columns.

        Args:
            width: Row width, a multiple of ``alignment`` no smaller than ``widest``.

        Returns:
            PackedSequenceLayout with new int64 tensors [batch, width] (and [batch, sequence] for
            ``input_positions``) on the plan's device. No host read happens here.
        """
        width = _as_int(width, "width")
        if width < self.widest or width % self.alignment:
            raise ValueError(
                f"width must be a multiple of alignment={self.alignment} no smaller than the widest row "
                f"({self.widest}), got {width}"
            )
        batch, sequence = self.input_shape
        real, physical, aligned = self.real, self.physical, self.aligned
        documents = real.shape[1]
        device = real.device
        old_ends = physical.cumsum(1)
        row_widths = aligned.sum(1)
        # Per-document tables, with one extra slot per row that owns the row's trailing padding.
        # Flat slot k = row * (documents + 1) + document; the padding slot has no real tokens.
        zero = real.new_zeros(batch, 1)
        used = old_ends[:, -1:] if documents else zero
        new_starts = torch.cat([aligned.cumsum(1) - aligned, row_widths.unsqueeze(1)], 1).view(-1)
        old_starts = torch.cat([old_ends - physical, used], 1).view(-1)
        slot_real = torch.cat([real, zero], 1).view(-1)
        ordinals = torch.arange(1, documents + 1, device=device).expand(batch, documents)
        ordinals = torch.cat([ordinals, zero], 1).view(-1)
        # int32 slot numbers halve the traffic of the per-column owner tables.
        slots = torch.arange(batch * (documents + 1), device=device, dtype=torch.int32)

        # Packed side: every aligned column belongs to exactly one slot.
        repeats = torch.cat([aligned, (width - row_widths).unsqueeze(1)], 1).view(-1)
        take = partial(_take, slots.repeat_interleave(repeats, output_size=batch * width), (batch, width))
        columns = torch.arange(width, device=device)
        padding = columns >= take(new_starts + slot_real)
        position_ids = take(new_starts).neg_().add_(columns).masked_fill_(padding, 0)
        source_indices = take(old_starts - new_starts).add_(columns).masked_fill_(padding, -1)
        sequence_ids = take(ordinals).masked_fill_(padding, 0)

        # Caller side: every original column belongs to one physical span or to the trailing padding.
        repeats = torch.cat([physical, sequence - used], 1).view(-1)
        take = partial(_take, slots.repeat_interleave(repeats, output_size=batch * sequence), (batch, sequence))
        columns = torch.arange(sequence, device=device)
        discarded = columns >= take(old_starts + slot_real)
        input_positions = take(new_starts - old_starts).add_(columns).masked_fill_(discarded, -1)
        return PackedSequenceLayout(source_indices, input_positions, position_ids, sequence_ids)


def plan_packed_layout(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None,
    input_shape: tuple[int, int],
    alignment: int,
) -> PackedLayoutPlan:
    """Validate packed spans and compute aligned document spans, with one device-to-host read.

    Args:
        seq_lens: Integer real document lengths [batch, documents] or [documents] for batch one.
            Zero and -1000 entries denote absent documents.
        seq_lens_padded: Optional integer physical span lengths with the same shape.
        input_shape: Original [batch, sequence] dimensions.
        alignment: Positive multiple for each document's physical span.

    Returns:
        PackedLayoutPlan on seq_lens.device; its tensors are new, caller tensors are never mutated.

    Raises:
        ValueError: as documented by ``packed_layout``.
    """
    alignment = _as_int(alignment, "alignment")
    if alignment < 1:
        raise ValueError(f"alignment must be a positive integer, got {alignment}")
    try:
        batch, sequence = (_as_int(size, "input_shape") for size in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"input_shape must be two integers [batch, sequence], got {input_shape!r}") from None
    if batch < 0 or sequence < 0:
        raise ValueError(f"input_shape must be non-negative [batch, sequence], got {tuple(input_shape)}")
    if not isinstance(seq_lens, torch.Tensor):
        raise ValueError(f"seq_lens must be a torch.Tensor of document lengths, got {type(seq_lens).__name__}")
    device = seq_lens.device
    lengths = _document_matrix(seq_lens, "seq_lens", batch, device)
    if seq_lens_padded is None:
        spans = lengths
    else:
        spans = _document_matrix(seq_lens_padded, "seq_lens_padded", batch, device)
        if spans.shape != lengths.shape:
            raise ValueError(
                f"seq_lens_padded must match seq_lens [batch, documents]={tuple(lengths.shape)}, "
                f"got {tuple(seq_lens_padded.shape)}"
            )

    present = (lengths != ABSENT_LENGTHS[0]) & (lengths != ABSENT_LENGTHS[1])
    real = lengths.where(present, 0)
    physical = spans.where(present, 0)
    aligned = round_up(real, alignment)
    old_ends = physical.cumsum(1)
    row_widths = aligned.sum(1)

    span_absent = (spans == ABSENT_LENGTHS[0]) | (spans == ABSENT_LENGTHS[1])
    # One device-to-host read: the widest row together with the validation flags.
    flags = torch.stack(
        [
            (~present & ~span_absent).any(),
            (present & (lengths < 0)).any(),
            (present & (spans < lengths)).any(),
            (present & (old_ends > sequence)).any(),
        ]
    ).long()
    widest = torch.cat([row_widths, row_widths.new_zeros(1)]).max().unsqueeze(0)
    absent_with_span, negative, short_span, past_row, widest = torch.cat([flags, widest]).tolist()
    if absent_with_span:
        raise ValueError("seq_lens_padded: an absent document (seq_lens 0 or -1000) cannot have a physical span")
    if negative:
        raise ValueError("seq_lens must not contain negative lengths other than the absent marker -1000")
    if short_span:
        raise ValueError("seq_lens_padded must be at least seq_lens for every present document")
    if past_row:
        raise ValueError(
            f"seq_lens{'_padded' if seq_lens_padded is not None else ''} spans exceed the input row of "
            f"{sequence} tokens (input_shape[1])"
        )
    return PackedLayoutPlan(real, physical, aligned, (batch, sequence), alignment, widest)


def packed_layout(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None,
    input_shape: tuple[int, int],
    alignment: int,
    minimum_length: int = 0,
) -> PackedSequenceLayout:
    """Validate packed spans and align document starts for compression groups.

    Args:
        seq_lens: Integer real document lengths [batch, documents] or [documents] for batch one.
            Zero and -1000 entries denote absent documents.
        seq_lens_padded: Optional integer physical span lengths with the same shape. These include
            existing per-document padding; omitted means documents are directly concatenated.
        input_shape: Original [batch, sequence] dimensions.
        alignment: Positive multiple for each document's physical span.
        minimum_length: Minimum aligned row length, used to retain a fixed pack budget.

    Returns:
        Layout whose tensor fields are documented by PackedSequenceLayout, on seq_lens.device.
        All four are new int64 tensors; metadata and caller tensors are never mutated.

    Raises:
        ValueError: naming the argument and the rule, for a non-positive alignment, non-integer
            lengths, mismatched shapes, negative lengths, a span shorter than its length, spans
            past the row, or an absent document with a physical span.
    """
    plan = plan_packed_layout(seq_lens, seq_lens_padded, input_shape, alignment)
    return plan.build(plan.width(minimum_length))


__all__ = [
    "ABSENT_LENGTHS",
    "DocumentBounds",
    "PackedLayoutPlan",
    "PackedSequenceLayout",
    "document_bounds",
    "gather_columns",
    "packed_layout",
    "plan_packed_layout",
    "round_up",
]
