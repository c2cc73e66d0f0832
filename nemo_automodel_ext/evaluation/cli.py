"""``python -m nemo_automodel_ext.evaluation RUN_OR_CHECKPOINT``: acceptance of a trained draft.

Reads the run's own config (``config.yaml`` saved in every checkpoint), rebuilds its target and
draft, and evaluates on held-out prompts (``recipe_args.val_data_path``, or ``--data``):

- the draft **at initialisation** (the recipe's seed, embeddings and head copied from the
  target), as the baseline;
- each checkpoint given (default: the run's latest complete one).

It prints one table (tau, acceptance at every block slot, verify rounds, target tokens) and
writes ``eval.json`` beside the checkpoints. Greedy verification is replayed exactly
(``acceptance.greedy_replay``); ``--temperature T`` adds sampling verification at T.

Targets built by ``target_builder: local`` load in this process. A Flash target needs the
recipe's EP/FSDP layout: evaluate it inside the run (``recipe_args.eval_every_steps``), which
uses the training capture path under CP and HybridEP.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_automodel_ext.evaluation.acceptance import evaluate_greedy, sampled_decode, sampling_width
from nemo_automodel_ext.evaluation.sequences import EvalSequence, pack_sequences, read_eval_sequences
from nemo_automodel_ext.export import read_draft
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend
from nemo_automodel_ext.quiet import quiet_sglang_warning
from nemo_automodel_ext.run.batching import evaluation_row_width
from nemo_automodel_ext.run.config import validate_recipe_config
from nemo_automodel_ext.run.draft_checkpoint import check_draft_structure, released_draft_shapes
from nemo_automodel_ext.run.loading import (
    build_packed_draft,
    check_target_contract,
    load_local_target,
    require_target_path,
)
from nemo_automodel_ext.run.paths import require_writable_folder
from nemo_automodel_ext.run.run_record import load_run_record, resolve_checkpoint, resolve_run_paths


@dataclass
class EvalRun:
    """What a checkpoint's run config builds: the frozen target, its tokenizer and the draft recipe."""

    args: dict
    target: DeepseekV41DSparkTargetModel
    tokenizer: object
    layer_ids: list[int]
    block_size: int
    mask_token_id: int


def load_run(checkpoint: Path, device: torch.device, target_path: str | None = None) -> EvalRun:
    """Rebuild a checkpoint's target, tokenizer and draft settings from its ``config.yaml``."""
    from nemo_automodel._transformers.auto_tokenizer import NeMoAutoTokenizer
    from nemo_automodel.components.speculative.dspark.target_utils import apply_target_chat_template

    cfg, launch_dir, _ = load_run_record(checkpoint)
    # The run's own rank count does not matter here: its draft is reloaded whole on this process.
    args = resolve_run_paths(validate_recipe_config(cfg, None, device.type, require_packages=False), launch_dir)
    if args["target_builder"] != "local" and target_path is None:
        raise ValueError(
            f"{checkpoint}: recipe_args.target_builder={args['target_builder']} needs the recipe's EP/FSDP layout; "
            "evaluate inside the run with recipe_args.eval_every_steps, or pass --target with a local target folder"
        )
    path = target_path or str(args["target_model_name_or_path"])
    require_target_path(path, "local")
    quiet_sglang_warning()  # a local target, never served on SGLang (here or through main() alike)
    backend = cpu_backend(
        attn=args["target_attn_backend"] if args["target_builder"] == "local" else "eager",
        dispatcher=args["target_dispatcher"] if args["target_builder"] == "local" else "torch",
        experts=args["target_experts"],
    )
    check_target_contract(path, args)  # mask token and feature layers inside this target
    model = load_local_target(path, backend, device, torch.float32)
    text = model.config.text_config
    layer_ids = list(args["target_layer_ids"] or text.dspark_target_layer_ids)
    tokenizer = NeMoAutoTokenizer.from_pretrained(path)
    apply_target_chat_template(tokenizer, args["chat_template"])
    return EvalRun(
        args,
        DeepseekV41DSparkTargetModel(model, layer_ids),
        tokenizer,
        layer_ids,
        int(args["block_size"] or text.dspark_block_size),
        int(args["mask_token_id"]),
    )


def build_draft(run: EvalRun, checkpoint: Path | None) -> DeepseekV41PackedDSparkModel:
    """The run's draft at initialisation (``checkpoint`` None) or with a checkpoint's weights.

    Raises:
        ValueError: when the checkpoint was trained for another target or draft shape (vocab,
            feature layers, block size), naming the tensor or setting that differs.
    """
    text = run.target.model.config.text_config
    torch.manual_seed(int(run.args["shuffle_seed"]))  # the recipe's initialisation
    architectures = list(run.target.model.config.architectures or ["DeepseekV41ForCausalLM"])
    draft = build_packed_draft(
        run.args, text, architectures, run.layer_ids, run.block_size, int(run.args["num_anchors"]), run.mask_token_id
    )
    draft.initialize_embeddings_and_head(
        embed_tokens=run.target.get_input_embeddings(), lm_head=run.target.get_output_embeddings()
    )
    if checkpoint is not None:
        load_draft_weights(draft, checkpoint, run)
    return draft.to(next(run.target.model.parameters()).device).eval()


def load_draft_weights(draft: DeepseekV41PackedDSparkModel, checkpoint: Path, run: EvalRun) -> None:
    """Load a checkpoint's draft weights (consolidated export preferred, else the per-rank files assembled)."""
    meta_path = checkpoint / "dspark_meta.pt"
    if meta_path.exists():
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
        for key, ours in (("block_size", run.block_size), ("target_layer_ids", run.layer_ids)):
            if key in meta and list(meta[key] if isinstance(meta[key], list) else [meta[key]]) != list(
                ours if isinstance(ours, list) else [ours]
            ):
                raise ValueError(f"{checkpoint}: the draft was trained with {key}={meta[key]}, the target uses {ours}")
    state = read_draft(checkpoint / "model")  # consolidated, else every rank's slices assembled
    adapter = getattr(draft, "state_dict_adapter", None)
    if adapter is not None and not set(state) <= set(draft.state_dict()):
        # The released layout: its structure (layers, experts a layer) and shapes checked before upstream's
        # adapter reads it, which refuses a missing expert with a traceback of its own.
        shapes = {key: tuple(value.shape) for key, value in state.items()}
        check_draft_structure(shapes, released_draft_shapes(draft), str(checkpoint))
        state = adapter.from_hf(state)
    ours = draft.state_dict()
    unknown = sorted(set(state) - set(ours))
    if unknown:
        raise ValueError(f"{checkpoint}: tensors the draft does not have: {unknown[:4]}")
    vocab = run.target.model.config.text_config.vocab_size
    for key, tensor in state.items():
        if tuple(tensor.shape) == tuple(ours[key].shape):
            continue
        if tensor.dim() and ours[key].shape[0] == vocab and tensor.shape[0] != vocab:
            raise ValueError(
                f"{checkpoint}: {key} has {tensor.shape[0]} rows but the target's vocabulary has {vocab} tokens "
                "(vocabulary differs): the draft was trained for another target"
            )
        raise ValueError(
            f"{checkpoint}: {key} is {list(tensor.shape)} in the checkpoint but {list(ours[key].shape)} for this "
            "target (shape differs): the draft was trained for another target or draft config"
        )
    # The embedding and head are copied from the target (initialize_embeddings_and_head) when not saved.
    missing = [key for key in sorted(set(ours) - set(state)) if key not in ("embed_tokens.weight", "lm_head.weight")]
    if missing:
        raise ValueError(f"{checkpoint}: draft tensors missing from the checkpoint: {missing[:4]}")
    draft.load_state_dict(state, strict=False)


def evaluation_sequences(run: EvalRun, data: str | None, limit: int | None) -> tuple[str, list[EvalSequence]]:
    """Held-out prompts and their (target-regenerated) answers: ``data`` or the run's ``val_data_path``."""
    path = data or run.args["val_data_path"]
    if path is None:
        raise ValueError("no evaluation prompts: the run has no recipe_args.val_data_path; pass --data FILE.jsonl")
    if Path(path).is_dir():
        raise ValueError(f"evaluation data {path} is a folder; pass a JSON or JSONL file of conversations")
    if not Path(path).is_file():
        raise ValueError(f"evaluation data {path} does not exist")
    sequences = read_eval_sequences(path, run.tokenizer, limit)
    if not sequences:
        raise ValueError(f"{path} holds no prompts to evaluate")
    return str(path), sequences


def check_options(limit: int | None, temperature: float, max_new_tokens: int, device: str) -> None:
    """Refuse evaluation options that cannot mean what they say, before anything is loaded."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1 (prompts to evaluate), got {limit}")
    if not temperature >= 0 or temperature != temperature:
        raise ValueError(f"--temperature must be >= 0 (0: greedy only), got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device name (cpu, cuda, cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch build or machine has no CUDA device; use --device cpu")


def resolve_named_checkpoint(name: str | Path, latest: Path) -> Path:
    """A ``--checkpoint`` value: a folder path, or a checkpoint name (``epoch_N_step_M``) of the run."""
    if Path(name).exists():
        return resolve_checkpoint(name)
    sibling = latest.parent / str(name)
    if sibling.exists():
        return resolve_checkpoint(sibling)
    raise ValueError(f"--checkpoint {name}: neither a folder nor a checkpoint of the run under {latest.parent}")


def row_names(checkpoints: list[Path]) -> dict[str, Path]:
    """One table row per checkpoint: its name, or ``run/name`` when two share a name."""
    names = [checkpoint.name for checkpoint in checkpoints]
    rows: dict[str, Path] = {}
    for checkpoint in checkpoints:
        name = checkpoint.name
        if names.count(name) > 1:
            name = f"{checkpoint.parent.parent.name or checkpoint.parent.name}/{name}"
        while name in rows:
            name += "'"
        rows[name] = checkpoint
    return rows


def format_table(results: dict[str, dict], block_size: int) -> str:
    """A fixed-width table of ``AcceptanceStats.summary()`` rows."""
    header = ["draft", "tau", *[f"acc@{k + 1}" for k in range(block_size)], "rounds", "target tokens"]
    rows = [header]
    for name, summary in results.items():
        rows.append(
            [
                name,
                f"{summary['tau']:.2f}",
                *[f"{rate:.2f}" if rate == rate else "-" for rate in summary["acceptance"]],  # nan: never reached
                str(summary["rounds"]),
                str(summary["committed_tokens"]),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def evaluate_checkpoints(
    path: str | Path,
    checkpoints: list[str] | None = None,
    data: str | None = None,
    limit: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    output: str | Path | None = None,
    target_path: str | None = None,
    device: str = "cpu",
    init: bool = True,
) -> dict:
    """Evaluate the untrained draft (``init``) and each checkpoint; print the table, write ``eval.json``.

    Returns:
        The ``eval.json`` content.
    """
    check_options(limit, temperature, max_new_tokens, device)
    latest = resolve_checkpoint(path)
    chosen = [resolve_named_checkpoint(each, latest) for each in checkpoints] if checkpoints else [latest]
    output = Path(output) if output else latest.parent / "eval.json"
    if output.is_dir():
        raise ValueError(f"--output {output} is a folder; pass the file to write, e.g. {output / 'eval.json'}")
    require_writable_folder(output.parent, "--output")  # a file where a folder should be, or no write access
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: the folder {output.parent} does not exist")
    run = load_run(latest, torch.device(device), target_path)
    data_path, sequences = evaluation_sequences(run, data, limit)
    width = evaluation_row_width(run.args)
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    batches = pack_sequences(sequences, width, 8, pad)
    drafts = {**({"untrained (init)": None} if init else {}), **row_names(chosen)}
    built = {name: build_draft(run, checkpoint) for name, checkpoint in drafts.items()}  # every file read first
    results, sampled = {}, {}
    for name, draft in built.items():
        results[name] = evaluate_greedy(run.target, draft, batches).summary()
        if temperature > 0:
            sampled[name] = sampled_decode(
                run.target,
                draft,
                [sequence.prompt for sequence in sequences],
                temperature,
                seed,
                max_new_tokens,
                run.tokenizer.eos_token_id,
                width=sampling_width(width, max_new_tokens),
            ).summary()
    agreement = next(iter(results.values()))["agreement"]
    print(
        f"acceptance of {latest.parent.parent.name or latest} on {len(sequences)} held-out prompts ({data_path}); "
        f"greedy verification replayed exactly, block {run.block_size}; the answers follow the target's greedy "
        f"path for {100 * agreement:.1f}% of their tokens"
    )
    print(format_table(results, run.block_size))
    if sampled:
        print(f"\nsampling verification at temperature {temperature}, seed {seed}, {max_new_tokens} new tokens")
        print(format_table(sampled, run.block_size))
    report = {
        "checkpoints": {name: str(checkpoint) if checkpoint else None for name, checkpoint in drafts.items()},
        "data": data_path,
        "prompts": len(sequences),
        "block_size": run.block_size,
        "greedy": results,
        "sampled": {"temperature": temperature, "seed": seed, "results": sampled} if sampled else None,
    }
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_automodel_ext.evaluation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", help="a run's output or checkpoint folder, or one checkpoint (epoch_*_step_*)")
    parser.add_argument("--checkpoint", action="append", help="checkpoint(s) to evaluate (default: the latest)")
    parser.add_argument("--data", help="JSONL of held-out conversations (default: recipe_args.val_data_path)")
    parser.add_argument("--limit", type=int, help="evaluate at most this many prompts")
    parser.add_argument("--temperature", type=float, default=0.0, help="also run sampling verification at this T")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling verification")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="generation limit of sampling verification")
    parser.add_argument("--target", help="evaluate against this local target folder instead of the run's")
    parser.add_argument("--output", help="where to write eval.json (default: beside the checkpoints)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--no-init", dest="init", action="store_false", help="leave out the untrained draft (the checkpoints only)"
    )
    options = parser.parse_args(argv)
    try:
        evaluate_checkpoints(
            options.path,
            options.checkpoint,
            options.data,
            options.limit,
            options.temperature,
            options.seed,
            options.max_new_tokens,
            options.output,
            options.target,
            options.device,
            options.init,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


__all__ = ["build_draft", "evaluate_checkpoints", "format_table", "load_run", "main", "resolve_checkpoint"]
