"""Where a run writes: its folders checked before anything is loaded or trained.

A folder that cannot be written is found at the first save otherwise: after an epoch of
training (``checkpoint.checkpoint_dir``), or as a bare ``NotADirectoryError`` traceback
(``recipe_args.output_dir``). ``require_writable_folder`` creates and removes a probe file in
the folder, or in its nearest existing parent when the run would create it, and refuses in one
line naming the key.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from nemo_automodel.components.checkpoint.utils import is_cloud_path

from nemo_automodel_ext.run.config import section_get


def require_writable_folder(path: str | os.PathLike, name: str) -> None:
    """Refuse ``path`` unless it is a folder this process can write in, or one it can create.

    Args:
        path: The folder (it may not exist yet).
        name: The setting it comes from (``recipe_args.output_dir``, ``--output``), for the message.

    Raises:
        ValueError: naming ``name`` when a part of ``path`` is a file, or a probe file cannot be
            created and removed in the folder (or its nearest existing parent).
    """
    folder = Path(os.path.abspath(path))
    existing = folder
    while not existing.exists():
        if existing.is_symlink():
            raise ValueError(f"{name}={path}: {existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{name}={path}: {existing} is a file, not a folder; choose another path")
    try:
        handle, probe = tempfile.mkstemp(prefix=".write_probe_", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        where = "in it" if existing == folder else f"in {existing}, where it would be created"
        raise ValueError(f"{name}={path}: cannot write {where} ({error.strerror or error})") from None


def require_run_folders(cfg: Any, args: dict[str, Any]) -> None:
    """The recipe's output folder and, when checkpointing is on, its checkpoint folder (``require_writable_folder``).

    Args:
        cfg: The run's ``ConfigNode``.
        args: Validated ``recipe_args``.
    """
    require_writable_folder(args["output_dir"], "recipe_args.output_dir")
    checkpoint = cfg.get("checkpoint", None)
    if section_get(checkpoint, "enabled", False):
        folder = section_get(checkpoint, "checkpoint_dir", None) or "checkpoints/"  # upstream's default
        if not is_cloud_path(folder):  # object storage is checked by upstream's writer
            require_writable_folder(folder, "checkpoint.checkpoint_dir")


__all__ = ["require_run_folders", "require_writable_folder"]
