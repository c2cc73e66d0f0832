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
from nemo_automodel.components.checkpoint.utils import (
    is_checkpoint_incomplete,
    resolve_restore_from_to_checkpoint_dir,
)
from nemo_automodel.components.config.loader import load_yaml_config

RUN_CONFIG = "run_config.yaml"
RUN_INFO = "run.json"
#: recipe_args keys holding local paths (a hub id or "none" is left as it is).
PATH_KEYS = ("target_model_name_or_path", "tiny_assets_dir", "train_data_path", "val_data_path", "output_dir")


def save_run_record(cfg: Any, checkpoint: str | os.PathLike, draft_shard_files: int | None = None) -> None:
    """Write ``run_config.yaml`` (``cfg`` with every override) and ``run.json`` into a checkpoint folder.

    Args:
        cfg: The run's ``ConfigNode``.
        checkpoint: The checkpoint folder.
        draft_shard_files: How many per-rank draft files the save writes (one a rank with an FSDP2 draft),
            which the export requires all of; None when not one a rank.
    """
    checkpoint = Path(checkpoint)
    with open(checkpoint / RUN_CONFIG, "w") as handle:
        yaml.safe_dump(cfg.to_yaml_dict(), handle, sort_keys=False, default_flow_style=False)
    save_run_pointer(checkpoint, None, draft_shard_files=draft_shard_files)


def save_run_pointer(
    output_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike | None, draft_shard_files: int | None = None
) -> None:
    """Write ``output_dir/run.json``: the launch folder, where the checkpoints go (absolute) and, in a
    checkpoint, how many per-rank draft files it holds."""
    record: dict[str, Any] = {"launch_dir": os.getcwd()}
    if checkpoint_dir is not None:
        record["checkpoint_dir"] = os.path.abspath(checkpoint_dir)
    if draft_shard_files is not None:
        record["draft_shard_files"] = int(draft_shard_files)
    (Path(output_dir) / RUN_INFO).write_text(json.dumps(record) + "\n")


def recorded_draft_shard_files(checkpoint: str | os.PathLike) -> int | None:
    """The per-rank draft file count a checkpoint's ``run.json`` records (None: not recorded)."""
    info = Path(checkpoint) / RUN_INFO
    try:
        value = json.loads(info.read_text()).get("draft_shard_files") if info.is_file() else None
    except (ValueError, AttributeError):
        raise ValueError(f"{info}: not a run record (expected a JSON object)") from None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: itself, or the latest complete one under a run or checkpoint dir.

    Raises:
        ValueError: when ``path`` does not exist or holds no complete checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist; train first (make distill) or pass a checkpoint folder")
    if (path / RUN_INFO).is_file() and not (path / "model").is_dir():
        try:  # a run's output folder records where its checkpoints went (checkpoint.checkpoint_dir)
            recorded = json.loads((path / RUN_INFO).read_text()).get("checkpoint_dir")
        except ValueError:
            recorded = None
        if recorded and Path(recorded).is_dir() and Path(recorded).resolve() != path.resolve():
            return resolve_checkpoint(recorded)
    if (path / "config.yaml").is_file() and (path / "model").is_dir():
        if is_checkpoint_incomplete(path):
            raise ValueError(f"checkpoint {path} was left incomplete by an interrupted save; pick a complete one")
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir() and any(root.glob("epoch_*_step_*")):
            found = resolve_restore_from_to_checkpoint_dir(root, "LATEST")
            if found is not None:
                return Path(found)
    raise ValueError(
        f"no complete checkpoint under {path}: expected a checkpoint folder (config.yaml + model/) or a run "
        "folder with checkpoints/epoch_*_step_*"
    )


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
    "recorded_draft_shard_files",
    "resolve_checkpoint",
    "resolve_run_paths",
    "save_run_pointer",
    "save_run_record",
]
