"""The framework CLI (``nemo_automodel.cli.app``) with ``quiet.py``'s filters installed first.

``python -m nemo_automodel_ext.framework_cli RECIPE.yaml [overrides]`` is what the plugin's
launcher runs under torchrun; it behaves exactly as ``python -m nemo_automodel.cli.app``.
"""

from __future__ import annotations

import runpy

import torch

from nemo_automodel_ext.quiet import install_quiet_filters

if __name__ == "__main__":
    install_quiet_filters(cpu_only=not torch.cuda.is_available())
    runpy.run_module("nemo_automodel.cli.app", run_name="__main__", alter_sys=True)
