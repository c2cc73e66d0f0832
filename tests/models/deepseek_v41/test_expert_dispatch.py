"""All-to-all dispatch of expert-parallel routed experts (``models/deepseek_v41/expert_dispatch.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("gloo_expert_dispatch.py")


def test_all_to_all_experts_equal_upstream_without_ep():
    """Four gloo ranks, EP 2 and EP 4: outputs and the gradients of activations, routing weights and expert shards
    equal upstream's experts without EP on the group's tokens (unequal and empty ranks, masked tokens, ranks that
    receive nothing, loop and grouped-mm compute, router weight before or after the down projection), with no
    all-gather (tests/models/deepseek_v41/gloo_expert_dispatch.py)."""
    from conftest import run_gloo

    run_gloo(WORKER, world_size=4)


def test_without_ep_it_is_upstreams_module():
    """One rank, no EP mesh: the swapped module computes exactly upstream's forward; other classes are refused."""
    from nemo_automodel.components.moe.experts import GroupedExperts

    from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
    from nemo_automodel_ext.models.deepseek_v41.expert_dispatch import use_all_to_all_dispatch
    from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options

    text = build_tiny_target(seed=0).config.text_config
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=8), anchors_per_document=8
    )
    experts = draft.layers[0].mlp.experts
    x, weights = torch.randn(6, experts.config.dim), torch.rand(6, 2)
    indices, mask = (
        torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0], [1, 2]]),
        torch.tensor([1, 1, 0, 1, 1, 1]).bool(),
    )
    expected = GroupedExperts.forward(experts, x, mask, weights, indices)
    use_all_to_all_dispatch(experts)
    assert torch.equal(experts(x, mask, weights, indices), expected)
    with pytest.raises(ValueError, match="draft_ep_dispatcher='all_to_all' needs upstream's GroupedExperts"):
        use_all_to_all_dispatch(experts)
