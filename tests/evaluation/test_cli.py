"""``python -m nemo_automodel_ext.evaluation``: a run's checkpoints beside the draft at initialisation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from nemo_automodel.components.config.loader import load_yaml_config
from safetensors.torch import save_file

from nemo_automodel_ext.evaluation.cli import main
from nemo_automodel_ext.recipes.tiny_assets import regenerate, write_demo_target
from nemo_automodel_ext.recipes.tiny_tasks import conversation

REPO = Path(__file__).resolve().parents[2]


def _write_checkpoint(run: Path, name: str, state: dict, meta: dict, config: dict) -> Path:
    checkpoint = run / "checkpoints" / name
    (checkpoint / "model").mkdir(parents=True)
    save_file({key: value.contiguous() for key, value in state.items()}, checkpoint / "model" / "model.safetensors")
    torch.save(meta, checkpoint / "dspark_meta.pt")
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    return checkpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, demo_pair):
    """A run folder as the recipe leaves it: the trained demo draft's weights and the run's config."""
    wrapper, draft, _, tokenizer = demo_pair
    run = tmp_path_factory.mktemp("run")
    write_demo_target(run / "target")
    rng = random.Random(123)
    samples = regenerate(wrapper.model, tokenizer, [conversation(rng) for _ in range(32)])
    (run / "val.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    config = load_yaml_config(REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml").to_dict()
    config["recipe_args"].update(
        tiny_assets_dir=None,
        target_model_name_or_path=str(run / "target"),
        train_data_path=str(run / "val.jsonl"),
        val_data_path=str(run / "val.jsonl"),
        output_dir=str(run),
        num_anchors=24,
        shuffle_seed=0,  # the seed demo_pair initialised both drafts with
    )
    frozen = ("embed_tokens.weight", "lm_head.weight")  # copied from the target, as freeze_embeddings leaves them
    trainable = {name: value for name, value in draft.state_dict().items() if name not in frozen}
    meta = {"block_size": 4, "target_layer_ids": [1, 3, 5], "mask_token_id": 3}
    _write_checkpoint(run, "epoch_0_step_120", trainable, meta, config)
    return run, config, trainable, meta


def test_cli_prints_the_table_and_writes_eval_json(run_dir, capsys):
    run, _, _, _ = run_dir
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "untrained (init)" in out and "epoch_0_step_120" in out and "acc@4" in out
    report = json.loads((run / "checkpoints" / "eval.json").read_text())
    trained, untrained = report["greedy"]["epoch_0_step_120"], report["greedy"]["untrained (init)"]
    assert report["prompts"] == 32 and trained["agreement"] == 1.0
    assert trained["tau"] > untrained["tau"] >= 1.0
    assert trained["rounds"] < untrained["rounds"]  # the same text in fewer target passes
    assert trained["committed_tokens"] == untrained["committed_tokens"]


def test_cli_sampling_verification(run_dir, capsys, tmp_path):
    run, _, _, _ = run_dir
    output = tmp_path / "eval.json"
    assert (
        main([str(run), "--temperature", "1.0", "--limit", "6", "--max-new-tokens", "8", "--output", str(output)]) == 0
    )
    report = json.loads(output.read_text())
    assert report["sampled"]["temperature"] == 1.0
    assert set(report["sampled"]["results"]) == {"untrained (init)", "epoch_0_step_120"}
    assert "sampling verification at temperature 1.0" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change,fragment",
    [
        ("missing", "does not exist"),
        ("empty_run", "no complete checkpoint"),
        ("vocab", "vocabulary differs"),
        ("block", "block_size"),
        ("layers", "target_layer_ids"),
        ("empty_prompts", "holds no prompts"),
    ],
)
def test_bad_input_is_named(run_dir, tmp_path, capsys, change, fragment):
    run, config, trainable, meta = run_dir
    path = tmp_path / "other"
    if change == "missing":
        path = tmp_path / "nowhere"
    elif change == "empty_run":
        path.mkdir()
    else:
        config = json.loads(json.dumps(config))
        state, meta = dict(trainable), dict(meta)
        if change == "vocab":
            name = "mtp.0.markov_head.embed.weight"  # [vocab, markov rank]
            state[name] = torch.zeros(state[name].shape[0] + 8, state[name].shape[1])
        elif change == "block":
            meta["block_size"] = 8
        elif change == "layers":
            meta["target_layer_ids"] = [0, 2, 4]
        elif change == "empty_prompts":
            (tmp_path / "empty.jsonl").write_text("\n")
            config["recipe_args"]["val_data_path"] = str(tmp_path / "empty.jsonl")
        _write_checkpoint(path, "epoch_0_step_1", state, meta, config)
    assert main([str(path)]) == 2
    assert fragment in capsys.readouterr().err
