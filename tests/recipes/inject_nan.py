"""Run the framework CLI with the target's captured features poisoned (NaN) at one training capture.

Usage (under torchrun): inject_nan.py RECIPE.yaml [overrides]; ``NAN_AT_CAPTURE`` is the 1-based capture.
"""

import os
import runpy
import sys

from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel

_original = DeepseekV41DSparkTargetModel.generate_batch
_calls = [0]


def _poisoned(self, *args, **kwargs):
    batch = _original(self, *args, **kwargs)
    _calls[0] += 1
    if _calls[0] == int(os.environ["NAN_AT_CAPTURE"]):
        batch.target_hidden_states[0] = float("nan")
    return batch


DeepseekV41DSparkTargetModel.generate_batch = _poisoned
sys.argv = ["nemo_automodel.cli.app", *sys.argv[1:]]
runpy.run_module("nemo_automodel.cli.app", run_name="__main__")
