"""Run the framework CLI and SIGKILL the process at one precise moment (fault injection).

Usage (under torchrun): inject_kill.py RECIPE.yaml [overrides], with ``KILL_POINT`` (a name of
``POINTS``) and ``KILL_AT`` (its 1-based occurrence). The process kills itself with SIGKILL, as
a preemption or node failure would: no handler, no flush, no cleanup.
"""

import os
import runpy
import signal
import sys

import torch
from nemo_automodel.components.checkpoint import checkpointing
from nemo_automodel.components.checkpoint.lifecycle import CheckpointLifecycle
from nemo_automodel.recipes.llm import train_dspark

from nemo_automodel_ext.recipes.acceptance_eval import AcceptanceEvaluator
from nemo_automodel_ext.recipes.dspark_v41 import TrainPackedDSparkV41Recipe
from nemo_automodel_ext.recipes.progress import ProgressMetricLogger

POINT, AT = os.environ["KILL_POINT"], int(os.environ["KILL_AT"])
_seen = [0]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _reached() -> bool:
    _seen[0] += 1
    return _seen[0] == AT


def _before(owner, name):
    """Kill on entry to ``owner.name`` at its AT-th call."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if _reached():
            _die()
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _after(owner, name):
    """Kill right after ``owner.name`` returns, at its AT-th call."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if _reached():
            _die()
        return result

    setattr(owner, name, wrapper)


def _torn_progress_meta():
    """progress_meta.pt half written: the torn file a kill mid-write leaves."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith("progress_meta.pt") and _reached():
            original(obj, f, *args, **kwargs)
            size = os.path.getsize(f)
            with open(f, "r+b") as handle:
                handle.truncate(size // 2)
            _die()
        return original(obj, f, *args, **kwargs)

    torch.save = save


def _torn_metrics_line():
    original = ProgressMetricLogger.log

    def log(self, sample):
        if _reached():
            self._file.write('{"step": %d, "epoch": 0, "tok' % sample.step)
            self._file.flush()
            _die()
        return original(self, sample)

    ProgressMetricLogger.log = log


POINTS = {
    "mid_step_forward": lambda: _before(TrainPackedDSparkV41Recipe, "_forward_batch"),
    "after_optimizer_step": lambda: _before(TrainPackedDSparkV41Recipe, "_maybe_save_step_checkpoint"),
    "model_shard_write": lambda: _before(checkpointing.Checkpointer, "_do_save"),
    "consolidated_export": lambda: _before(checkpointing, "consolidate_safetensors_files_on_every_rank"),
    "optimizer_write": lambda: _before(checkpointing.Checkpointer, "save_optimizer"),
    "after_optimizer_write": lambda: _after(checkpointing.Checkpointer, "save_optimizer"),
    "rng_write": lambda: _before(checkpointing.Checkpointer, "save_on_dp_ranks"),
    "progress_meta_torn": _torn_progress_meta,
    "config_write": lambda: _before(train_dspark, "save_config"),
    "before_publish": lambda: _before(CheckpointLifecycle, "publish"),
    "after_latest_moves": lambda: _after(CheckpointLifecycle, "_update_checkpoint_pointer"),
    "metrics_line_torn": _torn_metrics_line,
    "mid_eval": lambda: _before(AcceptanceEvaluator, "run"),
}

POINTS[POINT]()
sys.argv = ["nemo_automodel.cli.app", *sys.argv[1:]]
runpy.run_module("nemo_automodel.cli.app", run_name="__main__")
