"""Step time and tokens/s a GPU of a packed DSpark layout: FLOPs and bytes per link, on stated GPU presets.

``step_time(counts, layout, gpu)`` divides one micro-batch's FLOPs per GPU by the GPU's dense bf16 peak at a
model FLOPs utilisation (the target's forward at an assumed ``MFU``; the draft step at ``DRAFT_MFU``, measured
on an H200 by ``make gpu-check``), and each of ``memory_model.estimate``'s traffic entries by the bandwidth of
the link it crosses (NVLink inside a node, the network between nodes). Three times come out, each a bound:

- ``step_s``, no overlap: compute, then every transfer (the bound layouts are chosen by, since nothing in the
  plugin schedules the target's expert gathers under compute: FSDP2's implicit forward prefetch may hide them,
  which no test here shows);
- ``overlapped_s``: the longer of compute and communication (full overlap: the best case);
- ``network_s``: the transfers over the network alone (no layout runs faster than its network allows).

``gather_budget`` puts one target layer's FSDP all-gather beside one layer's compute: the overlap is possible
only where the gather is the shorter. ``fastest_fitting`` searches EP and CP sizes for the layout with the most
real tokens a second a GPU (no overlap) among those that fit with 10% to spare.

FLOPs (``micro_batch_flops``), counted as multiply-adds x 2:

- target forward (no grad), per local token: every matrix a token meets (``ModelCounts.target_active``),
  sparse attention over ``sliding_window`` keys plus ``index_topk`` compressed keys in compressed layers
  (QK and PV: 4 x heads x head_dim a key), and the indexer's scores over every visible compressed key of the
  query's own document in each index-source layer (2 x index_heads x index_head_dim a key; ``documents``
  gives a micro-batch's document lengths, else one document fills the row, as the memory model counts);
- draft step, per draft token (anchors x block): the layers' active matrices 8 times (forward 2, backward 4,
  the checkpointed recompute 2), the frozen head 4 (forward and its input gradient), windowed attention over
  ``window + block`` keys 4 times; per feature column, the projection 4 (forward and weight gradient).

``tests/planning/test_step_time.py`` pins the non-expert target FLOPs and the draft step's to
``torch.utils.flop_counter`` on the calibration models. The presets' peaks and bandwidths are vendor numbers;
``MFU`` is an assumption until the target's kernels (TileLang, Transformer Engine, HybridEP) are timed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from nemo_automodel_ext.planning.memory_model import (
    Estimate,
    Layout,
    ModelCounts,
    estimate,
    rank_anchors,
    rank_feature_columns,
)

MFU = 0.40  # assumed share of the dense bf16 peak the target's forward reaches (not measured)
# Measured: the Flash draft step (3 layers, block 5, SDPA, upstream's torch experts) at 512 anchors and 16k
# tokens on an H200 ran 33.9 TFLOP in 669 ms, 50.7 TFLOP/s (docs/gpu_check.md, make gpu-check at b9f6ca8).
DRAFT_MFU = 0.051
FIT_MARGIN = 0.10  # fraction of usable memory a layout keeps spare


@dataclass(frozen=True)
class GPU:
    """A GPU preset.

    Attributes:
        name: Label.
        memory_gib: Memory the layout may use (``Layout.gpu_gib``).
        bf16_tflops: Dense bf16 peak, TFLOP/s.
        nvlink_gbs: NVLink bandwidth a GPU, one direction, GB/s.
        network_gbs: Network bandwidth a GPU between nodes, one direction, GB/s.
        per_node: GPUs a node.
    """

    name: str
    memory_gib: float
    bf16_tflops: float
    nvlink_gbs: float
    network_gbs: float
    per_node: int = 8


GPUS = {
    "H100": GPU("H100 SXM 80 GB", 80, 989, 450, 50),
    "H200": GPU("H200 SXM 141 GB", 141, 989, 450, 50),
    "B200": GPU("B200 192 GB", 178, 2250, 900, 100),
}


@dataclass(frozen=True)
class StepTime:
    """One micro-batch on one GPU.

    Attributes:
        flops: FLOPs by part.
        seconds: Seconds by part (compute, then each traffic entry on its link).
        memory: The layout's memory estimate.
        network: Seconds of each traffic entry's share that crosses the network.
        target_compute_s: Seconds of the target's forward (its part of ``compute``).
        layers: Target layers (``gather_budget`` is per layer).
    """

    flops: dict[str, float]
    seconds: dict[str, float]
    memory: Estimate
    network: dict[str, float]
    target_compute_s: float
    layers: int

    @property
    def compute_s(self) -> float:
        return self.seconds["compute"]

    @property
    def communication_s(self) -> float:
        return sum(value for name, value in self.seconds.items() if name != "compute")

    @property
    def step_s(self) -> float:
        """Seconds a micro-batch takes with no overlap: compute, then every transfer."""
        return self.compute_s + self.communication_s

    @property
    def overlapped_s(self) -> float:
        """Seconds a micro-batch takes with compute and communication fully overlapped (a lower bound)."""
        return max(self.compute_s, self.communication_s)

    @property
    def network_s(self) -> float:
        """Seconds of the micro-batch's transfers over the network alone (a lower bound)."""
        return sum(self.network.values())

    def tokens_per_s(self, seconds: float | None = None) -> float:
        """Packed tokens a second a GPU (a row is shared by its CP group) at ``seconds`` a micro-batch
        (default ``step_s``, no overlap)."""
        layout = self.memory.layout
        return layout.rows * layout.row_tokens / layout.cp / (seconds or self.step_s)

    @property
    def gather_budget(self) -> tuple[float, float]:
        """(seconds of one target layer's FSDP all-gather, seconds of one target layer's compute)."""
        layers = self.layers
        return self.seconds["target FSDP all-gather"] / layers, self.target_compute_s / layers


def mean_prefix(layout: Layout, documents: Sequence[int] | None = None) -> float:
    """Tokens before a row token in its own document, averaged over the micro-batch (d / 2 in a document of d).

    Args:
        layout: The layout (``rows x row_tokens`` tokens a micro-batch).
        documents: Tokens of every document of the micro-batch's rows, a row's padding folded into its
            last document (upstream's packing), summing to ``rows x row_tokens``; None: one document fills
            each row (``row_tokens / 2``, the most).

    Raises:
        ValueError: when ``documents`` has a non-positive entry or does not sum to ``rows x row_tokens``.
    """
    total = layout.rows * layout.row_tokens
    if documents is None:
        return layout.row_tokens / 2
    if any(int(d) < 1 for d in documents) or sum(int(d) for d in documents) != total:
        raise ValueError(
            f"documents must be positive lengths summing to rows x row_tokens = {total}, "
            f"got {len(documents)} summing to {sum(int(d) for d in documents)}"
        )
    return sum(int(d) ** 2 for d in documents) / 2 / total


def micro_batch_flops(
    counts: ModelCounts, layout: Layout, text, documents: Sequence[int] | None = None
) -> dict[str, float]:
    """FLOPs one GPU runs for one micro-batch, by part (see the module docstring).

    Args:
        counts: ``model_counts`` of the target and draft.
        layout: The layout.
        text: The target's ``DeepseekV41TextConfig`` (attention and indexer widths).
        documents: The micro-batch's document lengths (``mean_prefix``): the indexer scores a query against
            its own document's compressed keys only (``packed_indexer.py``); None: one document a row.
    """
    w = counts.widths
    layers = int(text.num_hidden_layers)
    ratios = list(text.compress_ratios[:layers])
    local = layout.rows * layout.row_tokens / layout.cp
    attention_keys = sum(w["window"] + (int(text.index_topk) if ratio else 0) for ratio in ratios)
    # A query p tokens into its document sees p / ratio compressed keys.
    prefix = mean_prefix(layout, documents)
    indexer_keys = sum(prefix / ratios[i] for i in text.index_source_layer_ids if i < layers)
    draft_tokens = layout.rows * rank_anchors(layout) * w["block"]
    columns = layout.rows * rank_feature_columns(layout, w)
    return {
        "target matrices": 2 * counts.target_active * local,
        "target attention": 4 * w["heads"] * w["head_dim"] * attention_keys * local,
        "target indexer": 2 * int(text.index_n_heads) * int(text.index_head_dim) * indexer_keys * local,
        "draft layers": 8 * counts.draft_active * draft_tokens,
        "draft head": 4 * w["vocab"] * w["hidden"] * draft_tokens,
        "draft attention": 4
        * 4
        * w["heads"]
        * w["head_dim"]
        * (w["window"] + w["block"])
        * draft_tokens
        * w["draft_layers"],
        "draft projection": 4 * counts.draft_projection * columns,
    }


def _link(group: str, layout: Layout, gpu: GPU) -> list[tuple[float, float]]:
    """(share of the entry's bytes, GB/s) for a traffic entry crossing ``group`` (``Estimate.groups``)."""
    within = min(gpu.per_node, layout.gpus)
    if group in ("ep", "draft_ep"):  # EP peers: those beyond the node go over the network
        size = layout.ep if group == "ep" else layout.draft_ep
        off = max(0, size - within) / size
        return [(1 - off, gpu.nvlink_gbs), (off, gpu.network_gbs)]
    if group == "cp":  # CP groups are consecutive ranks of a node when they fit one
        return [(1.0, gpu.nvlink_gbs if layout.cp <= gpu.per_node else gpu.network_gbs)]
    # FSDP over every rank: a ring across nodes runs at the network's bandwidth.
    return [(1.0, gpu.nvlink_gbs if layout.gpus <= gpu.per_node else gpu.network_gbs)]


def step_time(counts: ModelCounts, layout: Layout, gpu: GPU, text, documents: Sequence[int] | None = None) -> StepTime:
    """Seconds and tokens/s a GPU of one micro-batch of ``layout`` on ``gpu`` (see the module docstring);
    ``documents`` as in ``micro_batch_flops``."""
    memory = estimate(counts, layout)
    flops = micro_batch_flops(counts, layout, text, documents)
    peak = gpu.bf16_tflops * 1e12
    target = sum(value for name, value in flops.items() if name.startswith("target")) / (peak * MFU)
    draft = sum(value for name, value in flops.items() if name.startswith("draft")) / (peak * DRAFT_MFU)
    seconds = {"compute": target + draft}
    network = {}
    for name, sent in memory.traffic.items():
        link = _link(memory.groups[name], layout, gpu)
        seconds[name] = sum(sent * share / (gbs * 1e9) for share, gbs in link if share)
        network[name] = sum(sent * share / (gbs * 1e9) for share, gbs in link if share and gbs == gpu.network_gbs)
    return StepTime(flops, seconds, memory, network, target, int(text.num_hidden_layers))


def fastest_fitting(counts: ModelCounts, layout: Layout, gpu: GPU, text) -> StepTime | None:
    """The EP, CP and draft EP sizes (same GPUs, rows and anchors) with the most tokens/s a GPU that fit with
    10% to spare; among layouts within a token a second of it (compute-bound layouts tie), the one with the
    least communication time, then the most headroom.

    EP sizes divide both the ranks and the target's routed experts, draft EP sizes the ranks and the
    draft's (FSDP2 only); CP sizes divide the ranks and the row into compression-aligned shards.
    """
    best = None
    divisors = [d for d in range(1, layout.gpus + 1) if layout.gpus % d == 0]
    draft_eps = [d for d in divisors if layout.strategy == "fsdp2" and counts.draft_routed_experts % d == 0] or [1]
    for ep in (e for e in divisors if counts.routed_experts % e == 0):
        for cp in (c for c in (1, 2, 4, 8, 16, 32) if layout.gpus % c == 0 and layout.row_tokens % (c * 128) == 0):
            for draft_ep in draft_eps:
                candidate = replace(layout, ep=ep, cp=cp, draft_ep=draft_ep, gpu_gib=gpu.memory_gib)
                timed = step_time(counts, candidate, gpu, text)
                if timed.memory.headroom < FIT_MARGIN * timed.memory.usable:
                    continue
                if best is None or _preference(timed) > _preference(best):
                    best = timed
    return best


def _preference(timed: StepTime) -> tuple[int, float, float]:
    return round(timed.tokens_per_s()), -timed.communication_s, timed.memory.headroom


__all__ = [
    "DRAFT_MFU",
    "GPU",
    "GPUS",
    "MFU",
    "StepTime",
    "fastest_fitting",
    "mean_prefix",
    "micro_batch_flops",
    "step_time",
]
