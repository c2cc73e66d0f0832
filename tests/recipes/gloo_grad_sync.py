"""Worker for the accumulation memory test (two gloo ranks, launched by tests/conftest.run_gloo).

A non-final micro-batch of an FSDP2 module under upstream's ``get_sync_ctx``, with the recipe's default
``distributed.defer_fsdp_grad_sync`` (argument ``recipe``) or upstream's deferred sync (``deferred``):
prints and checks the gradient bytes each rank holds per parameter until the next micro-batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from nemo_automodel.components.distributed.utils import get_sync_ctx
from torch.distributed.fsdp import fully_shard


def held_gradient_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(unsharded gradient bytes kept by FSDP2 for a later sync, sharded gradient bytes) of this rank."""
    unsharded = 0
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = None if state is None else state._fsdp_param_group
        for param in [] if group is None else group.fsdp_params:
            for grad in (param.unsharded_accumulated_grad, getattr(param._unsharded_param, "grad", None)):
                unsharded += 0 if grad is None else grad.numel() * grad.element_size()
    sharded = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return unsharded, sharded


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        if sys.argv[1] == "recipe":
            from nemo_automodel.components.config.loader import load_yaml_config

            from nemo_automodel_ext.run.config import validate_recipe_config

            cfg = load_yaml_config(
                str(Path(__file__).resolve().parents[2] / "recipes/deepseek_v41/dspark_tiny_cpu.yaml")
            )
            cfg.set_by_dotted("distributed.strategy", "fsdp2")
            cfg.set_by_dotted("checkpoint.save_consolidated", False)  # refused with an FSDP2 draft on 2 ranks
            defer = validate_recipe_config(cfg, 2, "cpu", require_packages=False)["defer_fsdp_grad_sync"]
        else:
            defer = True
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        parameters = sum(p.numel() for p in model.parameters())
        with get_sync_ctx(model, is_optim_step=False, defer_fsdp_grad_sync=defer):
            model(torch.randn(8, 64)).sum().backward()
        unsharded, sharded = held_gradient_bytes(model)
        print(
            f"rank {dist.get_rank()} defer={defer}: unsharded {unsharded / parameters:.2f} B/param, "
            f"sharded {sharded / parameters:.2f} B/param"
        )
        if defer:
            assert unsharded == 4 * parameters and sharded == 0, (unsharded, sharded)
        else:
            assert unsharded == 0 and sharded == 4 * parameters // 2, (unsharded, sharded)
        dist.barrier()  # both ranks past the reduce-scatter before the group goes away
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from gloo_exit import finish

    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
