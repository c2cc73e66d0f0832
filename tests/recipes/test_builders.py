"""Recipe builders (``recipes/builders.py``) that need no full recipe run."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_automodel_ext.recipes.builders import frozen_target_setup

WORKER = Path(__file__).with_name("gloo_target_reshard.py")


@pytest.mark.parametrize("mode", ["plugin", "upstream"])
def test_frozen_target_reshards_after_its_forward(gloo, mode):
    """Per-rank target parameter elements are unchanged by captures (upstream's default setup grows them)."""
    gloo(WORKER, mode)


def test_explicit_no_reshard_is_refused():
    with pytest.raises(ValueError, match="distributed.reshard_after_forward: false"):
        frozen_target_setup({"strategy": "fsdp2", "reshard_after_forward": False}, 1)


@pytest.mark.parametrize("mode", ["recipe", "deferred"])
def test_accumulation_holds_sharded_gradients_only(gloo, mode):
    """Between micro-batches each rank holds 2 bytes a parameter (fp32, sharded over 2) with the recipe's
    default; upstream's deferred sync holds 4 (fp32, unsharded): 53 GiB for the Flash draft."""
    gloo(Path(__file__).with_name("gloo_grad_sync.py"), mode)
