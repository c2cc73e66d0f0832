"""``run/paths.py``: folders a run writes, checked with a probe before anything loads."""

from __future__ import annotations

import pytest
from nemo_automodel.components.config.loader import load_yaml_config

from nemo_automodel_ext.run.paths import require_run_folders, require_writable_folder


def test_existing_and_creatable_folders_pass_and_nothing_is_left(tmp_path):
    require_writable_folder(tmp_path, "recipe_args.output_dir")
    require_writable_folder(tmp_path / "a" / "b", "recipe_args.output_dir")  # created later by the run
    assert list(tmp_path.iterdir()) == []  # the probe is removed and no folder is created


def test_a_file_on_the_way_is_refused_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"checkpoint.checkpoint_dir=.*file/sub: .*file is a file, not a folder"):
        require_writable_folder(tmp_path / "file" / "sub", "checkpoint.checkpoint_dir")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        require_writable_folder(tmp_path / "file", "--output")


def test_a_broken_link_is_refused(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere" / "deeper")
    with pytest.raises(ValueError, match="broken symbolic link"):
        require_writable_folder(tmp_path / "link" / "run", "recipe_args.output_dir")


def test_an_unwritable_folder_is_refused(tmp_path, monkeypatch):
    import tempfile

    def refuse(**_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ValueError, match=r"recipe_args.output_dir=.*: cannot write in .* \(Permission denied\)"):
        require_writable_folder(tmp_path / "new", "recipe_args.output_dir")


def test_the_recipe_checks_its_checkpoint_folder_only_when_checkpointing(tmp_path):
    from pathlib import Path

    cfg = load_yaml_config(Path(__file__).resolve().parents[2] / "recipes/deepseek_v41/dspark_tiny_cpu.yaml")
    (tmp_path / "file").write_text("x")
    cfg.set_by_dotted("checkpoint.checkpoint_dir", str(tmp_path / "file" / "ckpt"))
    args = {"output_dir": str(tmp_path / "out")}
    with pytest.raises(ValueError, match="checkpoint.checkpoint_dir="):
        require_run_folders(cfg, args)
    cfg.set_by_dotted("checkpoint.enabled", False)
    require_run_folders(cfg, args)
