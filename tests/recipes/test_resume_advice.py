"""After a non-finite loss: which checkpoint is safe to resume from (issue 17 item 8)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from nemo_automodel_ext.recipes.resume import resume_advice


def _checkpoint(root, step, value):
    path = root / f"epoch_0_step_{step}"
    (path / "model").mkdir(parents=True)
    save_file({"w": torch.full((3,), value)}, path / "model" / "model.safetensors")
    return path


def test_latest_holding_the_failing_weights_is_not_advised(tmp_path):
    """Checkpoints every step, exploded weights (finite 5e34) at the last: name the last safe one."""
    _checkpoint(tmp_path, 1, 0.1)
    safe = _checkpoint(tmp_path, 2, 0.2)
    _checkpoint(tmp_path, 3, float("nan"))
    _checkpoint(tmp_path, 4, 5e34)
    advice = resume_advice(tmp_path, failed_step=5)
    assert "LATEST (epoch_0_step_4) holds the weights that gave this loss" in advice
    assert f"checkpoint.restore_from={safe}" in advice


def test_latest_before_the_failure_is_named_finite(tmp_path):
    latest = _checkpoint(tmp_path, 2, 0.2)
    advice = resume_advice(tmp_path, failed_step=4)
    assert "LATEST (epoch_0_step_2) predates this step and its weights are finite" in advice
    assert f"restore_from={latest}" in advice


def test_no_checkpoint_or_none_finite(tmp_path):
    assert "no checkpoint was saved yet" in resume_advice(tmp_path / "none", failed_step=3)
    assert "no checkpoint was saved yet" in resume_advice(None, failed_step=3)
    _checkpoint(tmp_path, 1, float("inf"))
    assert "no earlier checkpoint has finite weights" in resume_advice(tmp_path, failed_step=2)
