"""The draft's parallel layouts (``recipes/parallel.py``): expert parallelism trains exactly like EP 1."""

from __future__ import annotations

from pathlib import Path

WORKER = Path(__file__).with_name("gloo_draft_ep.py")


def test_draft_experts_on_ep_give_ep1_loss_gradients_and_keys():
    """Four gloo ranks: EP 1, EP 2 and EP 4 over four dp ranks, and EP 2 over dp 2 x CP 2, with the all-to-all
    dispatcher (and upstream's all-gather one for EP 4 and EP 2 x CP 2), give the loss, every gradient, the
    clipped norm, an SGD step and the state-dict keys of the draft trained alone; each rank holds experts / EP
    of every layer (tests/recipes/gloo_draft_ep.py)."""
    from conftest import run_gloo

    run_gloo(WORKER, world_size=4)


def test_checkpoint_draft_leaves_the_moe_blocks_unwrapped_under_draft_ep():
    """Upstream's activation checkpointing as is without draft EP; under it each layer's ffn (its MoE) is unwrapped,
    attention stays checkpointed, and a mode that checkpoints the MoE anyway is refused by name."""
    import pytest
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
    from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options
    from nemo_automodel_ext.recipes.parallel import checkpoint_draft

    text = build_tiny_target(seed=0).config.text_config

    def draft():
        return DeepseekV41PackedDSparkModel.from_options(
            released_draft_options(text, num_anchors=8), anchors_per_document=8
        )

    alone, spread = draft(), draft()
    checkpoint_draft(alone, True, 1)
    checkpoint_draft(spread, True, 2)
    assert all(isinstance(layer.ffn, CheckpointWrapper) for layer in alone.layers)
    assert not any(isinstance(m, CheckpointWrapper) for layer in spread.layers for m in layer.ffn.modules())
    assert all(isinstance(layer.attn, CheckpointWrapper) for layer in spread.layers)
    with pytest.raises(ValueError, match="activation_checkpointing='selective' checkpoints the draft's MoE blocks"):
        checkpoint_draft(draft(), "selective", 2)
