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
    activation_checkpointing: bool | str = False,
) -> torch.nn.Module:
    """Place the draft's experts, checkpoint its activations, then replicate (DDP) or shard (FSDP2) it over ``mesh``.

    The order is upstream's ``parallelize_model``'s: expert parallelism (``apply_ep``), then activation
    checkpointing, then data parallelism. ``apply_ep`` finds each layer's MoE by its type, so a layer
    already wrapped for checkpointing would be skipped (its experts left whole on every rank); every
    layer's split is checked after it (``require_experts_split``).

    Args:
        trainer_module: Upstream's ``DSparkTrainerModule`` around the draft.
        strategy: ``ddp`` or ``fsdp2`` (validated by ``config.validate_recipe_config``).
        world_size: Ranks of the run; one rank returns ``trainer_module`` (checkpointed) unchanged.
        device: The rank's device.
        mesh: One-dimensional mesh the gradients reduce over (``draft_mesh``), or None for
            every rank.
        compute_dtype: FSDP2 parameter dtype (gradients reduce in fp32).
        experts: ``expert_mesh`` ("ep_shard", "ep") to place the routed experts with expert
            parallelism (FSDP2 only), or None to shard them with their layer.
        dispatcher: With ``experts``: ``all_to_all`` (``expert_dispatch.py``) or ``all_gather``
            (upstream's ``GroupedExperts``).
        activation_checkpointing: ``distributed.activation_checkpointing`` (upstream's values).

    Returns:
        The wrapped module (the same object on one rank); with ``experts``, every draft layer's
        ``ffn.experts`` holds DTensor parameters [experts, ...] sharded on dim 0 over "ep".

    Raises:
        ValueError: when expert parallelism left a layer's experts unsplit.
    """
    draft = trainer_module.draft_model
    policy = None
    if world_size > 1 and strategy != "ddp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        if experts is not None:
            _shard_experts(draft, experts, policy, world_size, dispatcher)
    checkpoint_draft(draft, activation_checkpointing)
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
    from torch.distributed.fsdp import fully_shard

    mesh = mesh or init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    fp32_names = tuple(getattr(draft, "_keep_in_fp32_modules_strict", ()))
    for layer in draft.layers:
        fully_shard_by_dtype(
            layer, mesh=mesh, mp_policy=policy, offload_policy=None, fp32_compute_module_names=fp32_names
        )
    return fully_shard(trainer_module, mesh=mesh, mp_policy=policy)


def checkpoint_draft(draft: torch.nn.Module, mode: bool | str) -> None:
    """Upstream's draft activation checkpointing (``apply_draft_activation_checkpointing``), in place.

    Under draft EP it runs after ``apply_ep`` (``parallelize_draft``), so the MoE blocks are checkpointed
    too: wrapped first, upstream's ``apply_ep`` did not recognise them and left every layer's experts
    whole, which gave their gradients about 1 / EP of their value (docs/recipes.md).

    Args:
        draft: The packed draft (``layers`` with ``ffn`` each).
        mode: ``distributed.activation_checkpointing`` (upstream's values).
    """
    from nemo_automodel.recipes.llm._spec_train_utils import apply_draft_activation_checkpointing

    apply_draft_activation_checkpointing(draft, mode)


def require_experts_split(draft: torch.nn.Module, experts: DeviceMesh) -> None:
    """Refuse unless every draft layer's routed-expert parameters are DTensors sharded on dim 0 over ``experts``'s
    "ep" axis, each rank holding experts / EP of them.

    Raises:
        ValueError: naming the first layer and parameter that is not split so.
    """
    from torch.distributed.tensor import DTensor, Shard

    ep = experts["ep"]
    for index, layer in enumerate(draft.layers):
        module = getattr(layer.ffn, "experts", None)
        count = getattr(module, "n_routed_experts", None)
        for name, parameter in module.named_parameters() if module is not None else ():
            split = (
                isinstance(parameter, DTensor)
                and parameter.device_mesh == ep
                and tuple(parameter.placements) == (Shard(0),)
                and (count is None or parameter.to_local().shape[0] * ep.size() == count)
            )
            if not split:
                raise ValueError(
                    f"draft layer {index}: ffn.experts.{name} is not split over the {ep.size()} expert-parallel ranks "
                    f"(upstream's apply_ep skipped the layer: is its MoE wrapped, e.g. for activation checkpointing, "
                    "before expert parallelism?)"
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
    require_experts_split(draft, experts)
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


__all__ = ["checkpoint_draft", "draft_mesh", "expert_mesh", "parallelize_draft", "require_experts_split"]
