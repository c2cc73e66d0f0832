"""``export.py``: per-rank draft files assembled by their recorded offsets, and the consolidated folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_automodel_ext.export import export_draft, main, read_draft, read_sharded_draft


def write_shard(path, tensors, offsets):
    """A per-rank file as the DCP HF writer leaves it: local slices plus their offsets in the metadata."""
    info = {key: {"saved_offsets": offset} for key, offset in offsets.items()}
    save_file(tensors, str(path), metadata={"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})


@pytest.fixture
def checkpoint(tmp_path):
    whole = torch.arange(24, dtype=torch.float32).view(6, 4)
    experts = {f"mtp.0.ffn.experts.{i}.w1.weight": torch.full((2, 3), float(i)) for i in range(4)}
    model = tmp_path / "epoch_0_step_5" / "model"
    (model / ".hf_metadata").mkdir(parents=True)
    (model / ".hf_metadata" / "config.json").write_text("{}")
    (model / ".hf_metadata" / "fqn_to_file_index_mapping.json").write_text("{}")
    (tmp_path / "epoch_0_step_5" / "config.yaml").write_text("recipe_args: {}\n")
    for rank, rows in enumerate(((0, 4), (4, 6))):  # uneven row shards, two experts a rank
        tensors = {"mtp.0.attn.wq_a.weight": whole[rows[0] : rows[1]].clone()}
        tensors.update({key: value for i, (key, value) in enumerate(experts.items()) if i // 2 == rank})
        offsets = {key: [0, 0] for key in tensors} | {"mtp.0.attn.wq_a.weight": [rows[0], 0]}
        write_shard(model / f"shard-0000{rank + 1}-model-00001-of-00001.safetensors", tensors, offsets)
    return tmp_path / "epoch_0_step_5", whole, experts


def test_slices_are_assembled_at_their_offsets(checkpoint):
    path, whole, experts = checkpoint
    state = read_sharded_draft(path / "model")
    assert torch.equal(state["mtp.0.attn.wq_a.weight"], whole)
    assert all(torch.equal(state[key], value) for key, value in experts.items())


def test_export_writes_one_consolidated_folder_the_evaluator_reads(checkpoint):
    path, whole, _ = checkpoint
    folder = export_draft(path)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_file(folder / "model-00001-of-00001.safetensors"))
    assert torch.equal(read_draft(path / "model")["mtp.0.attn.wq_a.weight"], whole)
    assert not list((path / "model").glob(".consolidated*"))  # the staging folder was renamed
    assert main([str(path)]) == 0 and export_draft(path) == folder  # kept when already there


def test_overlapping_or_missing_slices_are_refused(checkpoint, tmp_path):
    path, _, _ = checkpoint
    shard = path / "model" / "shard-00002-model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    write_shard(shard, tensors, {key: [0, 0] for key in tensors} | {"mtp.0.attn.wq_a.weight": [3, 0]})
    with pytest.raises(ValueError, match="wq_a.weight's slices overlap or leave a gap"):
        read_sharded_draft(path / "model")
    write_shard(shard, tensors, {key: [0, 0] for key in tensors} | {"mtp.0.attn.wq_a.weight": [5, 0]})
    with pytest.raises(ValueError, match="overlap or leave a gap"):
        read_sharded_draft(path / "model")
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(ValueError, match="cannot read the draft weights"):
        read_sharded_draft(path / "model")


def test_cli_names_what_is_missing(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    assert "error: checkpoint" in capsys.readouterr().err
