"""Data parallelism of the packed V4.1 DSpark recipe's trainable draft.

Under context parallelism the draft is CP-native (``models/deepseek_v41/cp_trainer.py``): every
rank trains different anchors, so its gradients reduce over dp x cp (``draft_mesh``), and
every rank holds one replica (DDP) or one shard (FSDP2) of a single draft.
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

    Returns:
        The wrapped module (the same object on one rank).
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
    for layer in trainer_module.draft_model.layers:
        fully_shard_by_dtype(
            layer, mesh=mesh, mp_policy=policy, offload_policy=None, fp32_compute_module_names=fp32_names
        )
    return fully_shard(trainer_module, mesh=mesh, mp_policy=policy)


def draft_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh the draft's gradients reduce over: dp x cp flattened, or None (every rank is dp).

    Args:
        device_mesh: The recipe's two-dimensional ("dp", "cp") mesh under CP, else None.
    """
    if device_mesh is None:
        return None
    return device_mesh["dp", "cp"]._flatten("dp_cp")


__all__ = ["draft_mesh", "parallelize_draft"]
