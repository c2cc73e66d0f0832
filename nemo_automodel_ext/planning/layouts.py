"""Layouts of a packed DSpark run, judged by the memory model: a recipe's ``Layout``, the layouts near one,
and the recipe's refusal of a layout that does not fit (``check_layout_fits``, run before anything is loaded).

``memory_model.estimate`` says what a layout holds and sends; this module chooses and refuses layouts with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from nemo_automodel.recipes._dist_utils import _normalize_activation_checkpointing

from nemo_automodel_ext.planning.counts import GIB, ModelCounts
from nemo_automodel_ext.planning.memory_model import Estimate, Layout, estimate


def candidate_layouts(layout: Layout, experts: int | None = None, draft_experts: int | None = None) -> list[Layout]:
    """Layouts near ``layout``, nearest first: more CP at the same GPUs, then more nodes, then EP; at each,
    the layout's own draft EP first, then the draft's experts spread over 8 ranks (a node), 16, and every
    rank (FSDP2).

    Args:
        layout: The layout to start from.
        experts: Routed experts a target layer; an EP size must divide them (None: any EP size).
        draft_experts: Routed experts a draft layer; a draft EP size must divide them (None: any).
    """
    candidates = []
    for nodes_factor in (1, 2, 4, 8):
        gpus = layout.gpus * nodes_factor
        spreads = (8, 16, gpus) if layout.strategy == "fsdp2" else ()
        draft_eps = [layout.draft_ep] + sorted({d for d in spreads if d > layout.draft_ep})
        for cp in (layout.cp, 2 * layout.cp, 4 * layout.cp, 8 * layout.cp):
            if gpus % cp:
                continue
            sizes = {layout.ep * nodes_factor, gpus, layout.ep}
            sizes |= {ep // 2 for ep in sizes}
            for ep in sorted(sizes, reverse=True):
                if not (ep <= gpus and gpus % ep == 0 and (experts is None or experts % ep == 0)):
                    continue
                for draft_ep in draft_eps:
                    if gpus % draft_ep == 0 and (draft_experts is None or draft_experts % draft_ep == 0):
                        candidates.append(replace(layout, gpus=gpus, cp=cp, ep=ep, draft_ep=draft_ep))
    return candidates


def nearest_fitting(counts: ModelCounts, layout: Layout, margin: float = 0.1) -> Estimate | None:
    """The first of ``candidate_layouts`` that fits with ``margin`` of its usable memory to spare, or None."""
    for candidate in candidate_layouts(layout, counts.routed_experts or None, counts.draft_routed_experts or None):
        fitted = estimate(counts, candidate)
        if fitted.headroom >= margin * fitted.usable:
            return fitted
    return None


def describe(layout: Layout) -> str:
    return (
        f"{layout.gpus} GPUs of {layout.gpu_gib:g} GiB, ep_size={layout.ep}, cp_size={layout.cp}, "
        f"draft_ep_size={layout.draft_ep}" + (f" ({layout.draft_ep_dispatch})" if layout.draft_ep > 1 else "") + ", "
        f"{layout.rows} x {layout.row_tokens} tokens a micro-batch, {layout.anchors_per_row} anchors a row"
    )


def layout_from_config(cfg: Any, args: dict[str, Any], world_size: int, gpu_gib: float) -> Layout:
    """The ``Layout`` of a recipe config.

    Args:
        cfg: The recipe config (its ``distributed:`` section).
        args: Validated ``recipe_args``.
        world_size: Ranks of the run.
        gpu_gib: Memory of one GPU.
    """
    distributed = cfg.get("distributed", None)
    get = (lambda key, default: distributed.get(key, default)) if distributed is not None else (lambda k, d: d)
    row_tokens = int(args["packed_sequence_size"] or args["seq_length"])
    anchors = args["max_anchors_per_row"] or args["num_anchors"]
    return Layout(
        gpus=world_size,
        gpu_gib=gpu_gib,
        ep=int(get("ep_size", 1) or 1),
        cp=int(get("cp_size", 1) or 1),
        draft_ep=int(args.get("draft_ep_size", 1) or 1),
        draft_ep_dispatch=str(args.get("draft_ep_dispatcher", "all_to_all")),
        rows=int(args["micro_batch_size"]),
        row_tokens=row_tokens,
        anchors_per_row=int(anchors),
        strategy=str(get("strategy", "ddp")).lower() if world_size > 1 else "ddp",
        grad_accumulation=int(args["grad_accumulation_steps"]),
        defer_grad_sync=bool(args["defer_fsdp_grad_sync"]),
        # Upstream's reading of the key (its draft checkpointing normalises it so): only full checkpointing
        # (True) is what the calibration measured; "selective" keeps other activations.
        draft_recompute=_normalize_activation_checkpointing(get("activation_checkpointing", False)) is True,
    )


def check_layout_fits(counts: ModelCounts, layout: Layout) -> Estimate:
    """Refuse a layout the model says cannot fit, naming the estimate and the nearest layout that fits.

    Returns:
        The estimate of ``layout`` when it fits.

    Raises:
        ValueError: with the per-GPU estimate, its largest parts and the nearest fitting layout.
    """
    result = estimate(counts, layout)
    if result.fits:
        return result
    parts = sorted(result.memory.items(), key=lambda item: -item[1])[:3]
    biggest = ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts)
    nearest = nearest_fitting(counts, layout)
    suggestion = (
        f"the nearest layout that fits is {describe(nearest.layout)} ({nearest.total / GIB:.1f} GiB a GPU)"
        if nearest is not None
        else "no layout up to 8x the GPUs fits; shorten recipe_args.packed_sequence_size"
    )
    raise ValueError(
        f"this layout needs about {result.total / GIB:.1f} GiB a GPU at its {result.peak_phase} ({biggest} GiB), "
        "more than the "
        f"{result.usable / GIB:.1f} GiB usable of {layout.gpu_gib:g} GiB ({describe(layout)}); {suggestion} "
        "(memory model: docs/scaling.md)"
    )


__all__ = ["candidate_layouts", "check_layout_fits", "describe", "layout_from_config", "nearest_fitting"]
