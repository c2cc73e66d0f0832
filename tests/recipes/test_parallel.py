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
