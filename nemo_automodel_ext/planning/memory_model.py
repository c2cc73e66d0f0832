"""Per-GPU memory and per-step communication of packed DSpark on a V4.1 target, calibrated by measurement.

``estimate(counts, layout)`` gives, per GPU and per micro-batch, the peak of a step: what every phase
holds (the frozen target's shards, the draft's sharded parameters, gradients and AdamW state, a
deferred sync's unsharded gradients, a runtime reserve) plus the largest of the phases' own bytes:

- capture: the target's FSDP units gathered during its forward, and the capture's activations;
- the draft step, as the timeline its calibration measured: three windows, each holding the captured
  features (CP-native: shard + halos), the root unit FSDP2 keeps gathered, and only what is alive in it:

  - draft forward: the forward's activations (measured), two gathered layers and the expert dispatch;
  - draft loss: the activations, logits and loss gradients at the head (measured; no layer is gathered);
  - draft layers backward: the recompute's and backward's activations (measured), two gathered layers, one
    layer's unsharded gradients and their fp32 reduce-scatter input, and the expert dispatch;
- optimizer step: AdamW's transient bytes.

Activation, gradient and optimizer bytes are the coefficients of ``calibration.json``: fits to bytes
counted while upstream's modules and the plugin's capture and draft step ran at V4.1-Flash widths
(``planning/calibration.py``, ``benchmarks/memory_calibration.py``). FSDP2's buffers and the resident
shards come from parameter counts and FSDP2's code path. ``docs/scaling.md`` holds the tables
(``benchmarks/memory_model.py``).

Parameter counts come from ``counts.py`` (``model_counts``), which ``calibration.py`` reads too; a recipe's
layout, the layouts near one and the recipe's refusal (``check_layout_fits``, run before anything is loaded)
are in ``layouts.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nemo_automodel_ext.planning.counts import (  # noqa: F401  (re-exported: the model's public names)
    GIB,
    ModelCounts,
    engram_block_parameters,
    engram_table_parameters,
    model_counts,
    routed_expert_parameters,
)

BF16 = 2
FP32 = 4
RUNTIME_RESERVE_GIB = 6.0  # CUDA context, NCCL and HybridEP buffers, allocator fragmentation
CAPACITY_FRACTION = 0.92  # usable share of a GPU's memory after the reserve


@dataclass(frozen=True)
class Layout:
    """One run's parallel layout and batch.

    Attributes:
        gpus: Ranks of the run (nodes x GPUs per node).
        gpu_gib: Memory of one GPU.
        ep: Expert-parallel size of the target (divides ``gpus``).
        cp: Context-parallel size.
        rows: Packed rows per micro-batch and rank.
        row_tokens: Tokens per packed row (``packed_sequence_size``).
        anchors_per_row: The row's anchor cap (``max_anchors_per_row``).
        strategy: Draft data parallelism, ``fsdp2`` or ``ddp``.
        cp_native: The draft trains each CP rank's anchors (True) or every rank gathers the
            pack's features and trains every anchor (False: the plugin before CP-native).
        grad_accumulation: Micro-batches per optimizer step.
        defer_grad_sync: FSDP2 skips the reduce-scatter until the last micro-batch
            (``distributed.defer_fsdp_grad_sync``), holding unsharded fp32 gradients until then.
        draft_ep: Ranks the draft's routed experts are spread over (``recipe_args.draft_ep_size``;
            FSDP2 only): each rank gathers experts / draft_ep of a layer.
        draft_ep_dispatch: How the draft's tokens reach their experts' ranks
            (``recipe_args.draft_ep_dispatcher``): ``all_to_all`` sends each routed pair to its
            expert's rank and back; ``all_gather`` (upstream's) gathers the group's tokens and
            all-reduces the fp32 output.
        draft_recompute: The draft's layers are fully activation-checkpointed
            (``distributed.activation_checkpointing: true``), their MoE included (EP is applied first): each
            layer's forward, its expert all-to-all with it, runs again in backward. The calibration measured the
            draft step so, and ``estimate`` refuses False (off, or upstream's ``selective``).
    """

    gpus: int
    gpu_gib: float
    ep: int
    cp: int
    rows: int
    row_tokens: int
    anchors_per_row: int
    strategy: str = "fsdp2"
    cp_native: bool = True
    grad_accumulation: int = 1
    defer_grad_sync: bool = False
    draft_ep: int = 1
    draft_ep_dispatch: str = "all_to_all"
    draft_recompute: bool = True


@dataclass(frozen=True)
class Calibration:
    """Measured bytes the model scales (``planning/calibration.json``; see ``planning/calibration.py``).

    Attributes:
        capture: ``(a, b, c)``: a capture's peak is ``a + b x local tokens + c x local tokens x row tokens``
            a row.
        captured: Bytes a captured column hands to the draft (features and last hidden state).
        draft_windows: ``(a, b, c)`` by window of the draft step's timeline (``calibration.DRAFT_WINDOWS``:
            forward, loss, layers backward): the window's peak is ``a + b x anchors + c x feature columns``.
        draft_gradients: Gradient bytes per trainable draft parameter.
        optimizer_state: AdamW state bytes per trainable parameter (bf16 moments).
        optimizer_transient: Bytes per trainable parameter alive during AdamW's step beyond its state.
        widths: The config widths measured; the model refuses other widths.
        moe_pair: Bytes a routed pair adds to one target MoE block's peak (``calibration.measure_moe``).
        engram: ``(a, b)``: one Engram block's peak above its input is ``a + b x tokens``
            (``calibration.measure_engram``).
    """

    capture: tuple[float, float, float]
    captured: float
    draft_gradients: float
    optimizer_state: float
    optimizer_transient: float
    widths: dict[str, int]
    draft_windows: dict[str, tuple[float, float, float]]
    moe_pair: float = 0.0
    engram: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def shipped(cls) -> Calibration:
        """The calibration shipped with the package."""
        from nemo_automodel_ext.planning.calibration import DRAFT_WINDOWS, load_calibration

        record = load_calibration()
        coefficients = record["coefficients"]
        return cls(
            capture=tuple(coefficients["capture"]),
            captured=coefficients["captured"][1],
            draft_gradients=coefficients["draft_gradients"][0],
            optimizer_state=coefficients["optimizer_state"][0],
            optimizer_transient=coefficients["optimizer_transient"][0],
            widths=dict(record["widths"]),
            draft_windows={window: tuple(coefficients[f"draft {window}"]) for window in DRAFT_WINDOWS},
            moe_pair=coefficients["moe_pair"][0],
            engram=tuple(coefficients["engram"]),
        )

    def mismatches(self, widths: dict[str, int]) -> str:
        """The widths of ``widths`` that differ from the measured ones, listed (empty when none does)."""
        differ = {key: (widths.get(key), value) for key, value in self.widths.items() if widths.get(key) != value}
        return ", ".join(f"{key} {got} (calibrated {want})" for key, (got, want) in sorted(differ.items()))

    def require(self, widths: dict[str, int]) -> None:
        """Refuse ``widths`` other than the measured ones (activation bytes scale with them)."""
        listed = self.mismatches(widths)
        if listed:
            raise ValueError(
                f"the memory model is calibrated at V4.1-Flash widths; this target differs: {listed}; "
                "measure it with `python benchmarks/memory_calibration.py` (docs/scaling.md)"
            )


@dataclass(frozen=True)
class Estimate:
    """Per-GPU bytes held at the peak of a micro-batch and bytes sent per micro-batch.

    Attributes:
        memory: Named parts (bytes) whose sum is the peak estimate: what every phase holds plus the
            peak phase's own parts.
        traffic: Named bytes one GPU sends per micro-batch.
        layout: The layout estimated.
        phases: Each phase's own parts (bytes), by phase.
        peak_phase: The phase whose parts are in ``memory``.
        groups: The ranks each traffic entry crosses: ``world`` (FSDP over every rank), ``ep`` (the
            target's EP group), ``cp`` (a CP group) or ``draft_ep`` (a draft expert group).
        imbalance: By phase, the bytes a GPU holds beyond the phase's total when the busiest rank of an
            expert group computes twice its balanced share of routed pairs (+100% load): the capture's MoE
            block at the measured bytes a pair, a draft layer's dispatch buffers and MoE block. An upper
            bound: the whole block's per-token bytes are charged to pairs. The totals assume balanced routing.
        engram_block: Bytes alive at an Engram block's peak in the capture (0 without Engram): the block's
            measured transients, its bf16 residual input and the row-owner lookup's exchange buffers. The
            capture phase holds ``max(0, engram_block - capture activations)`` beyond its measured activations.
    """

    memory: dict[str, float]
    traffic: dict[str, float]
    layout: Layout
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_phase: str = ""
    groups: dict[str, str] = field(default_factory=dict)
    imbalance: dict[str, float] = field(default_factory=dict)
    engram_block: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def usable(self) -> float:
        return self.layout.gpu_gib * GIB * CAPACITY_FRACTION

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def headroom(self) -> float:
        """Usable bytes left (negative when the layout does not fit)."""
        return self.usable - self.total

    def imbalance_tolerance(self) -> float:
        """The largest extra load on a group's busiest rank that still fits, as a fraction of its balanced
        pairs (1.0: +100%), by the phase that runs out first; ``inf`` when no phase grows with it."""
        room = [(self.usable - self.phase_total(phase)) / extra for phase, extra in self.imbalance.items() if extra > 0]
        return max(0.0, min(room)) if room else math.inf

    def phase_total(self, phase: str) -> float:
        """Bytes a GPU holds during ``phase``: every phase's resident parts plus the phase's own."""
        own = self.phases[self.peak_phase]
        return self.total - sum(own.values()) + sum(self.phases[phase].values())


def indexer_bytes(
    rows: int, row_tokens: int, cp: int, ratio: int, document_tokens: int | None = None, banded: bool = True
) -> float:
    """Peak bytes of one V4.1 indexer layer on packed rows, per GPU.

    Per query-key pair scored at once: BF16 scores and three boolean masks (causal, document, their
    conjunction ``allowed``), 5 bytes; plus the candidate source's boolean candidates, kept for the
    later layers (1 byte a pair).

    - upstream (``banded=False``): every local query against every global compressed key at once;
    - plugin (``packed_indexer.py``): one tile of ``max(MIN_TILE, local / MAX_TILES)`` queries at a
      time against its band (the keys from the first document the tile touches to its causal end:
      the tile plus one document, all keys at most), the selection's int64 ranking keys
      (``selection.CHUNK_ELEMENTS`` at most), and candidates per band.

    Args:
        rows: Rows of a micro-batch.
        row_tokens: Tokens of a row.
        cp: Context-parallel ranks (local queries: ``row_tokens / cp`` a row).
        ratio: Compression ratio of the indexer's keys (the finest: most keys).
        document_tokens: Tokens of a document; None: one document fills the row (the widest bands).
        banded: The plugin's banded indexer (True) or upstream's whole-row one.

    Returns:
        Bytes.
    """
    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import MAX_TILES, MIN_TILE
    from nemo_automodel_ext.models.deepseek_v41.selection import CHUNK_ELEMENTS

    local, keys = row_tokens / cp, row_tokens / ratio
    if not banded:
        return rows * 6 * local * keys
    tile = min(local, max(MIN_TILE, math.ceil(local / MAX_TILES)))
    band = min(keys, (tile + (row_tokens if document_tokens is None else document_tokens)) / ratio)
    return rows * (5 * tile * band + local * band) + 8 * min(CHUNK_ELEMENTS, rows * tile * band)


def draft_ep_passes(layout: Layout) -> int:
    """Times a draft layer's tokens cross its expert-parallel group a step: forward, backward, and the forward
    again in backward when the layer is checkpointed (``draft_recompute``)."""
    return 3 if layout.draft_recompute else 2


def rank_anchors(layout: Layout) -> int:
    """Anchors a rank trains a row: ``ceil(anchors_per_row / cp)`` under CP-native training, else all of them."""
    return math.ceil(layout.anchors_per_row / layout.cp) if layout.cp_native else layout.anchors_per_row


def rank_feature_columns(layout: Layout, widths: dict[str, int]) -> float:
    """Feature columns a rank holds a row: its shard and halos (``window`` before, ``block`` after) under
    CP-native training, else the whole row."""
    if layout.cp_native and layout.cp > 1:
        return layout.row_tokens / layout.cp + widths["window"] + widths["block"]
    return layout.row_tokens


def engram_block_bytes(counts: ModelCounts, calibration: Calibration, tokens: float) -> float:
    """Bytes alive at an Engram block's peak on ``tokens`` local tokens (0 without Engram).

    The block's measured transients (``Calibration.engram``), its bf16 residual input [tokens, hc_mult, hidden]
    and the row-owner lookup's fixed-capacity exchange at balanced capacity (upstream's ``_exchange_ids`` and
    ``_FixedCapacityAllToAll``): int64 row ids and bf16 rows, each padded out and padded back, then the compact
    and the reordered rows. The calibration's table lives on one rank, so the exchange is counted, not measured.
    """
    if not counts.engram_lookups:
        return 0.0
    a, b = calibration.engram
    lookups = tokens * counts.engram_lookups
    exchange = lookups * (2 * 8 + 4 * BF16 * counts.engram_head_dim)
    return a + b * tokens + BF16 * counts.widths["hc_mult"] * counts.widths["hidden"] * tokens + exchange


def estimate(counts: ModelCounts, layout: Layout, calibration: Calibration | None = None) -> Estimate:
    """Per-GPU peak memory and traffic of ``layout`` (see the module docstring for what is counted).

    Args:
        counts: ``model_counts`` of the target and draft.
        layout: The layout.
        calibration: Measured coefficients (default: the shipped ``Calibration``).

    Returns:
        Estimate with named parts in bytes.

    Raises:
        ValueError: when ``counts`` has widths other than the calibration's.
    """
    calibration = calibration or Calibration.shipped()
    calibration.require(counts.widths)
    if not layout.draft_recompute:
        raise ValueError(
            "the memory model measured the draft step with full activation checkpointing; a layout without it "
            "(distributed.activation_checkpointing off or selective) keeps activations nothing here measured: "
            "set distributed.activation_checkpointing: true"
        )
    w, g = counts.widths, layout.gpus
    local_tokens = layout.rows * layout.row_tokens / layout.cp
    feature_width = (w["feature_layers"] + 1) * w["hidden"]
    gathered_experts = counts.expert_layer / layout.ep if layout.ep < g else 0
    anchors = rank_anchors(layout)
    feature_columns = rank_feature_columns(layout, w)
    fsdp = layout.strategy == "fsdp2"
    draft_replicas = g if fsdp else 1
    # With draft EP a rank gathers only its group's experts (experts / draft_ep) of a layer.
    ep_share = 1 - 1 / layout.draft_ep
    draft_gathered_layer = counts.draft_layer - counts.draft_layer_experts * ep_share
    draft_tokens = layout.rows * anchors * w["block"]
    deferred = fsdp and layout.defer_grad_sync and layout.grad_accumulation > 1
    all_to_all = layout.draft_ep_dispatch == "all_to_all"
    per_parameter = BF16 + calibration.draft_gradients + calibration.optimizer_state
    memory = {
        "target shards (bf16)": BF16 * counts.target / g,
        # Sharded bf16 parameters and gradients, bf16 AdamW moments (measured); frozen embedding and head.
        "draft params + grads + AdamW": (per_parameter * counts.draft_trainable + BF16 * counts.draft_frozen)
        / draft_replicas,
        # A deferred sync keeps every trainable parameter's unsharded fp32 gradient until the last micro-batch.
        "deferred draft gradients (unsharded fp32)": FP32 * counts.draft_trainable if deferred else 0,
        "runtime reserve": RUNTIME_RESERVE_GIB * GIB,
    }
    capture_a, capture_b, capture_c = calibration.capture

    def draft_window(window: str) -> float:
        a, b, c = calibration.draft_windows[window]
        return a + b * layout.rows * anchors + c * layout.rows * feature_columns

    resident_draft = {  # alive through the whole draft step
        "captured features (measured)": calibration.captured * layout.rows * feature_columns,
        # FSDP2 does not reshard the root unit after forward.
        "draft root unit (FSDP2)": BF16 * counts.draft_root if fsdp else 0,
        # DDP reduces gradients through buckets of their size.
        "DDP gradient buckets": 0 if fsdp else calibration.draft_gradients * counts.draft_trainable,
    }
    # FSDP2, in a layer's forward and backward: this layer's and the prefetched layer's gathered bf16 parameters.
    gathered_layers = 2 * BF16 * draft_gathered_layer if fsdp else 0
    # Draft EP beyond the measured EP 1 step. All-to-all (routing balanced): the pairs sent, received and returned
    # [tokens x topk, hidden] in bf16, their fp32 expert output, the fp32 combine. Upstream's all-gather: the other
    # members' tokens [(draft_ep - 1) x tokens, hidden] in bf16, the fp32 output all-reduced and its gradient.
    dispatch_buffers = (
        (
            draft_tokens * w["hidden"] * (w["draft_topk"] * (3 * BF16 + FP32) + FP32)
            if all_to_all
            else (layout.draft_ep - 1) * draft_tokens * w["hidden"] * (BF16 + 2 * FP32)
        )
        if layout.draft_ep > 1
        else 0
    )
    capture_activations = capture_a + capture_b * local_tokens + capture_c * local_tokens * layout.row_tokens
    engram_block = engram_block_bytes(counts, calibration, local_tokens)
    phases = {
        "capture": {
            "target gathered units": 2 * BF16 * (counts.dense_unit + gathered_experts),
            "capture activations (measured)": capture_activations,
            "Engram block beyond the capture's peak (measured)": max(0.0, engram_block - capture_activations),
        },
        "draft forward": {
            **resident_draft,
            "draft forward activations (measured)": draft_window("forward"),
            "draft gathered layers (FSDP2)": gathered_layers,
            "draft EP dispatch buffers": dispatch_buffers,
        },
        "draft loss": {
            **resident_draft,
            "draft activations, logits and loss gradients (measured)": draft_window("loss"),
        },
        "draft layers backward": {
            **resident_draft,
            "draft recompute and backward activations (measured)": draft_window("layers backward"),
            "draft gathered layers (FSDP2)": gathered_layers,
            # ... the layer's unsharded bf16 gradients and their fp32 copy, the reduce-scatter input ...
            "draft layer gradients + fp32 reduce-scatter input (FSDP2)": (BF16 + FP32) * draft_gathered_layer
            if fsdp
            else 0,
            "draft EP dispatch buffers": dispatch_buffers,
        },
        "optimizer step": {
            "AdamW step (measured)": calibration.optimizer_transient * counts.draft_trainable / draft_replicas,
        },
    }
    peak_phase = max(phases, key=lambda phase: sum(phases[phase].values()))
    memory.update(phases[peak_phase])
    peers = (g - 1) / g
    traffic = {
        # Dense units gather over every rank; with EP smaller than the ranks, each expert shard gathers over
        # the g / ep ranks that share its experts.
        "target FSDP all-gather": BF16 * counts.dense / g * (g - 1) + BF16 * counts.experts / g * (g / layout.ep - 1),
        "MoE dispatch + combine": 2
        * BF16
        * local_tokens
        * w["topk"]
        * w["hidden"]
        * counts.moe_layers
        * (layout.ep - 1)
        / layout.ep,
        "target CP (compressed KV + window halo)": BF16
        * layout.rows
        * counts.compressed_layers
        * w["head_dim"]
        * (layout.row_tokens / w["min_ratio"] + w["window"])
        * (layout.cp - 1)
        / layout.cp,
        "draft features (halo or all-gather)": (
            BF16 * layout.rows * (w["window"] * w["feature_layers"] * w["hidden"] + w["block"] * w["hidden"])
            if layout.cp_native
            else BF16 * layout.rows * layout.row_tokens / layout.cp * feature_width * (layout.cp - 1)
        )
        if layout.cp > 1
        else 0,
        # The fp32 reduce-scatter runs every micro-batch, or once a step when deferred. With draft EP the
        # experts gather over the g / draft_ep ranks holding the same experts, the rest over every rank.
        "draft FSDP (gather x2, reduce-scatter fp32)": (2 * BF16 + FP32 / (layout.grad_accumulation if deferred else 1))
        * (
            (counts.draft_trainable - counts.draft_experts) * peers
            + counts.draft_experts / layout.draft_ep * (1 - layout.draft_ep / g)
        )
        if layout.strategy == "fsdp2"
        else 2 * FP32 * counts.draft_trainable * peers,
        # The frozen embedding and head (in the root unit, gathered once a micro-batch and kept: not resharded
        # after forward); the trainable parameters' gathers are counted above, and frozen ones never reduce.
        "draft frozen root gather (FSDP2)": BF16 * counts.draft_frozen * peers if layout.strategy == "fsdp2" else 0,
        # Per draft layer and pass (draft_ep_passes: forward, the checkpointed recompute, backward). All-to-all:
        # each routed pair's bf16 activations to its expert's rank and its output back, (draft_ep - 1) / draft_ep
        # of them leaving the rank (the bytes of a pair counted on gloo:
        # tests/models/deepseek_v41/gloo_expert_dispatch.py; the routing counts and int64 expert ids, 8 bytes a
        # pair, are left out). All-gather: the tokens gathered in bf16 to draft_ep - 1 peers, the fp32 output
        # [draft_ep x tokens, hidden] all-reduced (ring: 2x).
        "draft EP dispatch": draft_ep_passes(layout)
        * w["draft_layers"]
        * draft_tokens
        * w["hidden"]
        * (
            2 * BF16 * w["draft_topk"] * (layout.draft_ep - 1) / layout.draft_ep
            if all_to_all
            else (layout.draft_ep - 1) * (BF16 + 2 * FP32)
        ),
    }
    groups = {name: "world" for name in traffic}
    groups.update(
        {
            "MoE dispatch + combine": "ep",
            "target CP (compressed KV + window halo)": "cp",
            "draft features (halo or all-gather)": "cp",
            "draft EP dispatch": "draft_ep",
        }
    )
    # +100% load on the busiest rank: twice its balanced routed pairs. A capture runs one MoE block at a time
    # (no autograd); a draft layer's forward (and its recompute) holds its dispatch buffers and its MoE block's
    # intermediates, at the target's measured bytes a pair (the draft's experts have the target's widths).
    draft_pairs = calibration.moe_pair * draft_tokens * w["draft_topk"] if layout.draft_ep > 1 else 0.0
    imbalance = {
        "capture": calibration.moe_pair * local_tokens * w["topk"] if layout.ep > 1 else 0.0,
        "draft forward": dispatch_buffers + draft_pairs,
        "draft layers backward": dispatch_buffers + draft_pairs,
    }
    return Estimate(memory, traffic, layout, phases, peak_phase, groups, imbalance, engram_block)


__all__ = [
    "Calibration",
    "Estimate",
    "Layout",
    "ModelCounts",
    "engram_table_parameters",
    "draft_ep_passes",
    "engram_block_bytes",
    "engram_block_parameters",
    "estimate",
    "model_counts",
    "rank_anchors",
    "rank_feature_columns",
    "routed_expert_parameters",
]
