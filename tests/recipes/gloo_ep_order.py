"""Two gloo ranks: a draft layer that upstream's ``apply_ep`` skipped is refused (``require_experts_split``).

The old call order wrapped the draft for activation checkpointing before expert parallelism; ``apply_ep``
finds a layer's MoE by its type, so it skipped every wrapped layer and left the experts whole.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from gloo_exit import finish
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options
from nemo_automodel_ext.recipes.parallel import checkpoint_draft, expert_mesh, parallelize_draft


def module(text):
    torch.manual_seed(0)
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=8), anchors_per_document=8
    )
    return PackedDSparkTrainerModule(draft)


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    text = build_tiny_target(seed=0).config.text_config
    experts = expert_mesh("cpu", 2, 2)
    old_order = module(text)
    checkpoint_draft(old_order.draft_model, True)  # wrapped first, as the recipe used to
    try:
        parallelize_draft(old_order, "fsdp2", 2, torch.device("cpu"), None, torch.float32, experts=experts)
    except ValueError as error:
        assert "draft layer 0: ffn.experts." in str(error) and "apply_ep skipped the layer" in str(error), error
    else:
        raise AssertionError("a layer whose experts apply_ep skipped was not refused")
    ours = parallelize_draft(
        module(text),
        "fsdp2",
        2,
        torch.device("cpu"),
        None,
        torch.float32,
        experts=experts,
        activation_checkpointing=True,
    )
    for layer in ours.draft_model.layers:
        assert isinstance(layer.ffn, CheckpointWrapper)
        local = layer.mlp.experts.gate_and_up_projs
        assert isinstance(local, DTensor) and local.to_local().shape[0] == text.dspark_n_routed_experts // 2
    if dist.get_rank() == 0:
        print("old order refused; EP then checkpointing splits every layer")


if __name__ == "__main__":
    main()
    finish()
