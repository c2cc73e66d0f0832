"""Data and expert parallelism of the packed V4.1 DSpark recipe's trainable draft.

Under context parallelism the draft is CP-native (``models/deepseek_v41/cp_trainer.py``): every
rank trains different anchors, so its gradients reduce over dp x cp (``draft_mesh``), and
every rank holds one replica (DDP) or one shard (FSDP2) of a single draft.

With ``recipe_args.draft_ep_size`` E > 1 (FSDP2 only) the draft's routed experts are placed by
upstream's ``apply_ep`` on the "ep" axis of ``expert_mesh`` (E consecutive ranks, each holding
experts / E of every layer), and FSDP2 shards each rank's experts over the "ep_shard" axis
(world / E ranks holding the same experts; none when E is the world). Everything else stays FSDP2
over dp x cp, so no rank gathers a whole layer's experts. Tokens reach their experts all-to-all
(``recipe_args.draft_ep_dispatcher: all_to_all``, ``models/deepseek_v41/expert_dispatch.py``:
each routed pair to its expert's rank and back) or by upstream's all-gather of the group's tokens
and all-reduce of the output (``all_gather``).

Gradient scale: each expert shard's gradient sums the losses of its E-rank group (the dispatcher
carries every group member's routed tokens to it), and "ep_shard" sums the world / E groups;
dividing that reduction by the world size (``set_gradient_divide_factor``) gives the mean over
ranks that the rest of the draft gets, so EP E trains exactly like EP 1 (tests/recipes/gloo_draft_ep.py).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel


def parallelize_draft(
    trainer_module: torch.nn.Module,
    strategy: str,
    world_size: int,
    device: torch.device,
    mesh: DeviceMesh | None,
    compute_dtype: torch.dtype,
    experts: DeviceMesh | None = None,
    dispatcher: str = "all_to_all",
) -> torch.nn.Module:
    """Replicate (DDP) or shard (FSDP2, per draft layer) the trainable draft over ``mesh``.

    Args:
        trainer_module: Upstream's ``DSparkTrainerModule`` around the draft.
        strategy: ``ddp`` or ``fsdp2`` (validated by ``config.validate_recipe_config``).
        world_size: Ranks of the run; one rank returns ``trainer_module`` unchanged.
        device: The rank's device.
        mesh: One-dimensional mesh the gradients reduce over (``draft_mesh``), or None for
            every rank.
        compute_dtype: FSDP2 parameter dtype (gradients reduce in fp32).
        experts: ``expert_mesh`` ("ep_shard", "ep") to place the routed experts with expert
            parallelism (FSDP2 only), or None to shard them with their layer.
        dispatcher: With ``experts``: ``all_to_all`` (``expert_dispatch.py``) or ``all_gather``
            (upstream's ``GroupedExperts``).

    Returns:
        The wrapped module (the same object on one rank); with ``experts``, every draft layer's
        ``ffn.experts`` holds DTensor parameters [experts, ...] sharded on dim 0 over "ep".
    """
    if world_size == 1:
        return trainer_module
    if strategy == "ddp":
        return DistributedDataParallel(
            trainer_module,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
            process_group=mesh.get_group() if mesh is not None else None,
        )
    from nemo_automodel.components.distributed.parallelizer_utils import fully_shard_by_dtype
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh or init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fp32_names = tuple(getattr(trainer_module.draft_model, "_keep_in_fp32_modules_strict", ()))
    if experts is not None:
        _shard_experts(trainer_module.draft_model, experts, policy, world_size, dispatcher)
    for layer in trainer_module.draft_model.layers:
        fully_shard_by_dtype(
            layer, mesh=mesh, mp_policy=policy, offload_policy=None, fp32_compute_module_names=fp32_names
        )
    return fully_shard(trainer_module, mesh=mesh, mp_policy=policy)


def checkpoint_draft(draft: torch.nn.Module, mode: bool | str, draft_ep_size: int) -> None:
    """Upstream's draft activation checkpointing, in place; under draft EP without the MoE blocks.

    With the routed experts on an EP mesh they are their own FSDP2 unit, and inside upstream's
    checkpointed ``ffn`` their gradients come out wrong (on gloo, about 1 / EP of the right value,
    with upstream's all-gather dispatcher and the all-to-all one alike; nemo_automodel 0.7.0 with
    torch 2.13, not root-caused), so with ``draft_ep_size`` > 1 each layer's ``ffn`` is unwrapped
    again: attention and the rest stay checkpointed and the MoE keeps its activations
    (``planning/memory_model.py`` counts them). Tested: ``tests/recipes/gloo_draft_ep.py``.

    Args:
        draft: The packed draft (``layers`` with ``ffn`` each), before it is parallelised.
        mode: ``distributed.activation_checkpointing`` (upstream's values).
        draft_ep_size: ``recipe_args.draft_ep_size``.

    Raises:
        ValueError: when ``mode`` checkpoints whole layers (selective) under draft EP.
    """
    from nemo_automodel.recipes.llm._spec_train_utils import apply_draft_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    apply_draft_activation_checkpointing(draft, mode)
    if draft_ep_size == 1:
        return
    for layer in draft.layers:
        if isinstance(layer.ffn, CheckpointWrapper):
            layer.ffn = layer.ffn._checkpoint_wrapped_module
        if isinstance(layer, CheckpointWrapper) or any(isinstance(m, CheckpointWrapper) for m in layer.ffn.modules()):
            raise ValueError(
                f"distributed.activation_checkpointing={mode!r} checkpoints the draft's MoE blocks, whose expert "
                "gradients are wrong under recipe_args.draft_ep_size > 1 (docs/recipes.md); use true"
            )


def expert_mesh(device_type: str, world_size: int, ep_size: int) -> DeviceMesh:
    """The draft's expert mesh: ("ep_shard", "ep") of shape (world_size / ep_size, ep_size).

    Args:
        device_type: ``cpu`` or ``cuda``.
        world_size: Ranks of the run (dp x cp).
        ep_size: Ranks an expert group spans (``recipe_args.draft_ep_size``); consecutive ranks.
    """
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("ep_shard", "ep"))


def _shard_experts(draft: torch.nn.Module, experts: DeviceMesh, policy, world_size: int, dispatcher: str) -> None:
    """Expert-parallel routed experts (upstream's ``apply_ep``), FSDP2 over "ep_shard", mean-reduced."""
    from nemo_automodel.components.moe.parallelizer import apply_ep
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from nemo_automodel_ext.models.deepseek_v41.expert_dispatch import DISPATCHERS, use_all_to_all_dispatch

    if dispatcher not in DISPATCHERS:
        raise ValueError(f"recipe_args.draft_ep_dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if dispatcher == "all_to_all":
        for layer in draft.layers:
            use_all_to_all_dispatch(layer.mlp.experts)
    apply_ep(draft, experts["ep"])
    for layer in draft.layers:
        # Dim 1 (hidden or expert width): a rank's local experts may be fewer than the ep_shard ranks.
        module = fully_shard(
            layer.mlp.experts, mesh=experts["ep_shard"], mp_policy=policy, shard_placement_fn=lambda _: Shard(1)
        )
        module.set_gradient_divide_factor(float(world_size))
        # SUM, then divide (gloo has no PREMUL_SUM). Not on a one-rank "ep_shard": torch 2.13's FSDP2
        # then divides twice (its pre-divide and its one-rank copy both apply the factor).
        module.set_force_sum_reduction_for_comms(experts["ep_shard"].size() > 1)


def draft_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh the draft's gradients reduce over: dp x cp flattened, or None (every rank is dp).

    Args:
        device_mesh: The recipe's two-dimensional ("dp", "cp") mesh under CP, else None.
    """
    if device_mesh is None:
        return None
    return device_mesh["dp", "cp"]._flatten("dp_cp")


__all__ = ["checkpoint_draft", "draft_mesh", "expert_mesh", "parallelize_draft"]
