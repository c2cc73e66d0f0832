"""Recipe configs, their validation, and the tiny CPU distillation run end to end."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from nemo_automodel.components.checkpoint.utils import resolve_restore_from_to_checkpoint_dir
from nemo_automodel.components.config.loader import load_yaml_config
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from progress_bound import run_until_stalled
from safetensors.torch import load_file

from nemo_automodel_ext.launch import torchrun_command
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend, tiny_target_config
from nemo_automodel_ext.recipes.dspark_v41 import TrainPackedDSparkV41Recipe
from nemo_automodel_ext.run.config import validate_recipe_config
from nemo_automodel_ext.run.loading import build_packed_draft, check_target_contract, require_v41_checkpoint

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
# Under `make test` (pytest-xdist): every test here on one worker, so the uninterrupted run is made once.
pytestmark = pytest.mark.xdist_group("tiny_recipe_run")
# Ranks and device each recipe is written for.
LAUNCH = {
    "dspark_tiny_cpu.yaml": (1, "cpu"),
    "dspark_flash_h200_4node.yaml": (32, "cuda"),
    "dspark_flash_h100_8node_cp.yaml": (64, "cuda"),
}


def shrunken_flash_config() -> DeepseekV41Config:
    """V4.1-Flash's layer schedule and DSpark contract with small widths (built on meta only)."""
    return DeepseekV41Config(
        text_config={
            "hidden_size": 64,
            "moe_intermediate_size": 32,
            "num_attention_heads": 4,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 32,
            "o_lora_rank": 32,
            "o_groups": 2,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "index_n_heads": 2,
            "index_head_dim": 32,
            "engram_layer_ids": [],
            "dspark_n_routed_experts": 8,
            "dspark_num_experts_per_tok": 2,
        },
        vision_config={"num_hidden_layers": 0},
    )


def test_every_recipe_has_a_launch_entry():
    assert {path.name for path in RECIPES} == set(LAUNCH)


@pytest.mark.parametrize("path", RECIPES, ids=[path.name for path in RECIPES])
def test_recipe_validates_and_builds_on_meta(path):
    cfg = load_yaml_config(path)
    world_size, device = LAUNCH[path.name]
    assert cfg.get("recipe") == "nemo_automodel_ext.recipes.dspark_v41.TrainPackedDSparkV41Recipe"
    args = validate_recipe_config(cfg, world_size, device, require_packages=False)
    config = tiny_target_config() if device == "cpu" else shrunken_flash_config()
    text = config.text_config
    layer_ids = list(args["target_layer_ids"] or text.dspark_target_layer_ids)
    with torch.device("meta"):
        target = DeepseekV41ForCausalLM(config, backend=cpu_backend())
        draft = build_packed_draft(
            args,
            text,
            list(config.architectures),
            layer_ids,
            int(args["block_size"] or text.dspark_block_size),
            int(args["num_anchors"]),
            int(args["mask_token_id"]),
        )
    assert isinstance(draft, DeepseekV41PackedDSparkModel)
    target.get_dspark_target_feature_modules(layer_ids)
    if args["packed_sequence_size"]:
        assert args["packed_sequence_size"] <= args["seq_length"]


def _tiny_cfg():
    return load_yaml_config(REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml")


@pytest.mark.parametrize(
    "key,value,world,device,fragment",
    [
        ("recipe_args.packed_sequense_size", 128, 1, "cpu", "did you mean packed_sequence_size"),
        ("recipe_args.output_dir", None, 1, "cpu", "output_dir is required"),
        ("recipe_args.target_builder", "hub", 1, "cpu", "target_builder must be one of"),
        ("recipe_args.target_builder", "automodel", 1, "cpu", "needs CUDA"),
        ("recipe_args.target_dispatcher", "hybridep", 1, "cpu", "hybridep needs CUDA"),
        ("recipe_args.target_attn_backend", "tilelang", 1, "cpu", "tilelang needs CUDA"),
        ("recipe_args.packed_sequence_size", 4096, 1, "cpu", "packed_sequence_size must be"),
        ("distributed.cp_size", 3, 4, "cpu", "cp_size=3 must divide"),
        ("distributed.tp_size", 2, 2, "cpu", "tp_size must be 1"),
        ("distributed.strategy", "megatron", 2, "cpu", "strategy must be ddp or fsdp2"),
        ("distributed.cp_size", 0, 1, "cpu", "cp_size must be an integer >= 1"),
        ("distributed.reshard_after_forward", False, 1, "cpu", "reshard_after_forward: false keeps the frozen"),
        ("distributed.cp_size", -2, 2, "cpu", "cp_size must be an integer >= 1"),
        ("recipe_args.grad_accumulation_steps", 0, 1, "cpu", "grad_accumulation_steps must be an integer >= 1"),
        ("recipe_args.grad_accumulation_steps", -1, 1, "cpu", "grad_accumulation_steps must be an integer >= 1"),
        ("recipe_args.micro_batch_size", 0, 1, "cpu", "micro_batch_size must be an integer >= 1"),
        ("recipe_args.num_epochs", 0, 1, "cpu", "num_epochs must be an integer >= 1"),
        ("recipe_args.log_every_steps", 0, 1, "cpu", "log_every_steps must be an integer >= 1"),
        ("recipe_args.ckpt_every_steps", 0, 1, "cpu", "ckpt_every_steps must be an integer >= 1"),
        ("recipe_args.eval_every_steps", 2.5, 1, "cpu", "eval_every_steps must be an integer >= 1"),
        ("recipe_args.num_anchors", 0, 1, "cpu", "num_anchors must be an integer >= 1"),
        ("recipe_args.num_anchors_per_document", -3, 1, "cpu", "num_anchors_per_document must be an integer"),
        ("recipe_args.mask_token_id", -1, 1, "cpu", "mask_token_id must be an integer >= 0"),
        ("recipe_args.ce_loss_alpha", -0.5, 1, "cpu", "ce_loss_alpha must be a finite number >= 0"),
        ("recipe_args.l1_loss_alpha", float("nan"), 1, "cpu", "l1_loss_alpha must be a finite number >= 0"),
        ("recipe_args.confidence_head_alpha", "high", 1, "cpu", "confidence_head_alpha must be a finite number"),
        ("recipe_args.markov_head_type", "gated", 1, "cpu", "markov_head_type must be one of"),
        ("recipe_args.target_layer_ids", [3, 1, 5], 1, "cpu", "target_layer_ids must be strictly increasing"),
        ("recipe_args.target_layer_ids", [1, 1], 1, "cpu", "target_layer_ids must be strictly increasing"),
        ("recipe_args.max_grad_norm", 0, 1, "cpu", "max_grad_norm=0 clips every gradient to zero"),
        ("recipe_args.packed_sequence_size", "abc", 1, "cpu", "packed_sequence_size must be an integer >= 0"),
        ("recipe_args.packed_sequence_size", [64], 1, "cpu", "packed_sequence_size must be an integer >= 0"),
        ("recipe_args.packed_sequence_size", 64.7, 1, "cpu", "packed_sequence_size must be an integer >= 0"),
        ("recipe_args.packed_sequence_size", True, 1, "cpu", "packed_sequence_size must be an integer >= 0"),
        ("recipe_args.target_layer_ids", 5, 1, "cpu", "target_layer_ids must be a non-empty list of integers"),
        ("recipe_args.target_dispatcher", "bogus", 1, "cpu", "target_dispatcher must be one of"),
        ("recipe_args.target_experts", "bogus", 1, "cpu", "target_experts must be one of"),
        ("recipe_args.chat_template", 123, 1, "cpu", "chat_template must be a string"),
        ("recipe_args.shuffle_seed", 2**64, 1, "cpu", "shuffle_seed must be at most 4294967295"),
        ("distributed.defer_fsdp_grad_sync", "yes", 2, "cpu", "defer_fsdp_grad_sync must be true or false"),
        ("recipe_args.draft_ep_size", 0, 2, "cpu", "draft_ep_size must be an integer >= 1"),
        ("recipe_args.draft_ep_size", 2, 2, "cpu", "needs distributed.strategy: fsdp2 \\(got ddp\\)"),
        ("recipe_args.draft_ep_size", 4, 2, "cpu", "must divide the number of ranks \\(2\\)"),
        ("recipe_args.draft_ep_size", 2, 1, "cpu", "must divide the number of ranks \\(1\\); set it to 1"),
        ("optimizer.lr", 1e39, 1, "cpu", "optimizer.lr is beyond float32's range"),
        ("optimizer.lr", float("inf"), 1, "cpu", "optimizer.lr must be finite"),
        ("optimizer.lr", 0.0, 1, "cpu", "optimizer.lr must be above 0"),
        ("optimizer.lr", "fast", 1, "cpu", "optimizer.lr must be a number"),
        ("optimizer.betas", [0.9, float("nan")], 1, "cpu", "optimizer.betas\\[1\\] must be finite"),
        ("optimizer.weight_decay", -1e40, 1, "cpu", "optimizer.weight_decay is beyond float32's range"),
        ("recipe_args.ce_loss_alpha", 1e39, 1, "cpu", "ce_loss_alpha must be a finite number >= 0 within float32"),
        ("recipe_args.draft_ep_dispatcher", "alltoall", 2, "cpu", "draft_ep_dispatcher must be one of"),
    ],
)
def test_invalid_configs_say_what_to_fix(key, value, world, device, fragment):
    cfg = _tiny_cfg()
    cfg.set_by_dotted(key, value)
    with pytest.raises(ValueError, match=fragment):
        validate_recipe_config(cfg, world, device)


def test_both_distillation_losses_off_is_refused():
    cfg = _tiny_cfg()
    cfg.set_by_dotted("recipe_args.ce_loss_alpha", 0.0)
    cfg.set_by_dotted("recipe_args.l1_loss_alpha", 0.0)
    with pytest.raises(ValueError, match="both 0"):
        validate_recipe_config(cfg, 1, "cpu")


def test_eval_every_steps_needs_held_out_prompts():
    cfg = _tiny_cfg()
    cfg.set_by_dotted("recipe_args.eval_every_steps", 100)
    cfg.set_by_dotted("recipe_args.val_data_path", None)
    with pytest.raises(ValueError, match="eval_every_steps needs held-out prompts"):
        validate_recipe_config(cfg, 1, "cpu")


def test_cp_needs_packing():
    cfg = _tiny_cfg()
    cfg.set_by_dotted("distributed.cp_size", 2)
    cfg.set_by_dotted("recipe_args.packed_sequence_size", 0)
    with pytest.raises(ValueError, match="needs packed batches"):
        validate_recipe_config(cfg, 2, "cpu")


def test_hybridep_without_its_package_is_refused(monkeypatch):
    cfg = load_yaml_config(REPO / "recipes/deepseek_v41/dspark_flash_h200_4node.yaml")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match="HybridEP package"):
        validate_recipe_config(cfg, 32, "cuda")


def test_non_v41_target_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="DeepSeek V4.1 checkpoint"):
        require_v41_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("mask_token_id", 512, r"mask_token_id=512 is outside the target's vocabulary \[0, 512\)"),
        ("target_layer_ids", [1, 3, 6], "names layer 6, but the target has 6 layers"),
    ],
)
def test_keys_indexing_the_target_are_checked_from_its_config(tmp_path, key, value, fragment):
    tiny_target_config().save_pretrained(tmp_path)
    args = {"mask_token_id": 3, "target_layer_ids": None, key: value}
    with pytest.raises(ValueError, match=fragment):
        check_target_contract(str(tmp_path), args)
    check_target_contract(str(tmp_path), {"mask_token_id": 3, "target_layer_ids": [1, 3, 5]})


def test_recipe_subclasses_upstream():
    from nemo_automodel.recipes.llm.train_dspark import TrainDSparkRecipe

    assert issubclass(TrainPackedDSparkV41Recipe, TrainDSparkRecipe)
    # The training loop is upstream's: the plugin only adds a step-0 baseline and the plot around it.
    source = inspect.getsource(TrainPackedDSparkV41Recipe.run_train_validation_loop)
    assert "super().run_train_validation_loop()" in source and "for " not in source


def cli_command(*overrides: str, nproc: int = 1) -> list[str]:
    """The framework CLI on the tiny recipe under torchrun (``make distill``'s launch), ``nproc`` gloo ranks."""
    return torchrun_command(REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml", list(overrides), nproc)


def run_tiny_recipe(workdir: Path, run: str, *overrides: str, nproc: int = 1) -> str:
    """Run the tiny CPU recipe with the framework CLI under torchrun; outputs in ``workdir / run``.

    Returns:
        The run's stdout and stderr.
    """
    assets = workdir / "assets"  # generated by the first run, shared by later ones
    command = cli_command(
        f"--recipe_args.tiny_assets_dir={assets}",
        f"--recipe_args.target_model_name_or_path={assets / 'target'}",
        f"--recipe_args.train_data_path={assets / 'train.jsonl'}",
        f"--recipe_args.output_dir={workdir / run}",
        f"--checkpoint.checkpoint_dir={workdir / run / 'checkpoints'}",
        f"--recipe_args.val_data_path={assets / 'val.jsonl'}",
        "--recipe_args.num_epochs=1",
        "--recipe_args.ckpt_every_steps=60",
        "--recipe_args.log_every_steps=1",
        *overrides,
        nproc=nproc,
    )
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    result = run_until_stalled(command, env=env, cwd=workdir)
    if result.returncode != 0:
        pytest.fail(f"tiny recipe failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result.stdout + result.stderr


def first_conversations(workdir: Path, name: str, count: int) -> Path:
    """``workdir / name``: the first ``count`` conversations of the shared assets' ``train.jsonl``."""
    path = workdir / name
    path.write_text("\n".join((workdir / "assets" / "train.jsonl").read_text().splitlines()[:count]) + "\n")
    return path


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_metrics(run_dir: Path) -> list[dict]:
    """The training records (one per step); validation records carry ``"split": "val"``."""
    return [record for record in read_records(run_dir) if "split" not in record]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted epoch of the tiny recipe, checkpointing every 60 steps."""
    workdir = tmp_path_factory.mktemp("tiny")
    log = run_tiny_recipe(workdir, "full", "--recipe_args.eval_every_steps=100")
    return workdir, log, read_metrics(workdir / "full")


def test_tiny_cpu_run_learns_logs_and_checkpoints(uninterrupted):
    workdir, log, metrics = uninterrupted
    assert [record["step"] for record in metrics] == list(range(1, len(metrics) + 1))
    assert len(metrics) >= 140
    assert all({"step", "loss", "tokens", "tokens_per_s", "ce_loss", "data_checksum"} <= set(r) for r in metrics)
    assert all(later["tokens"] > earlier["tokens"] for earlier, later in zip(metrics, metrics[1:]))
    first = sum(record["loss"] for record in metrics[:20]) / 20
    last = sum(record["loss"] for record in metrics[-20:]) / 20
    assert last < 0.9 * first, (first, last)
    assert "tokens/s" in log and "ETA" in log
    # One progress line per logged step: no tqdm bar, no duplicate upstream line.
    assert log.count(f"step {len(metrics)}/{len(metrics)} |") == 1 and "it/s]" not in log
    assert "| conf " not in log  # upstream's own step line
    evals = [record for record in read_records(workdir / "full") if record.get("split") == "val"]
    assert [record["step"] for record in evals] == [0, 100, len(metrics)]  # step 0: the draft at initialisation
    assert all(1.0 <= record["greedy_tau"] <= 5.0 and "greedy_accept@4" in record for record in evals)
    assert evals[-1]["greedy_agreement"] == 1.0  # the data is the target's own greedy text
    assert "val_loss" in evals[-1] and "val_loss" not in evals[1]  # upstream's epoch-end metrics join the last
    assert evals[0]["greedy_tau"] < 1.2 < evals[1]["greedy_tau"] < evals[-1]["greedy_tau"]
    assert (workdir / "full" / "training_curves.png").stat().st_size > 10_000
    checkpoints = sorted((workdir / "full" / "checkpoints").glob("epoch_*_step_*"))
    assert [path.name for path in checkpoints] == [
        "epoch_0_step_120",
        "epoch_0_step_60",
        f"epoch_1_step_{len(metrics)}",
    ]
    assert all(list((path / "model").glob("*.safetensors")) for path in checkpoints)
    # Each checkpoint records the effective config (the command line's overrides) and the launch folder,
    # and the output folder points at the checkpoints (what the evaluator reads).
    effective = yaml.safe_load((checkpoints[0] / "run_config.yaml").read_text())
    assert effective["recipe_args"]["num_epochs"] == 1  # the YAML says 10; the run was launched with 1
    assert yaml.safe_load((checkpoints[0] / "config.yaml").read_text())["recipe_args"]["num_epochs"] == 10
    assert json.loads((checkpoints[0] / "run.json").read_text())["launch_dir"] == str(workdir)
    pointer = json.loads((workdir / "full" / "run.json").read_text())
    assert pointer["checkpoint_dir"] == str(workdir / "full" / "checkpoints")


def test_resume_matches_the_uninterrupted_run_step_for_step(uninterrupted):
    """Resuming from the step-120 checkpoint replays steps 121.. exactly: same losses, same data."""
    workdir, _, full = uninterrupted
    run_tiny_recipe(workdir, "resumed", f"--checkpoint.restore_from={workdir / 'full/checkpoints/epoch_0_step_120'}")
    resumed = read_metrics(workdir / "resumed")
    assert [record["step"] for record in resumed] == list(range(121, len(full) + 1))
    for record in resumed:
        reference = full[record["step"] - 1]
        # Equal cumulative token counts and data checksums: no batch repeated or skipped.
        assert record["tokens"] == reference["tokens"], record["step"]
        assert record["data_checksum"] == reference["data_checksum"], record["step"]
        assert record["loss"] == pytest.approx(reference["loss"], abs=1e-6), record["step"]


def test_consolidation_of_a_sharded_draft_is_refused_with_the_workaround():
    cfg = _tiny_cfg()
    cfg.set_by_dotted("distributed.strategy", "fsdp2")
    cfg.set_by_dotted("checkpoint.save_consolidated", True)
    with pytest.raises(ValueError, match="save_consolidated: true fails with an FSDP2 draft.*exports"):
        validate_recipe_config(cfg, 2, "cpu", require_packages=False)
    validate_recipe_config(cfg, 1, "cpu", require_packages=False)  # one rank: upstream's export works


def test_bad_yaml_fails_before_writing_anything(tmp_path):
    """A config error stops the CLI run with the fix in the message, before assets or outputs exist."""
    command = cli_command(
        f"--recipe_args.tiny_assets_dir={tmp_path / 'assets'}",
        f"--recipe_args.output_dir={tmp_path / 'run'}",
        "--recipe_args.num_epoch=2",
    )
    result = run_until_stalled(command, cwd=tmp_path)
    assert result.returncode != 0
    assert "unknown recipe_args keys: num_epoch (did you mean num_epochs?)" in result.stdout + result.stderr
    assert not (tmp_path / "assets").exists() and not (tmp_path / "run").exists()


def test_cp2_recipe_run_matches_cp1_step_for_step(uninterrupted):
    """The whole recipe under CP=2 (two gloo ranks, one dp group) trains like CP=1: the same data every step, the
    same loss to float rounding for the first ten steps, and within 0.2% after them.

    CP shards sum the loss in another order, so the weights differ by rounding from the first step; where a
    routing or anchor score is that close to a tie, the two runs take different branches and part slowly. On
    some CPUs that happens inside the epoch: measured on one machine, both this code and the commit before it
    (7edfd92) agree to 4e-7 for 11 steps, then part by 8e-5 at step 12 and 1e-3 by step 15; on others they
    agree to 1e-7 throughout. The exact CP = 1 equality of one step's loss and gradients is pinned by the gloo
    tests of ``tests/models/deepseek_v41/test_cp_draft.py``."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small.jsonl", 300)
    common = (f"--recipe_args.train_data_path={small}", "--recipe_args.micro_batch_size=4")
    run_tiny_recipe(workdir, "cp1", *common)
    run_tiny_recipe(workdir, "cp2", *common, "--distributed.cp_size=2", nproc=2)
    single, sharded = read_metrics(workdir / "cp1"), read_metrics(workdir / "cp2")
    assert len(single) == len(sharded) >= 15
    for one, two in zip(single, sharded, strict=True):
        assert (two["tokens"], two["data_checksum"]) == (one["tokens"], one["data_checksum"])
        tolerance = dict(rel=1e-4, abs=1e-5) if one["step"] <= 10 else dict(rel=2e-3)
        assert two["loss"] == pytest.approx(one["loss"], **tolerance), (one["step"], one["loss"], two["loss"])
    assert list((workdir / "cp2" / "checkpoints").glob("epoch_*_step_*/rng/rng_dp_rank_0.pt"))
    # The greedy acceptance evaluation captures through the CP shard exactly as training does.
    evals = [[r for r in read_records(workdir / run) if r.get("split") == "val"] for run in ("cp1", "cp2")]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] and evals[0]
    for one, two in zip(*evals):
        assert two["greedy_tau"] == pytest.approx(one["greedy_tau"], abs=0.02)
        assert two["greedy_agreement"] == one["greedy_agreement"] == 1.0


def fsdp2_overrides(workdir: Path, cp_size: int, ep_size: int = 1) -> tuple[str, ...]:
    """The two-rank FSDP2 runs' overrides: 300 training conversations, a checkpoint every 5 steps."""
    small = first_conversations(workdir, "small_fsdp2.jsonl", 300)
    return (
        f"--recipe_args.train_data_path={small}",
        f"--distributed.cp_size={cp_size}",
        "--distributed.strategy=fsdp2",
        f"--recipe_args.draft_ep_size={ep_size}",
        "--recipe_args.micro_batch_size=4",
        "--checkpoint.save_consolidated=false",
        "--recipe_args.ckpt_every_steps=5",
    )


@pytest.mark.parametrize(("cp_size", "ep_size"), [(1, 1), (2, 1), (1, 2)], ids=["dp2", "cp2", "ep2"])
def test_fsdp2_draft_trains_and_resumes_exactly(uninterrupted, cp_size, ep_size):
    """The production recipes' FSDP2 draft on two gloo ranks (two dp ranks; one dp group of CP 2 with the
    draft sharded over dp x cp; or two dp ranks with the draft's experts on EP 2): trains, writes one shard
    per rank, exports the released draft, resumes exactly. EP 2 trains step for step like EP 1."""
    workdir, _, _ = uninterrupted
    common = fsdp2_overrides(workdir, cp_size, ep_size)
    run = f"fsdp2_cp{cp_size}" + (f"_ep{ep_size}" if ep_size > 1 else "")
    resumed_run = f"{run}_resumed"
    run_tiny_recipe(workdir, run, *common, nproc=2)
    if ep_size > 1:
        if not (workdir / "fsdp2_cp1" / "metrics.jsonl").exists():
            run_tiny_recipe(workdir, "fsdp2_cp1", *fsdp2_overrides(workdir, 1), nproc=2)
        ep1, ep = read_metrics(workdir / "fsdp2_cp1"), read_metrics(workdir / run)
        assert len(ep1) == len(ep) >= 6
        for one, two in zip(ep1, ep, strict=True):
            assert two["data_checksum"] == one["data_checksum"]
            assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-5), (
                one["step"],
                one["loss"],
                two["loss"],
            )
    checkpoint = workdir / run / "checkpoints" / "epoch_0_step_5"
    assert len(list((checkpoint / "model").glob("shard-*.safetensors"))) == 2  # one shard per rank
    # The run ends with a servable draft (nemo_automodel 0.7.0's own consolidation fails here): the released
    # keys of a one-rank checkpoint, each tensor the rank slices assembled.
    from nemo_automodel_ext.export import read_sharded_draft

    last = Path(resolve_restore_from_to_checkpoint_dir(workdir / run / "checkpoints", "LATEST"))
    exported = load_file(last / "model" / "consolidated" / "model-00001-of-00001.safetensors")
    one_rank = load_file(next((workdir / "full" / "checkpoints").glob("epoch_*/model/consolidated/*.safetensors")))
    assert {key: value.shape for key, value in exported.items()} == {k: v.shape for k, v in one_rank.items()}
    assembled = read_sharded_draft(last / "model")
    assert all(torch.equal(exported[key], assembled[key]) for key in exported)
    # Loaded fresh by the evaluator on one process, the exported draft accepts what the trained draft accepted in
    # the run's own evaluation at that step (both replay every held-out prompt greedily). The two pack the prompts
    # into different rows (the validation loader's, split over the ranks, against the evaluator's), so the
    # features differ by fp32 rounding and a near-tie argmax of the barely trained draft can flip: within 0.005
    # (measured: 3e-4), or under CP (the run's evaluation captured through the CP shards) as CP=1 and CP=2 agree.
    from nemo_automodel_ext.evaluation.cli import evaluate_checkpoints

    step = int(last.name.rsplit("_step_", 1)[1])
    in_run = [r for r in read_records(workdir / run) if r.get("split") == "val" and r["step"] == step]
    assert in_run, f"no in-run evaluation at the exported step {step}"
    report = evaluate_checkpoints(last, output=workdir / run / "exported_eval.json")
    tolerance = {"abs": 0.005} if cp_size == 1 else {"abs": 0.02}
    assert report["greedy"][last.name]["tau"] == pytest.approx(in_run[-1]["greedy_tau"], **tolerance)
    run_tiny_recipe(workdir, resumed_run, *common, f"--checkpoint.restore_from={checkpoint}", nproc=2)
    full, resumed = read_metrics(workdir / run), read_metrics(workdir / resumed_run)
    assert [record["step"] for record in resumed] == list(range(6, len(full) + 1))
    for record in resumed:
        reference = full[record["step"] - 1]
        assert record["data_checksum"] == reference["data_checksum"]
        assert record["loss"] == pytest.approx(reference["loss"], abs=1e-6)


def test_accumulation_reduce_scatters_every_micro_batch_with_the_deferred_sync_s_result(uninterrupted):
    """FSDP2 draft, 2 gloo ranks, 2 micro-batches a step: the plugin's default reduce-scatters each micro-batch
    into sharded gradients (no unsharded fp32 gradients held between micro-batches); upstream's deferred sync
    gives the same losses and the same trained weights."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small_accumulation.jsonl", 640)
    common = (
        f"--recipe_args.train_data_path={small}",
        "--distributed.strategy=fsdp2",
        "--recipe_args.micro_batch_size=4",
        "--recipe_args.grad_accumulation_steps=2",
        "--optimizer.lr=5.0e-3",  # the rate the tolerances below were measured at (AdamW scales rounding noise)
        "--checkpoint.save_consolidated=false",
        "--recipe_args.ckpt_every_steps=5",
    )
    run_tiny_recipe(workdir, "every_micro_batch", *common, nproc=2)
    run_tiny_recipe(workdir, "deferred", *common, "--distributed.defer_fsdp_grad_sync=true", nproc=2)
    ours, deferred = read_metrics(workdir / "every_micro_batch"), read_metrics(workdir / "deferred")
    assert len(ours) == len(deferred) >= 6
    for one, two in zip(ours, deferred):
        assert one["data_checksum"] == two["data_checksum"]
        # Summing reduce-scattered halves, or reduce-scattering the sum: fp32 reassociation only
        # (measured: losses within 2e-6 relative; weights after 5 steps within 7e-8 at 65692e3, and within
        # 1.3e-6 on 2 of 4,096 elements at 866d4f2, whose capture runs some micro-batches in length classes:
        # the same features in both runs, another trajectory. AdamW divides by sqrt(v), so an element whose
        # second moment is near zero turns reassociation noise into a larger update).
        assert one["loss"] == pytest.approx(two["loss"], rel=1e-5)
    shards = sorted((workdir / "every_micro_batch" / "checkpoints" / "epoch_0_step_5" / "model").glob("shard-*"))
    assert len(shards) == 2
    for shard in shards:
        mine, theirs = load_file(shard), load_file(str(shard).replace("every_micro_batch", "deferred"))
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=5e-6)


def test_wandb_section_is_honoured_offline(uninterrupted):
    """A ``wandb:`` section starts a run (offline here) that receives training and greedy-eval metrics."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small_wandb.jsonl", 120)
    run_tiny_recipe(
        workdir,
        "wandb",
        f"--recipe_args.train_data_path={small}",
        "--wandb.mode=offline",
        "--wandb.project=nemo-automodel-ext-test",
        f"--wandb.dir={workdir / 'wandb_dir'}",
    )
    runs = list((workdir / "wandb_dir").rglob("offline-run-*/*.wandb"))
    assert len(runs) == 1, runs
    records = runs[0].read_bytes()  # the offline run's protobuf log: history keys are stored as text
    assert all(key.encode() in records for key in ("train/loss", "val/greedy_tau", "val/loss"))


def _launch(workdir: Path, run: str, *overrides: str, nproc: int = 1, env: dict | None = None):
    """``python -m nemo_automodel_ext.launch`` (``make distill``'s launcher) on the tiny recipe."""
    assets = workdir / "assets"
    command = [
        sys.executable,
        "-m",
        "nemo_automodel_ext.launch",
        "--nproc-per-node",
        str(nproc),
        str(REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml"),
        f"--recipe_args.tiny_assets_dir={assets}",
        f"--recipe_args.target_model_name_or_path={assets / 'target'}",
        f"--recipe_args.val_data_path={assets / 'val.jsonl'}",
        f"--recipe_args.output_dir={workdir / run}",
        f"--checkpoint.checkpoint_dir={workdir / run / 'checkpoints'}",
        *overrides,
    ]
    return run_until_stalled(command, cwd=workdir, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    "case,nproc,fragment",
    [
        ("malformed", 1, "bad.jsonl:3: malformed JSON"),
        ("no_assistant", 1, "bad.jsonl:2: no assistant turn"),
        ("too_small", 2, "gives 1 training rows, fewer than the 2 data-parallel ranks"),
    ],
)
def test_bad_data_is_refused_in_one_last_line_before_any_output(uninterrupted, case, nproc, fragment):
    """The refusal names file, line and rule as the run's very last line; nothing is written to output_dir."""
    workdir, _, _ = uninterrupted
    good = (workdir / "assets" / "train.jsonl").read_text().splitlines()
    lines = {
        "malformed": [*good[:2], '{"messages": [{"role": "user"', *good[2:10]],
        "no_assistant": [good[0], json.dumps({"messages": [{"role": "user", "content": "please copy alpha"}]})],
        "too_small": good[:1],
    }[case]
    bad = workdir / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    result = _launch(workdir, f"bad_{case}", f"--recipe_args.train_data_path={bad}", nproc=nproc)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and fragment in last, result.stderr[-3000:]
    assert not (workdir / f"bad_{case}").exists()


def test_non_finite_loss_stops_the_run_naming_the_step(uninterrupted):
    """NaN in the captured features at step 4: the run stops there; the last checkpoint (step 2) is finite."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small_nan.jsonl", 200)
    assets = workdir / "assets"
    command = torchrun_command(
        REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml",
        [
            f"--recipe_args.tiny_assets_dir={assets}",
            f"--recipe_args.target_model_name_or_path={assets / 'target'}",
            f"--recipe_args.train_data_path={small}",
            "--recipe_args.val_data_path=none",
            "--recipe_args.eval_every_steps=none",
            "--recipe_args.ckpt_every_steps=2",
            "--recipe_args.log_every_steps=1",
            f"--recipe_args.output_dir={workdir / 'nan'}",
            f"--checkpoint.checkpoint_dir={workdir / 'nan' / 'checkpoints'}",
        ],
        entry=[str(Path(__file__).with_name("inject_nan.py"))],
    )
    result = run_until_stalled(command, cwd=workdir, env={**os.environ, "NAN_AT_CAPTURE": "4"})
    assert result.returncode != 0
    assert "error: non-finite DSpark loss at optimizer step 4 (epoch 0)" in result.stdout + result.stderr
    assert "LATEST (epoch_0_step_2) predates this step and its weights are finite" in result.stderr
    checkpoints = sorted(path.name for path in (workdir / "nan" / "checkpoints").glob("epoch_*_step_*"))
    assert checkpoints == ["epoch_0_step_2"]
    from safetensors.torch import load_file

    shards = list((workdir / "nan" / "checkpoints" / "epoch_0_step_2" / "model").glob("*.safetensors"))
    assert shards and all(torch.isfinite(t).all() for shard in shards for t in load_file(shard).values())
    assert [record["step"] for record in read_metrics(workdir / "nan")] == [1, 2, 3]


def test_every_step_is_logged_when_epochs_end_mid_accumulation(uninterrupted):
    """grad_accumulation_steps that do not divide the epoch: the step flushing the partial window is logged too."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small_accumulate.jsonl", 100)
    run_tiny_recipe(
        workdir,
        "accumulate",
        f"--recipe_args.train_data_path={small}",
        "--recipe_args.micro_batch_size=2",
        "--recipe_args.grad_accumulation_steps=4",
        "--recipe_args.num_epochs=2",
        "--recipe_args.val_data_path=none",
        "--recipe_args.eval_every_steps=none",
    )
    records = read_metrics(workdir / "accumulate")
    steps = [record["step"] for record in records]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4
    assert all({"loss", "ce_loss", "tau", "tokens"} <= set(record) for record in records)
    assert records[-1]["epoch"] == 1
    # The same run with validation every 2 steps and at epoch ends: validation batches are not counted.
    run_tiny_recipe(
        workdir,
        "accumulate_val",
        f"--recipe_args.train_data_path={small}",
        "--recipe_args.micro_batch_size=2",
        "--recipe_args.grad_accumulation_steps=4",
        "--recipe_args.num_epochs=2",
        "--recipe_args.eval_every_steps=2",
    )
    with_val = read_metrics(workdir / "accumulate_val")
    assert [(r["step"], r["tokens"], r["data_checksum"]) for r in with_val] == [
        (r["step"], r["tokens"], r["data_checksum"]) for r in records
    ]


def test_a_target_path_that_names_nothing_is_refused_in_one_line(tmp_path):
    from nemo_automodel_ext.run.loading import require_target_path

    with pytest.raises(ValueError, match="target_model_name_or_path=.*nowhere/target does not exist"):
        require_target_path(str(tmp_path / "nowhere" / "target"), "local")
    with pytest.raises(ValueError, match="does not exist"):
        require_target_path("outputs/missing/target", "automodel")  # three parts: not a hub id
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        require_target_path(str(tmp_path / "empty"), "local")
    require_target_path("deepseek-ai/DeepSeek-V4.1-Flash", "automodel")  # a hub id: left to the loader


@pytest.mark.parametrize("key", ["checkpoint.checkpoint_dir", "recipe_args.output_dir"])
def test_a_folder_below_a_file_is_refused_before_the_target_loads(uninterrupted, key):
    """D4/D5: a checkpoint folder below a regular file failed at the first save, after an epoch of training; an
    output folder there failed with a bare NotADirectoryError. Both are refused in one line before any work."""
    workdir, _, _ = uninterrupted
    blocker = workdir / "a_file"
    blocker.write_text("not a folder\n")
    result = _launch(workdir, "below_a_file", f"--{key}={blocker / 'run'}")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {key}={blocker / 'run'}: {blocker} is a file, not a folder"), result.stderr[-3000:]
    assert "V4.1 target:" not in result.stdout + result.stderr  # refused before the target was built
    assert not (workdir / "below_a_file").exists()


@pytest.mark.parametrize("batching", ["dynamic", "grouped"])
def test_token_budget_batchings_train_every_document_once_and_resume_exactly(uninterrupted, batching):
    """``batching: dynamic`` and ``grouped`` (one conversation a row, micro-batches within seq_length x
    micro_batch_size tokens, padded to the batch's longest): one epoch trains each of 300 conversations once, and a
    run resumed from its step-5 checkpoint repeats every later step's loss and data checksum."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small_budget.jsonl", 300)
    common = (
        f"--recipe_args.train_data_path={small}",
        "--recipe_args.packed_sequence_size=0",
        f"--recipe_args.batching={batching}",
        "--recipe_args.ckpt_every_steps=5",
        "--recipe_args.eval_every_steps=none",
    )
    run_tiny_recipe(workdir, batching, *common)
    records = read_metrics(workdir / batching)
    assert records[-1]["documents"] == 300 and len(records) >= 8
    assert records[-1]["captured_tokens"] <= len(records) * 128 * 8  # within the token budget every step
    # Its held-out prompts are packed as the evaluator packs them (run/batching.py), not batched as it trains: the
    # run's own evaluation at its last step is the evaluator's on that checkpoint.
    from nemo_automodel_ext.evaluation.cli import evaluate_checkpoints

    last = Path(resolve_restore_from_to_checkpoint_dir(workdir / batching / "checkpoints", "LATEST"))
    in_run = [r for r in read_records(workdir / batching) if r.get("split") == "val"]
    assert in_run[-1]["step"] == int(last.name.rsplit("_step_", 1)[1])
    report = evaluate_checkpoints(last, output=workdir / batching / "exported_eval.json")
    assert report["greedy"][last.name]["tau"] == pytest.approx(in_run[-1]["greedy_tau"], abs=0.005)
    checkpoint = workdir / batching / "checkpoints" / "epoch_0_step_5"
    run_tiny_recipe(workdir, f"{batching}_resumed", *common, f"--checkpoint.restore_from={checkpoint}")
    resumed = read_metrics(workdir / f"{batching}_resumed")
    assert [record["step"] for record in resumed] == list(range(6, len(records) + 1))
    for record in resumed:
        reference = records[record["step"] - 1]
        assert record["data_checksum"] == reference["data_checksum"]
        assert record["loss"] == pytest.approx(reference["loss"], abs=1e-6)


def test_max_steps_stops_inside_an_epoch_with_its_schedule_and_resumes_there(uninterrupted):
    """``recipe_args.max_steps``: 100 conversations a row each (about 10 steps an epoch at accumulation 2), 3 epochs
    capped at 13 steps. The run stops at step 13 inside its second epoch, on a full window, after its schedule's
    last step (lr at ``min_lr_ratio``), evaluates and checkpoints there; resumed from step 12 it trains step 13
    alone, with the same loss and data."""
    workdir, _, _ = uninterrupted
    small = first_conversations(workdir, "small_capped.jsonl", 100)
    common = (
        f"--recipe_args.train_data_path={small}",
        "--recipe_args.micro_batch_size=1",
        "--recipe_args.grad_accumulation_steps=2",
        "--recipe_args.num_epochs=3",
        "--recipe_args.max_steps=13",
        "--recipe_args.ckpt_every_steps=12",
        "--optimizer.warmup_ratio=0",  # one warmup step (upstream floors a ratio's warmup at 20 steps)
    )
    run_tiny_recipe(workdir, "capped", *common)
    records = read_metrics(workdir / "capped")
    assert [record["step"] for record in records] == list(range(1, 14))
    assert records[-1]["epoch"] == 1 and records[0]["epoch"] == 0
    # the schedule ends at the YAML's lr x min_lr_ratio on step 13: planned for the 13 steps, not the epochs' 30
    assert records[-1]["lr"] == pytest.approx(1.5e-2 * 0.1) and records[-2]["lr"] > 1.5e-2 * 0.1
    evals = [record for record in read_records(workdir / "capped") if record.get("split") == "val"]
    assert evals[-1]["step"] == 13
    checkpoints = {path.name for path in (workdir / "capped" / "checkpoints").glob("epoch_*_step_*")}
    assert "epoch_1_step_12" in checkpoints and any(name.endswith("_step_13") for name in checkpoints), checkpoints
    run_tiny_recipe(
        workdir,
        "capped_resumed",
        *common,
        f"--checkpoint.restore_from={workdir / 'capped/checkpoints/epoch_1_step_12'}",
    )
    resumed = read_metrics(workdir / "capped_resumed")
    assert [record["step"] for record in resumed] == [13]
    assert resumed[0]["data_checksum"] == records[-1]["data_checksum"]
    assert resumed[0]["loss"] == pytest.approx(records[-1]["loss"], abs=1e-6)
