"""What a checkpoint records of the run that wrote it: the effective config and where it was launched.

Upstream saves ``config.yaml`` in every checkpoint from the YAML file's original values, so a
command-line override (``--recipe_args.val_data_path=...``) is not in it, and relative paths in it
mean nothing once read from another folder. ``save_run_record`` adds, beside it:

- ``run_config.yaml``: the config the run actually used (YAML plus every override);
- ``run.json``: ``{"launch_dir": ...}``, the directory relative paths were resolved against.

``save_run_pointer`` writes the same ``run.json`` into the run's ``output_dir`` with the absolute
``checkpoint_dir``, so ``python -m nemo_automodel_ext.evaluation OUTPUT_DIR`` finds checkpoints
kept anywhere.

``load_run_record`` reads them back (falling back to ``config.yaml`` and the current directory for
checkpoints written before these files existed) and ``resolve_run_paths`` makes the run's paths
absolute, so the evaluator rebuilds the run it is given from any folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from nemo_automodel.components.config.loader import load_yaml_config

RUN_CONFIG = "run_config.yaml"
RUN_INFO = "run.json"
#: recipe_args keys holding local paths (a hub id or "none" is left as it is).
PATH_KEYS = ("target_model_name_or_path", "tiny_assets_dir", "train_data_path", "val_data_path", "output_dir")


def save_run_record(cfg: Any, checkpoint: str | os.PathLike) -> None:
    """Write ``run_config.yaml`` (``cfg`` with every override) and ``run.json`` into a checkpoint folder."""
    checkpoint = Path(checkpoint)
    with open(checkpoint / RUN_CONFIG, "w") as handle:
        yaml.safe_dump(cfg.to_yaml_dict(), handle, sort_keys=False, default_flow_style=False)
    save_run_pointer(checkpoint, None)


def save_run_pointer(output_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike | None) -> None:
    """Write ``output_dir/run.json``: the launch folder and where the checkpoints go (absolute)."""
    record = {"launch_dir": os.getcwd()}
    if checkpoint_dir is not None:
        record["checkpoint_dir"] = os.path.abspath(checkpoint_dir)
    (Path(output_dir) / RUN_INFO).write_text(json.dumps(record) + "\n")


def load_run_record(checkpoint: str | os.PathLike):
    """The run config of a checkpoint and the directory its relative paths are relative to.

    Returns:
        ``(cfg, launch_dir, effective)``: the loaded ``ConfigNode``, a ``Path``, and whether the
        config is the effective one (``run_config.yaml``) rather than upstream's ``config.yaml``.

    Raises:
        ValueError: naming the file, when neither config file can be read.
    """
    checkpoint = Path(checkpoint)
    effective = (checkpoint / RUN_CONFIG).is_file()
    path = checkpoint / (RUN_CONFIG if effective else "config.yaml")
    try:
        cfg = load_yaml_config(str(path))
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: cannot read the run's config ({' '.join(str(error).split())})") from None
    launch_dir = Path.cwd()
    info = checkpoint / RUN_INFO
    if info.is_file():
        try:
            launch_dir = Path(json.loads(info.read_text())["launch_dir"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{info}: not a run record (expected {{'launch_dir': ...}})") from None
    return cfg, launch_dir, effective


def resolve_run_paths(args: dict[str, Any], launch_dir: Path) -> dict[str, Any]:
    """A copy of ``recipe_args`` whose relative local paths are made absolute against ``launch_dir``."""
    resolved = dict(args)
    for key in PATH_KEYS:
        value = resolved.get(key)
        if isinstance(value, str) and value and value.lower() != "none" and not os.path.isabs(value):
            candidate = launch_dir / value
            # A hub id ("org/model") stays as it is unless the launch folder holds it.
            if candidate.exists() or key != "target_model_name_or_path":
                resolved[key] = str(candidate)
    return resolved


__all__ = [
    "PATH_KEYS",
    "RUN_CONFIG",
    "RUN_INFO",
    "load_run_record",
    "resolve_run_paths",
    "save_run_pointer",
    "save_run_record",
]
