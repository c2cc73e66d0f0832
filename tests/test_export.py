"""``export.py``: per-rank draft files assembled by their recorded offsets into one consolidated folder, complete
or refused: every key and global shape from the draft's config, every rank's file, a validated existing folder,
an atomic swap (kill-point test) and, at the end of a multi-rank run, rank 0 seeing every rank's file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from nemo_automodel.components.config.loader import load_yaml_config
from safetensors.torch import load_file, save_file

from nemo_automodel_ext.export import (
    CONSOLIDATED,
    WEIGHTS,
    consolidated_problem,
    export_draft,
    main,
    read_draft,
    read_sharded_draft,
)
from nemo_automodel_ext.run.draft_checkpoint import expected_draft_shapes

REPO = Path(__file__).resolve().parents[1]
SHARD = "shard-{:05d}-model-00001-of-00001.safetensors"


def write_shard(path, tensors, offsets):
    """A per-rank file as the DCP HF writer leaves it: local slices plus their offsets in the metadata."""
    info = {key: {"saved_offsets": offset} for key, offset in offsets.items()}
    save_file(tensors, str(path), metadata={"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})


def rank_slices(released: dict[str, torch.Tensor], ranks: int = 2) -> list[dict[str, tuple[list[int], torch.Tensor]]]:
    """Each rank's slices as an FSDP2 draft with EP ``ranks`` saves them: experts whole on their rank, every other
    tensor split along dim 0 (uneven where it does not divide; a rank may hold an empty slice)."""
    slices: list[dict] = [{} for _ in range(ranks)]
    experts = sorted({int(key.split(".")[4]) for key in released if ".ffn.experts." in key})
    for key, value in released.items():
        if ".ffn.experts." in key:
            rank = experts.index(int(key.split(".")[4])) * ranks // len(experts)
            slices[rank][key] = ([0] * value.dim(), value.clone())
            continue
        step = -(-value.shape[0] // ranks) if value.dim() else 0
        for rank in range(ranks):
            start = min(rank * step, value.shape[0]) if value.dim() else 0
            part = value[start : start + step].clone() if value.dim() else value.clone()
            slices[rank][key] = ([start] + [0] * (value.dim() - 1), part)
    return slices


def write_rank_files(model: Path, slices) -> None:
    for rank, pieces in enumerate(slices):
        write_shard(
            model / SHARD.format(rank + 1),
            {key: part for key, (_, part) in pieces.items()},
            {key: offset for key, (offset, _) in pieces.items()},
        )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The demo draft in the released layout, and the run config that builds it (the tiny recipe's)."""
    from nemo_automodel_ext.demo.demo_target import demo_target_config
    from nemo_automodel_ext.run.config import validate_recipe_config
    from nemo_automodel_ext.run.loading import build_packed_draft

    root = tmp_path_factory.mktemp("draft")
    config = demo_target_config()
    config.save_pretrained(root / "target")
    cfg = load_yaml_config(REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml")
    cfg.set_by_dotted("recipe_args.target_model_name_or_path", str(root / "target"))
    args = validate_recipe_config(cfg, None, "cpu")
    torch.manual_seed(0)
    draft = build_packed_draft(args, config.text_config, ["DeepseekV41ForCausalLM"], [1, 3, 5], 4, 48, 3)
    for parameter in draft.parameters():  # distinct values everywhere: a misplaced slice cannot go unseen
        parameter.data.copy_(torch.randn(parameter.shape))
    released = {key: value.clone() for key, value in draft.state_dict_adapter.to_hf(draft.state_dict()).items()}
    return cfg.to_yaml_dict(), draft.config, released


def make_checkpoint(root: Path, trained, record_ranks: bool = True) -> Path:
    """A two-rank FSDP2 + EP 2 checkpoint folder as the recipe leaves it."""
    run_config, draft_config, released = trained
    checkpoint = root / "checkpoints" / "epoch_0_step_5"
    model = checkpoint / "model"
    (model / ".hf_metadata").mkdir(parents=True)
    draft_config.to_json_file(str(model / ".hf_metadata" / "config.json"))
    (model / ".hf_metadata" / "fqn_to_file_index_mapping.json").write_text("{}")
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(run_config))
    record = {"launch_dir": str(root)} | ({"draft_shard_files": 2} if record_ranks else {})
    (checkpoint / "run.json").write_text(json.dumps(record))
    write_rank_files(model, rank_slices(released))
    return checkpoint


def nothing_written(checkpoint: Path) -> bool:
    return not [path.name for path in (checkpoint / "model").iterdir() if CONSOLIDATED in path.name]


def test_expected_layout_comes_from_the_draft_config(tmp_path, trained):
    _, _, released = trained
    checkpoint = make_checkpoint(tmp_path, trained)
    assert expected_draft_shapes(checkpoint) == {key: tuple(value.shape) for key, value in released.items()}


def test_slices_are_assembled_at_their_offsets_and_exported(tmp_path, trained):
    _, _, released = trained
    checkpoint = make_checkpoint(tmp_path, trained)
    state = read_sharded_draft(checkpoint / "model", expected_draft_shapes(checkpoint), 2)
    assert set(state) == set(released) and all(torch.equal(state[key], released[key]) for key in released)
    folder = export_draft(checkpoint)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHTS, "model.safetensors.index.json"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    exported = load_file(folder / WEIGHTS)
    assert set(index["weight_map"]) == set(exported) == set(released)
    assert all(torch.equal(read_draft(checkpoint / "model")[key], released[key]) for key in released)
    assert [p.name for p in (checkpoint / "model").iterdir() if CONSOLIDATED in p.name] == [CONSOLIDATED]
    stamp = (folder / WEIGHTS).stat().st_mtime_ns
    assert main([str(checkpoint)]) == 0 and (folder / WEIGHTS).stat().st_mtime_ns == stamp  # valid: kept


@pytest.mark.parametrize("recorded", [True, False], ids=["ranks_recorded", "ranks_unrecorded"])
def test_a_missing_rank_file_is_refused_and_nothing_written(tmp_path, trained, capsys, recorded):
    """D1: the last rank's file gone. With the recorded rank count the file is named; without it the experts it
    held are missing (EP 2), which the draft's config says it has."""
    checkpoint = make_checkpoint(tmp_path, trained, record_ranks=recorded)
    (checkpoint / "model" / SHARD.format(2)).unlink()
    assert main([str(checkpoint)]) == 2
    error = capsys.readouterr().err
    fragment = "1 of 2 rank files missing (shard-00002-*)" if recorded else "has 2 routed experts, this config builds 4"
    assert fragment in error, error
    assert nothing_written(checkpoint)


def _rewrite(checkpoint: Path, rank: int, change) -> None:
    """Rewrite one rank's file through ``change(tensors, offsets)``."""
    from safetensors import safe_open

    path = checkpoint / "model" / SHARD.format(rank + 1)
    with safe_open(str(path), "pt") as handle:
        offsets = {k: v["saved_offsets"] for k, v in json.loads(handle.metadata()["DCP_SHARDING_INFO"]).items()}
    tensors = load_file(path)
    change(tensors, offsets)
    write_shard(path, tensors, offsets)


KEY = "mtp.0.attn.wq_a.weight"  # [32, 64]: rows 0-15 on rank 0, 16-31 on rank 1


@pytest.mark.parametrize(
    "case,change,fragment",
    [
        ("short", lambda t, o: t.update({KEY: t[KEY][:-3]}), "slices overlap or leave a gap"),
        ("overlap", lambda t, o: o.update({KEY: [14, 0]}), "slices overlap or leave a gap"),
        ("outside", lambda t, o: o.update({KEY: [20, 0]}), "falls outside its global shape [32, 64]"),
        ("key_gone", lambda t, o: (t.pop("mtp.0.norm.weight"), o.pop("mtp.0.norm.weight")), None),
        ("unknown", lambda t, o: (t.update(extra=torch.ones(2)), o.update(extra=[0])), "does not have: ['extra']"),
    ],
)
def test_a_gap_an_overlap_a_short_slice_or_a_wrong_key_is_refused(tmp_path, trained, capsys, case, change, fragment):
    checkpoint = make_checkpoint(tmp_path, trained)
    _rewrite(checkpoint, 1, change)
    if case == "key_gone":  # gone from both ranks
        _rewrite(checkpoint, 0, change)
        fragment = "draft tensors missing: ['mtp.0.norm.weight']"
    assert main([str(checkpoint)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and fragment in error, error
    assert nothing_written(checkpoint)


@pytest.mark.parametrize("damage", ["truncated", "tensor_missing", "index_missing"])
def test_an_existing_consolidated_folder_is_validated_and_rebuilt(tmp_path, trained, damage):
    """D2: the export trusted any existing weights file; now a broken one is rebuilt."""
    _, _, released = trained
    checkpoint = make_checkpoint(tmp_path, trained)
    folder = export_draft(checkpoint)
    weights = folder / WEIGHTS
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "tensor_missing":
        save_file({k: v for k, v in load_file(weights).items() if k != "mtp.0.norm.weight"}, str(weights))
    else:
        (folder / "model.safetensors.index.json").unlink()
    expected = expected_draft_shapes(checkpoint)
    assert consolidated_problem(folder, expected) is not None
    assert main([str(checkpoint)]) == 0
    assert consolidated_problem(folder, expected) is None
    exported = load_file(weights)
    assert all(torch.equal(exported[key], released[key]) for key in released)


def test_a_kill_at_any_point_of_the_export_leaves_the_old_folder_or_the_complete_new_one(tmp_path, trained):
    """SIGKILL before each file operation of the export in turn, over a broken consolidated folder
    (``kill_export.py``): a reader finds the old folder until the swap, the complete new one after it."""
    _, _, released = trained
    checkpoint = make_checkpoint(tmp_path, trained)
    folder = export_draft(checkpoint)
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:1000])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("kill_export.py")), str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    first_new = outcomes.index("new")
    # Killed while staging (old), then after the swap (new) until the last removal, then the export outlives it.
    assert first_new >= 4 and set(outcomes[:first_new]) == {"old"} and outcomes[-1] == "finished", outcomes
    assert set(outcomes[first_new:-1]) == {"new"}, outcomes
    expected = expected_draft_shapes(checkpoint)
    assert main([str(checkpoint)]) == 0 and consolidated_problem(folder, expected) is None
    assert all(torch.equal(load_file(folder / WEIGHTS)[key], released[key]) for key in released)
    assert [p.name for p in (checkpoint / "model").iterdir() if CONSOLIDATED in p.name] == [CONSOLIDATED]


def test_rank0_must_see_every_rank_file_node_local_folders_are_refused(gloo, tmp_path, trained):
    """The end-of-run export: on gloo, two ranks whose checkpoint folders are node-local (each sees only its own
    file) are refused on both ranks, naming the file; a shared folder exports."""
    root = tmp_path / "shared"
    make_checkpoint(root, trained)
    gloo(Path(__file__).with_name("gloo_export.py"), str(root), str(tmp_path / "node_local"))


def test_cli_names_what_is_missing(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    assert "error: checkpoint" in capsys.readouterr().err
