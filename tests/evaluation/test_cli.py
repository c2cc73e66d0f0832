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

from nemo_automodel_ext.demo.tiny_assets import regenerate, write_demo_target
from nemo_automodel_ext.demo.tiny_tasks import conversation
from nemo_automodel_ext.evaluation.cli import main

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


def test_no_init_scores_the_checkpoints_alone_and_alike(run_dir, capsys, tmp_path):
    run, _, _, _ = run_dir
    both, alone = tmp_path / "both.json", tmp_path / "alone.json"
    assert main([str(run), "--limit", "6", "--output", str(both)]) == 0
    assert main([str(run), "--limit", "6", "--no-init", "--output", str(alone)]) == 0
    assert "untrained (init)" not in capsys.readouterr().out.split("wrote " + str(both))[1]
    report, full = json.loads(alone.read_text()), json.loads(both.read_text())
    assert list(report["greedy"]) == list(report["checkpoints"]) == ["epoch_0_step_120"]
    assert report["greedy"]["epoch_0_step_120"] == full["greedy"]["epoch_0_step_120"]


@pytest.mark.parametrize(
    "change,fragment",
    [
        ("missing", "does not exist"),
        ("empty_run", "no complete checkpoint"),
        ("vocab", "vocabulary differs"),
        ("block", "block_size"),
        ("layers", "target_layer_ids"),
        ("empty_prompts", "holds no prompts"),
        ("experts", "layer 0 has 2 routed experts, this config builds 4 (dspark_n_routed_experts"),
    ],
)
def test_bad_input_is_named(run_dir, demo_pair, tmp_path, capsys, change, fragment):
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
        elif change == "experts":  # D7: the released layout with half the routed experts
            released = demo_pair[1].state_dict_adapter.to_hf(state)
            state = {key: value for key, value in released.items() if not any(f"experts.{i}." in key for i in (2, 3))}
        elif change == "empty_prompts":
            (tmp_path / "empty.jsonl").write_text("\n")
            config["recipe_args"]["val_data_path"] = str(tmp_path / "empty.jsonl")
        _write_checkpoint(path, "epoch_0_step_1", state, meta, config)
    assert main([str(path)]) == 2
    assert fragment in capsys.readouterr().err


def _copy_run(run: Path, destination: Path) -> Path:
    import shutil

    shutil.copytree(run / "checkpoints" / "epoch_0_step_120", destination / "checkpoints" / "epoch_0_step_120")
    return destination


def test_the_evaluator_reads_the_effective_config_and_the_launch_folder(run_dir, tmp_path, monkeypatch, capsys):
    """A run launched with an override and relative paths, evaluated from another folder (items 2, 3)."""
    run, config, _, _ = run_dir
    launch = tmp_path / "launch"
    (launch / "data").mkdir(parents=True)
    lines = (run / "val.jsonl").read_text().splitlines()
    (launch / "data" / "five.jsonl").write_text("\n".join(lines[:5]) + "\n")
    (launch / "target").symlink_to(run / "target")
    copy = _copy_run(run, launch / "run")
    checkpoint = copy / "checkpoints" / "epoch_0_step_120"
    effective = json.loads(json.dumps(config))
    effective["recipe_args"].update(target_model_name_or_path="target", val_data_path="data/five.jsonl")
    (checkpoint / "run_config.yaml").write_text(yaml.safe_dump(effective))  # YAML + the override
    (checkpoint / "run.json").write_text(json.dumps({"launch_dir": str(launch)}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(copy), "--checkpoint", "epoch_0_step_120", "--output", "eval.json"]) == 0
    report = json.loads((elsewhere / "eval.json").read_text())
    assert report["prompts"] == 5 and report["data"] == str(launch / "data" / "five.jsonl")


def test_checkpoints_kept_outside_the_run_folder_are_found(run_dir, tmp_path, capsys):
    run, _, _, _ = run_dir
    store = _copy_run(run, tmp_path / "store")
    output = tmp_path / "output"
    output.mkdir()
    (output / "run.json").write_text(
        json.dumps({"launch_dir": str(tmp_path), "checkpoint_dir": str(store / "checkpoints")})
    )
    assert main([str(output), "--limit", "2", "--output", str(tmp_path / "eval.json")]) == 0


def test_two_checkpoints_of_the_same_name_get_two_rows(run_dir, tmp_path, capsys):
    run, _, _, _ = run_dir
    other = _copy_run(run, tmp_path / "second_run")
    checkpoints = [str(run / "checkpoints" / "epoch_0_step_120"), str(other / "checkpoints" / "epoch_0_step_120")]
    assert (
        main(
            [
                str(run),
                "--limit",
                "2",
                "--output",
                str(tmp_path / "e.json"),
                *sum([["--checkpoint", c] for c in checkpoints], []),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "e.json").read_text())["greedy"]
    assert len(rows) == 3, rows.keys()


@pytest.mark.parametrize(
    "case,fragment",
    [
        ("truncated", "cannot read the draft weights"),
        ("temperature", "--temperature must be >= 0"),
        ("limit", "--limit must be at least 1"),
        ("data_dir", "is a folder"),
        ("output", "does not exist"),
        ("output_folder", "is a folder; pass the file to write"),
        ("output_under_file", "is a file, not a folder"),
        ("device", "no CUDA device"),
        ("bad_prompt", "every message must be an object"),
        ("checkpoint_name", "--checkpoint epoch_9_step_9: neither a folder nor a checkpoint"),
    ],
)
def test_evaluation_options_and_files_are_refused_in_one_line(run_dir, tmp_path, capsys, case, fragment):
    """Each is refused before any draft is evaluated, as one ``error:`` line (item 11)."""
    if case == "device" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    run, _, _, _ = run_dir
    path = run
    args = ["--output", str(tmp_path / "eval.json")]
    if case == "truncated":
        path = _copy_run(run, tmp_path / "copy")
        weights = path / "checkpoints" / "epoch_0_step_120" / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:200])
    extra = {
        "truncated": [],
        "temperature": ["--temperature", "-1"],
        "limit": ["--limit", "0"],
        "data_dir": ["--data", str(tmp_path)],
        "output": ["--output", str(tmp_path / "missing" / "eval.json")],
        "output_folder": ["--output", str(tmp_path)],
        "output_under_file": ["--output", str(tmp_path / "bad.jsonl" / "eval.json")],
        "device": ["--device", "cuda"],
        "bad_prompt": ["--data", str(tmp_path / "bad.jsonl")],
        "checkpoint_name": ["--checkpoint", "epoch_9_step_9"],
    }[case]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": ["please copy alpha"]}) + "\n")
    assert main([str(path), *args, *extra]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ") and fragment in error[0], captured.err
    assert "untrained (init)" not in captured.out  # refused before anything was evaluated
