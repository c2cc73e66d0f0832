"""``python -m nemo_automodel_ext.evaluation RUN_OR_CHECKPOINT`` (see ``cli.py``)."""

import sys

from nemo_automodel_ext.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
