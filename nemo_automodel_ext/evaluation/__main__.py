"""``python -m nemo_automodel_ext.evaluation RUN_OR_CHECKPOINT`` (see ``cli.py``)."""

import sys

import torch

from nemo_automodel_ext.quiet import install_quiet_filters, quiet_sglang_warning

if __name__ == "__main__":
    install_quiet_filters(cpu_only=not torch.cuda.is_available())
    quiet_sglang_warning()  # the evaluator loads local targets only
    from nemo_automodel_ext.evaluation.cli import main

    sys.exit(main())
