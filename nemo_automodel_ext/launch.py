"""``python -m nemo_automodel_ext.launch [--nproc-per-node N] RECIPE.yaml [overrides]``.

Runs a recipe with the framework CLI under ``torchrun --standalone`` (what ``make distill``
does; ``automodel`` alone asks CUDA for a device count and fails on CPU-only machines). When the
run refuses (a bad key, bad data, a non-finite loss), the reason is printed once as the very last
line, ``error: ...``, below torchrun's failure report.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from nemo_automodel_ext.recipes.refusals import REFUSAL_FILE_ENV


def torchrun_command(config: str, overrides: list[str], nproc_per_node: int | str = 1, entry: list[str] | None = None):
    """The ``torchrun --standalone`` command line running ``config`` through ``entry`` (default: the framework CLI).

    Args:
        config: Recipe YAML.
        overrides: ``--section.key=value`` overrides.
        nproc_per_node: Local worker processes.
        entry: What torchrun runs: ``["-m", module]`` or ``[script]``; by default the framework CLI
            with the plugin's warning filters (``framework_cli.py``).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc_per_node),
        *(entry or ["-m", "nemo_automodel_ext.framework_cli"]),
        str(config),
        *overrides,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_automodel_ext.launch", description=__doc__)
    parser.add_argument("--nproc-per-node", default="1")
    parser.add_argument("config")
    options, overrides = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="dspark_refusal_") as directory:
        refusal = Path(directory) / "refusal.txt"
        command = torchrun_command(options.config, overrides, options.nproc_per_node)
        code = subprocess.call(command, env={**os.environ, REFUSAL_FILE_ENV: str(refusal)})
        if code and refusal.exists():
            sys.stdout.flush()
            print(f"\nerror: {refusal.read_text().strip()}", file=sys.stderr, flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
