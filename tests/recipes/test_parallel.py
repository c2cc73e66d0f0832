"""The draft's parallel layouts (``recipes/parallel.py``): expert parallelism trains exactly like EP 1."""

from __future__ import annotations

from pathlib import Path

WORKER = Path(__file__).with_name("gloo_draft_ep.py")


def test_draft_experts_on_ep_give_ep1_loss_gradients_and_keys():
    """Four gloo ranks: EP 1, EP 2 and EP 4 over four dp ranks, and EP 2 over dp 2 x CP 2, with the all-to-all
    dispatcher (and upstream's all-gather one for EP 4 and EP 2 x CP 2), most with activation checkpointing (the
    MoE blocks checkpointed, after expert parallelism), give the loss, every gradient, the clipped norm, an SGD
    step and the state-dict keys of the draft trained alone; each rank holds experts / EP of every layer
    (tests/recipes/gloo_draft_ep.py)."""
    from conftest import run_gloo

    run_gloo(WORKER, world_size=4)


def test_a_layer_apply_ep_skipped_is_refused_by_name():
    """Two gloo ranks: the old call order (the draft wrapped for activation checkpointing before expert
    parallelism: upstream's apply_ep no longer recognises the wrapped MoE and skips every layer) is refused,
    naming the layer; the recipe's order (parallelize_draft: EP, then checkpointing) splits every layer's experts
    and checkpoints its MoE block (tests/recipes/gloo_ep_order.py)."""
    from conftest import run_gloo

    run_gloo(Path(__file__).with_name("gloo_ep_order.py"), world_size=2)
