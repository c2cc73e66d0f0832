"""The frozen V4.1 indexer on packed rows: banded scores and segmented selection.

nemo_automodel 0.7.0's ``_Indexer.forward`` scores every local query against every global
compressed key (``[batch, local_sequence, global_compressed]`` scores, the boolean ``allowed``
mask of the same shape and, on the torch path, an einsum intermediate ``index_n_heads`` times
larger), although on a packed row a query reads only keys of its own document. With N equal
documents all but 1/N of that work and memory is thrown away.

``PackedIndexer`` keeps upstream's forward and changes only what it is given:

1. **Keys.** Upstream's forward, run on the first query alone, produces the layer's index keys
   (compressed, quantised, gathered over CP when the layer owns them); its scores are dropped.
2. **Bands.** ``indexer_bands`` cuts the local queries into tiles (at most ``MAX_TILES``) and gives
   each tile the interval of global compressed keys its queries can see: from the first key of
   its earliest document to its causal end. One host read per layer, whatever the documents.
3. **Scores and selection per band.** Upstream's forward runs on the tiles stacked as its batch
   rows, each against its own band of keys (TileLang ``indexer_scores`` on CUDA, the torch path on
   CPU: the same code, so the same scores where they are read), positions shifted by the band's
   start, and selects with ``selection.segmented_select`` (vectorised over documents, ties to the
   lower index). Tiles are stacked while their pairs stay within ``band_elements``: a row of short
   documents is one call per layer, so the kernels launched do not grow with the tiles either.

Candidate blocks of a candidate-source layer stay per band (``BandedCandidates``) and are read by
the later layers on the same bands: nothing of width ``global_compressed`` per query is kept. One
long document scores at most what it did, ``band_elements`` pairs (or one tile) at a time; rows where a
document's keys are not one contiguous run (never for the plugin's layouts) use one band over the
whole row. Unpacked input (``packed_seq_ids=None``) runs upstream's forward unchanged.

``install_packed_indexer(model)`` swaps the class of every indexer instance of a built target; the
plugin calls it when it builds or wraps a target, never at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention

from nemo_automodel_ext.models.deepseek_v41.selection import segmented_select

#: Query tiles per indexer layer at most.
MAX_TILES = 32
#: Queries per tile at least (rows of up to MIN_TILE queries are one tile).
MIN_TILE = 256
#: Query-key pairs scored by one call of upstream's forward at most, by device type (tiles are stacked
#: as its batch rows until their bands reach it): at 2^22, BF16 scores of 8 MiB, three boolean masks and
#: the selection's int64 ranking keys. On CPU larger calls were slower (benchmarks/indexer_band.py:
#: 2^22 1.37 s, 2^24 1.99 s at 64k rows). On an H200 they were faster (make gpu-check, docs/gpu_check.md:
#: one ratio-1 layer of a 64k row of 256 documents, 140 ms at 2^22, 48 ms at 2^24, 35 ms at 2^26, peak
#: 1.39 GiB; upstream 308 ms and 60 GiB).
BAND_ELEMENTS_BY_DEVICE = {"cpu": 1 << 22, "cuda": 1 << 26}
#: An int here overrides ``BAND_ELEMENTS_BY_DEVICE`` on every device (the tests and benchmarks set it).
BAND_ELEMENTS: int | None = None


def band_elements(device: torch.device | str) -> int:
    """Query-key pairs one call scores at most on ``device``: ``BAND_ELEMENTS``, else the device type's default."""
    if BAND_ELEMENTS is not None:
        return BAND_ELEMENTS
    return BAND_ELEMENTS_BY_DEVICE.get(torch.device(device).type, BAND_ELEMENTS_BY_DEVICE["cpu"])


State = upstream_attention.DeepseekV41AttentionState


@dataclass(frozen=True)
class IndexerBands:
    """Query tiles of packed rows, the global compressed keys each tile can see, and their groups.

    Attributes:
        tiles: ``(begin, end, low, high)`` per tile: local queries ``[begin, end)`` read only
            global compressed keys ``[low, high)`` (``low == high``: none), for every batch row.
        width: Global compressed keys of the row.
        tile: Queries per tile (the last may hold fewer).
        groups: ``(first, last, keys)``: tiles ``[first, last)`` are scored in one call as batch
            rows, each against ``keys`` keys from its ``low`` (``BAND_ELEMENTS`` pairs at most,
            or one tile).
        lows, highs: ``low`` and ``high`` of every tile, int64 [tiles] on the device (not compared).
    """

    tiles: tuple[tuple[int, int, int, int], ...]
    width: int
    tile: int
    groups: tuple[tuple[int, int, int], ...]
    lows: torch.Tensor = field(compare=False, repr=False)
    highs: torch.Tensor = field(compare=False, repr=False)

    @property
    def scored(self) -> int:
        """Query-key pairs scored per batch row: tiles x queries per tile x their group's band keys."""
        return sum((last - first) * self.tile * keys for first, last, keys in self.groups)


@dataclass(frozen=True)
class BandedCandidates:
    """A candidate-source layer's chosen keys, per group of bands (upstream keeps one dense mask).

    Attributes:
        bands: The bands the masks belong to.
        masks: Per group, bool ``[tiles x batch, tile, keys]``: row ``t x batch + b`` holds batch
            row ``b``'s queries of the group's tile ``t``, against the keys from that tile's ``low``.
    """

    bands: IndexerBands
    masks: tuple[torch.Tensor, ...]

    def dense(self) -> torch.Tensor:
        """Upstream's layout: new bool ``[batch, local_sequence, global_compressed]``."""
        bands = self.bands
        batch = self.masks[0].shape[0] // (bands.groups[0][1] - bands.groups[0][0])
        out = torch.zeros(batch, bands.tiles[-1][1], bands.width, dtype=torch.bool, device=self.masks[0].device)
        for (first, last, _), mask in zip(bands.groups, self.masks):
            for index in range(first, last):
                begin, end, low, high = bands.tiles[index]
                rows = mask[(index - first) * batch : (index - first + 1) * batch]
                out[:, begin:end, low:high] = rows[:, : end - begin, : high - low]
        return out


def _groups(tiles: tuple[tuple[int, int, int, int], ...], tile: int, budget: int) -> tuple[tuple[int, int, int], ...]:
    """Consecutive tiles stacked while ``tiles x tile x widest band`` stays within ``budget`` (``band_elements``)."""
    groups, first, keys = [], 0, 0
    for index, (_, _, low, high) in enumerate(tiles):
        widest = max(keys, high - low)
        if index > first and (index - first + 1) * tile * widest > budget:
            groups.append((first, index, keys))
            first, widest = index, high - low
        keys = widest
    groups.append((first, len(tiles), keys))
    return tuple(groups)


def indexer_bands(
    position_ids: torch.Tensor,
    sequence_ids: torch.Tensor,
    compressed_seq_ids: torch.Tensor,
    *,
    compression_ratio: int,
    tile: int | None = None,
) -> IndexerBands:
    """Tiles of local queries and the band of compressed keys each can see (one host read).

    A query at physical position ``p`` of document ``d`` sees ``d``'s compressed keys below
    ``(p + 1) // compression_ratio``. Documents start on compression-group boundaries, so when
    each document's keys are one run, they begin at the run's start: a tile's band runs from the
    earliest such start to the latest causal end among its queries.

    Args:
        position_ids: Physical global positions of the local queries [batch or 1, local_sequence].
        sequence_ids: Document ids of the local queries [batch, local_sequence], 0 for padding.
        compressed_seq_ids: Document ids of the global compressed keys [batch, global_compressed].
        compression_ratio: Tokens per compressed key.
        tile: Queries per tile (default: ``max(MIN_TILE, ceil(local_sequence / MAX_TILES))``).

    Returns:
        ``IndexerBands``; one band over every key when a document id labels two runs of keys.
    """
    batch, queries = sequence_ids.shape
    width = compressed_seq_ids.shape[1]
    device = sequence_ids.device
    tile = min(tile or max(MIN_TILE, -(-queries // MAX_TILES)), queries)
    count = -(-queries // tile)

    def whole_row() -> IndexerBands:
        tiles = ((0, queries, 0, width),)
        ends = torch.tensor([0, width], device=device)
        return IndexerBands(tiles, width, queries, ((0, 1, width),), ends[:1], ends[1:])

    if count == 1 or width == 0:
        return whole_row()
    keys = compressed_seq_ids.long()
    columns = torch.arange(width, device=device).expand(batch, -1)
    starts = keys != F.pad(keys[:, :-1], (1, 0), value=-1)
    run_start = columns.where(starts, 0).cummax(dim=1).values
    # Each nonzero id labels one run when the ids of successive runs increase.
    labelled = starts & (keys > 0)
    highest = keys.where(labelled, 0).cummax(dim=1).values
    one_run = (~labelled | (keys > F.pad(highest[:, :-1], (1, 0), value=0))).all()
    high = ((position_ids.expand(batch, -1) + 1) // compression_ratio).clamp(0, width)
    last = (high - 1).clamp_min(0)
    sees = (sequence_ids > 0) & (high > 0) & (keys.gather(1, last) == sequence_ids)
    low = run_start.gather(1, last)
    pad = count * tile - queries
    low = F.pad(low.where(sees, width), (0, pad), value=width).view(batch, count, tile).amin(dim=(0, 2))
    high = F.pad(high.where(sees, 0), (0, pad), value=0).view(batch, count, tile).amax(dim=(0, 2))
    empty = low >= high
    low, high = low.masked_fill(empty, 0), high.masked_fill(empty, 0)
    values = torch.cat([low, high, one_run.view(1).long()]).tolist()
    if not values[-1]:
        return whole_row()
    tiles = tuple(
        (index * tile, min((index + 1) * tile, queries), values[index], values[count + index]) for index in range(count)
    )
    return IndexerBands(tiles, width, tile, _groups(tiles, tile, band_elements(device)), low, high)


class _UpstreamView:
    """Upstream's indexer forward run on ``layer`` with its own keys switch and selection.

    Every attribute but ``owns_keys`` and ``_select_packed`` is the layer's (weights included).
    """

    def __init__(self, layer: nn.Module, owns_keys: bool, select: Callable[..., State]) -> None:
        self._layer = layer
        self.owns_keys = owns_keys
        self._select_packed = select

    def __getattr__(self, name: str):
        return getattr(self._layer, name)

    def forward(self, *args, **kwargs) -> State:
        return upstream_attention._Indexer.forward(self, *args, **kwargs)


class PackedIndexer(upstream_attention._Indexer):
    """Upstream's frozen V4.1 indexer; packed rows are scored by band and selected by segment."""

    def _select_packed(self, scores: torch.Tensor, sequence_ids: torch.Tensor, state: State) -> State:
        """``selection.segmented_select`` with this layer's settings; shapes as there."""
        return segmented_select(
            scores,
            sequence_ids,
            state,
            topk=self.topk,
            is_candidate_source=self.is_candidate_source,
            uses_candidates=self.uses_candidates,
            candidate_topk_blocks=self.candidate_topk_blocks,
            candidate_block_size=self.candidate_block_size,
        )

    @torch.no_grad()
    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        query_latent: torch.Tensor,
        latent: torch.Tensor | None,
        angles: torch.Tensor,
        compressed_angles: torch.Tensor,
        state: State,
        position_ids: torch.Tensor | None = None,
        cp_group=None,
        packed_seq_ids: torch.Tensor | None = None,
    ) -> State:
        """Upstream's contract (``_Indexer.forward``); packed rows scored by band.

        Args:
            hidden_states: [batch, local_sequence, hidden].
            query_latent: [batch, local_sequence, q_lora_rank].
            latent: Unrotated compressed KV [batch, local_compressed, head_dim] when this layer
                owns its keys, else None.
            angles: FP32 rotary angles [batch or 1, local_sequence, rotary_pairs].
            compressed_angles: FP32 angles [batch or 1, local_compressed, rotary_pairs].
            state: ``DeepseekV41AttentionState`` with global ``compressed_valid`` and
                ``compressed_seq_ids`` [batch, global_compressed] for packed rows.
            position_ids: Physical global positions [batch, local_sequence] (default 0..).
            cp_group: CP group: local queries, keys gathered over it.
            packed_seq_ids: Document ids [batch, local_sequence], 0 for padding; None: unpacked.

        Returns:
            New state with ``index_keys`` [batch, global_compressed, index_head_dim],
            ``topk_indices`` [batch, local_sequence, min(index_topk, global_compressed)] (global
            key indices ascending, then ``-1``) and, for a candidate source, ``BandedCandidates``.
        """
        arguments = dict(
            latent=latent, compressed_angles=compressed_angles, position_ids=position_ids, cp_group=cp_group
        )
        if packed_seq_ids is None:
            return super().forward(
                hidden_states, query_latent=query_latent, angles=angles, state=state, packed_seq_ids=None, **arguments
            )
        if self.uses_candidates and not isinstance(state.candidates, BandedCandidates):
            raise ValueError("A hierarchical Reindex layer requires candidates from its source layer")
        batch, queries, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(queries, device=hidden_states.device).unsqueeze(0)
        # 1. Keys: upstream's forward on the first query; its selection is not run.
        keyed = _UpstreamView(self, self.owns_keys, lambda scores, ids, keyed_state: keyed_state).forward(
            hidden_states[:, :1],
            query_latent=query_latent[:, :1],
            latent=latent,
            angles=angles[:, :1],
            compressed_angles=compressed_angles,
            state=state,
            position_ids=position_ids[:, :1],
            cp_group=cp_group,
            packed_seq_ids=packed_seq_ids[:, :1],
        )
        keys = keyed.index_keys
        width = keys.shape[1]
        if width == 0:
            return super().forward(
                hidden_states,
                query_latent=query_latent,
                angles=angles,
                state=state,
                packed_seq_ids=packed_seq_ids,
                **arguments,
            )
        # 2. Bands.
        ratio = state.compression_ratio
        bands = indexer_bands(position_ids, packed_seq_ids, state.compressed_seq_ids, compression_ratio=ratio)
        if self.uses_candidates and state.candidates.bands != bands:
            raise ValueError("A hierarchical Reindex layer must read its source's bands (same row layout and ratio)")
        # 3. Upstream's scores and the segmented selection: each group's tiles as batch rows.
        k = min(self.topk, width)
        indices = torch.full((batch, queries, k), -1, dtype=torch.long, device=hidden_states.device)
        masks = []
        band_view = _UpstreamView(self, False, self._select_packed)
        expanded = position_ids.expand(batch, -1)
        for group, (first, last, band_keys) in enumerate(bands.groups):
            count, tile = last - first, bands.tile
            begin, end = bands.tiles[first][0], bands.tiles[last - 1][1]

            def stack(values: torch.Tensor) -> torch.Tensor:
                """[batch or 1, local_sequence, ...] -> [count x batch, tile, ...], tile-major."""
                part = values.expand(batch, *values.shape[1:])[:, begin:end]
                part = torch.cat([part, part.new_zeros(batch, count * tile - part.shape[1], *part.shape[2:])], 1)
                return part.unflatten(1, (count, tile)).transpose(0, 1).flatten(0, 1)

            lows = bands.lows[first:last].repeat_interleave(batch)  # [count x batch]
            offsets = torch.arange(band_keys, device=keys.device)
            columns = (lows.unsqueeze(1) + offsets).clamp_max(width - 1)  # [count x batch, band_keys]
            rows = torch.arange(batch, device=keys.device).repeat(count).unsqueeze(1)
            in_band = offsets < (bands.highs[first:last].repeat_interleave(batch) - lows).unsqueeze(1)
            band = replace(
                state,
                index_keys=keys[rows, columns],
                compressed_valid=state.compressed_valid[rows, columns] & in_band,
                compressed_seq_ids=state.compressed_seq_ids[rows, columns],
                candidates=state.candidates.masks[group] if self.uses_candidates else None,
            )
            selected = band_view.forward(
                stack(hidden_states),
                query_latent=stack(query_latent),
                latent=None,
                angles=stack(angles),
                compressed_angles=compressed_angles,
                state=band,
                position_ids=stack(expanded) - lows.unsqueeze(1) * ratio,
                packed_seq_ids=stack(packed_seq_ids),
            )
            chosen = selected.topk_indices  # [count x batch, tile, <= k], band-relative
            chosen = chosen.where(chosen < 0, chosen + lows.view(-1, 1, 1))
            chosen = chosen.unflatten(0, (count, batch)).transpose(0, 1).flatten(1, 2)[:, : end - begin]
            indices[:, begin:end, : chosen.shape[-1]] = chosen
            masks.append(selected.candidates)
        candidates = BandedCandidates(bands, tuple(masks)) if self.is_candidate_source else state.candidates
        return replace(state, index_keys=keys, topk_indices=indices, candidates=candidates)


def install_packed_indexer(model: nn.Module) -> int:
    """Swap every upstream indexer of a built V4.1 target to ``PackedIndexer`` (idempotent).

    Args:
        model: A built target (``DeepseekV41ForCausalLM`` or a module holding one); changed in place.

    Returns:
        The number of indexers that are ``PackedIndexer`` after the call.
    """
    installed = 0
    for module in model.modules():
        if type(module) is upstream_attention._Indexer:
            module.__class__ = PackedIndexer
        installed += isinstance(module, PackedIndexer)
    return installed


__all__ = ["BandedCandidates", "IndexerBands", "PackedIndexer", "indexer_bands", "install_packed_indexer"]
