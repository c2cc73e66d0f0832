"""Worker for the frozen-target re-shard test (two gloo ranks, launched by tests/conftest.run_gloo).

Applies upstream's own parallelizer (FSDP2 + EP 2) to a tiny V4.1 target through the recipe's
``frozen_target_setup`` (or, with ``upstream``, through upstream's setup unchanged), runs a DSpark
capture, and checks each rank's parameter elements before and after it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config

from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target
from nemo_automodel_ext.recipes.builders import frozen_target_setup


def local_elements(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        cfg = {"strategy": "fsdp2", "ep_size": 2}
        upstream = sys.argv[1:] == ["upstream"]
        setup = create_distributed_setup_from_config(cfg, world_size=2) if upstream else frozen_target_setup(cfg, 2)
        model = parallelize_model(build_tiny_target(seed=0), setup.mesh_context)
        wrapper = DeepseekV41DSparkTargetModel(model, model.config.text_config.dspark_target_layer_ids)
        sharded = local_elements(model)
        ids = torch.randint(4, 500, (1, 24), generator=torch.Generator().manual_seed(3))
        for _ in range(2):
            wrapper.generate_batch(ids, torch.ones_like(ids), torch.ones_like(ids), seq_lens=torch.tensor([[10, 14]]))
        after = local_elements(model)
        if upstream:  # the defect this builder works around: the gathered weights stay
            assert after > sharded, (sharded, after)
        else:
            assert after == sharded, f"per-rank parameter elements {sharded} -> {after} after a capture"
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from gloo_exit import finish

    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
