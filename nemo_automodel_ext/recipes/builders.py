"""What only the packed V4.1 DSpark recipe builds: the frozen target's distributed setup and the memory check.

Loading the target and the draft, which the evaluator shares, is ``run/loading.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from nemo_automodel_ext.run.config import require_target_reshard, section_get


def frozen_target_setup(cfg: Any, world_size: int):
    """Upstream's distributed setup for the frozen target, re-sharding its FSDP2 units after every forward.

    FSDP2 frees a unit's gathered parameters after its forward only when ``reshard_after_forward``
    is set; otherwise it waits for the backward, which a frozen target never runs. AutoModel's
    ``FSDP2Config.reshard_after_forward`` defaults to None, which resolves to the MoE default
    (False) on the EP path, so every rank would keep the unsharded target after the first capture
    (measured on gloo: a tiny target's per-rank parameter elements 19,702 -> 34,784). Here None
    becomes True.

    Args:
        cfg: The recipe config (its ``distributed:`` section).
        world_size: Ranks of the run.

    Returns:
        Upstream's ``DistributedSetup``.

    Raises:
        ValueError: ``distributed.reshard_after_forward: false`` (the frozen target would stay unsharded).
    """
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config

    distributed = cfg.get("distributed", cfg) if hasattr(cfg, "get") else None
    require_target_reshard(section_get(distributed, "reshard_after_forward", None))
    setup = create_distributed_setup_from_config(cfg, world_size=world_size)
    strategy = setup.mesh_context.strategy_config
    if isinstance(strategy, FSDP2Config):
        strategy.reshard_after_forward = True
    return setup


def check_layout_memory(cfg: Any, args: dict[str, Any], path: str, world_size: int, gpu_gib: float) -> None:
    """Refuse, before the target is loaded, a GPU layout the memory model says cannot fit.

    Args:
        cfg: The recipe config; args: validated ``recipe_args``; path: the target checkpoint.
        world_size: Ranks of the run; gpu_gib: memory of one GPU.

    A target whose widths differ from the calibration's (V4.1-Flash) is not checked: the measured bytes do
    not scale to it; a warning says so and names the command that would measure it. Nor is a run whose draft is
    not activation-checkpointed (the calibration's draft step was).

    Raises:
        ValueError: the per-GPU estimate and the nearest layout that fits (``planning/layouts.py``).
    """
    from nemo_automodel_ext.planning.layouts import check_layout_fits, layout_from_config
    from nemo_automodel_ext.planning.memory_model import Calibration, model_counts
    from nemo_automodel_ext.run.loading import target_text_config

    counts = model_counts(target_text_config(path), int(args["num_anchors"]))
    differ = Calibration.shipped().mismatches(counts.widths)
    if differ:
        logging.getLogger(__name__).warning(
            "memory check skipped: the memory model is calibrated at V4.1-Flash widths and this target differs "
            "(%s); benchmarks/memory_calibration.py measures the Flash widths only (docs/scaling.md)",
            differ,
        )
        return
    layout = layout_from_config(cfg, args, world_size, gpu_gib)
    if not layout.draft_recompute:
        logging.getLogger(__name__).warning(
            "memory check skipped: the memory model measured the draft step with full activation checkpointing "
            "and this run has distributed.activation_checkpointing off or selective (docs/scaling.md)"
        )
        return
    check_layout_fits(counts, layout)


__all__ = ["check_layout_memory", "frozen_target_setup"]
