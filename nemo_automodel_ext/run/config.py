"""Configuration of the packed V4.1 DSpark recipe: every ``recipe_args`` key, and its validation.

``validate_recipe_config`` runs before anything is built or written: an unknown key, a missing
required key or an impossible layout stops the run with a ValueError naming the key and the fix.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
from typing import Any

from nemo_automodel_ext.models.deepseek_v41.expert_dispatch import DISPATCHERS
from nemo_automodel_ext.run.batching import BATCHINGS, resolve_batching

#: Every recipe_args key this recipe reads, with its default (None: required or optional).
RECIPE_ARGS: dict[str, Any] = {
    "target_model_name_or_path": None,
    "tiny_assets_dir": None,
    "trust_remote_code": False,
    "target_builder": "automodel",
    "target_attn_backend": "tilelang",
    "target_dispatcher": "hybridep",
    "target_experts": "torch_mm",
    "target_enable_fsdp_optimizations": True,
    "draft_attn_backend": "sdpa",
    "draft_ep_size": 1,
    "draft_ep_dispatcher": "all_to_all",
    "chat_template": None,
    "train_data_path": None,
    "val_data_path": None,
    "train_split": None,
    "val_split": None,
    "seq_length": None,
    "packed_sequence_size": 0,
    "batching": None,
    "tokens_per_micro_batch": None,
    "micro_batch_size": 1,
    "num_workers": 0,
    "num_epochs": 1,
    "max_steps": None,
    "shuffle_seed": 42,
    "mask_reasoning_content": False,
    "mask_generation_prompt": False,
    "draft_num_hidden_layers": None,
    "target_layer_ids": None,
    "block_size": None,
    "num_anchors": 512,
    "num_anchors_per_document": None,
    "max_anchors_per_row": None,
    "mask_token_id": None,
    "markov_rank": None,
    "markov_head_type": "vanilla",
    "confidence_head_alpha": 1.0,
    "confidence_head_with_markov": True,
    "confidence_head_stop_gradient": False,
    "freeze_embeddings": True,
    "loss_decay_gamma": None,
    "ce_loss_alpha": 0.1,
    "l1_loss_alpha": 0.9,
    "grad_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "log_every_steps": 10,
    "eval_every_steps": None,
    "ckpt_every_steps": None,
    "save_checkpoint_every_epoch": False,
    "output_dir": None,
}
TARGET_BUILDERS = ("local", "automodel")
MARKOV_HEAD_TYPES = ("vanilla",)  # the released V4.1 draft's head (upstream refuses others)
#: Integer keys and their smallest allowed value (None also allowed where the default is None).
INTEGER_KEYS = {
    "seq_length": 1,
    "packed_sequence_size": 0,
    "tokens_per_micro_batch": 1,
    "micro_batch_size": 1,
    "num_workers": 0,
    "num_epochs": 1,
    "max_steps": 1,
    "grad_accumulation_steps": 1,
    "log_every_steps": 1,
    "ckpt_every_steps": 1,
    "eval_every_steps": 1,
    "num_anchors": 1,
    "num_anchors_per_document": 1,
    "max_anchors_per_row": 1,
    "block_size": 1,
    "markov_rank": 1,
    "draft_num_hidden_layers": 1,
    "draft_ep_size": 1,
    "mask_token_id": 0,
    "shuffle_seed": 0,
}
LOSS_WEIGHTS = ("ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha")
#: Choice keys and their allowed values (upstream's BackendConfig names).
CHOICES = {
    "target_dispatcher": ("torch", "deepep", "hybridep", "uccl_ep", "mok"),
    "target_experts": ("torch", "torch_mm", "te", "gmm", "torch_mm_mxfp8"),
    "target_attn_backend": ("eager", "sdpa", "tilelang", "te", "flex", "torch"),
    "draft_attn_backend": ("eager", "sdpa", "flex", "te", "torch"),
    "draft_ep_dispatcher": DISPATCHERS,
    "batching": (None, *BATCHINGS),
}
#: The largest finite float32: float settings beyond it overflow the optimizer's float32 state.
FLOAT32_MAX = 3.4028234663852886e38
#: Seeds feed numpy (StatefulRNG seeds it with shuffle_seed + dp rank), which takes 32-bit seeds.
MAX_SEED = 2**32 - 1


def section_get(section: Any, key: str, default: Any = None) -> Any:
    """``section[key]`` of an optional config section, ``default`` when either is missing."""
    return section.get(key, default) if section is not None else default


def validate_recipe_config(
    cfg: Any, world_size: int | None, device_type: str, require_packages: bool = True
) -> dict[str, Any]:
    """Check a packed V4.1 DSpark config before anything is built.

    Args:
        cfg: The loaded ``ConfigNode``.
        world_size: Number of ranks of the run; None checks the config alone, not its parallel layout
            against a rank count (the evaluator reloads a run's checkpoint on one process).
        device_type: ``"cuda"`` or ``"cpu"``.
        require_packages: Also check that optional packages the config needs (HybridEP) import.

    Returns:
        ``recipe_args`` as a plain dict with defaults filled in.

    Raises:
        ValueError: naming the key and what to change: unknown keys, missing required keys,
            impossible parallel sizes, a dispatcher or backend that cannot run here.
    """
    section = cfg.get("recipe_args", None)
    if section is None:
        raise ValueError("the config needs a recipe_args section")
    raw = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    unknown = sorted(set(raw) - set(RECIPE_ARGS))
    if unknown:
        hints = [
            f"{key} (did you mean {match[0]}?)" if (match := difflib.get_close_matches(key, RECIPE_ARGS, 1)) else key
            for key in unknown
        ]
        raise ValueError(f"unknown recipe_args keys: {', '.join(hints)}")
    args = {**RECIPE_ARGS, **raw}
    for key in ("target_model_name_or_path", "train_data_path", "seq_length", "output_dir", "mask_token_id"):
        if args[key] is None:
            raise ValueError(f"recipe_args.{key} is required")
    _validate_numbers(args)
    validate_optimizer(cfg.get("optimizer", None))
    if args["target_builder"] not in TARGET_BUILDERS:
        raise ValueError(f"recipe_args.target_builder must be one of {TARGET_BUILDERS}, got {args['target_builder']!r}")
    if args["target_builder"] == "automodel" and device_type != "cuda":
        raise ValueError(
            "recipe_args.target_builder=automodel loads the target with EP/FSDP and needs CUDA; "
            "on CPU use target_builder: local with a CPU backend (target_attn_backend: eager, target_dispatcher: torch)"
        )
    packed = int(args["packed_sequence_size"] or 0)
    if packed < 0 or (packed and packed > int(args["seq_length"])):
        raise ValueError(
            f"recipe_args.packed_sequence_size must be 0 (off) or in [1, seq_length={args['seq_length']}], got {packed}"
        )
    batching = resolve_batching(args)
    if (batching == "packed") != bool(packed):
        raise ValueError(
            f"recipe_args.batching={batching} "
            + (
                "needs recipe_args.packed_sequence_size > 0 (the row width)"
                if batching == "packed"
                else f"batches one conversation a row: set recipe_args.packed_sequence_size: 0 (got {packed})"
            )
        )
    budget = args["tokens_per_micro_batch"]
    if budget is not None and batching not in ("dynamic", "grouped"):
        raise ValueError(f"recipe_args.tokens_per_micro_batch is for batching: dynamic or grouped (got {batching})")
    if budget is not None and budget < int(args["seq_length"]):
        raise ValueError(
            f"recipe_args.tokens_per_micro_batch={budget} must hold one conversation of seq_length="
            f"{args['seq_length']} tokens"
        )
    args["batching"] = batching
    if args["eval_every_steps"] is not None and args["val_data_path"] is None:
        raise ValueError("recipe_args.eval_every_steps needs held-out prompts: set recipe_args.val_data_path")
    distributed = cfg.get("distributed", None)
    cp_size = section_get(distributed, "cp_size", 1)
    cp_size = 1 if cp_size is None else cp_size
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"distributed.cp_size must be an integer >= 1, got {cp_size!r}")
    for axis in ("tp_size", "pp_size"):
        if int(section_get(distributed, axis, 1) or 1) != 1:
            raise ValueError(f"distributed.{axis} must be 1 for DSpark (one non-pipelined target forward per rank)")
    if world_size is not None and world_size % cp_size:
        raise ValueError(f"distributed.cp_size={cp_size} must divide the number of ranks ({world_size})")
    if cp_size > 1 and not packed:
        raise ValueError(
            "distributed.cp_size > 1 needs packed batches: set recipe_args.packed_sequence_size > 0 (batching: packed)"
        )
    if cp_size > 1 and int(args["seq_length"]) < cp_size:
        raise ValueError(f"recipe_args.seq_length={args['seq_length']} is shorter than distributed.cp_size={cp_size}")
    dispatcher = args["target_dispatcher"]
    if dispatcher == "hybridep":
        if device_type != "cuda":
            raise ValueError(
                "target_dispatcher=hybridep needs CUDA GPUs; on CPU set recipe_args.target_dispatcher: torch"
            )
        if require_packages and importlib.util.find_spec("deep_ep") is None:
            raise ValueError(
                "target_dispatcher=hybridep needs the HybridEP package (deep_ep with HybridEPBuffer); install it or "
                "set recipe_args.target_dispatcher: deepep or torch"
            )
    if device_type != "cuda" and args["target_attn_backend"] == "tilelang":
        raise ValueError("target_attn_backend=tilelang needs CUDA; on CPU set recipe_args.target_attn_backend: eager")
    strategy = str(section_get(distributed, "strategy", "ddp")).lower()
    if strategy not in ("ddp", "fsdp2"):
        raise ValueError(f"distributed.strategy must be ddp or fsdp2, got {strategy!r}")
    require_target_reshard(section_get(distributed, "reshard_after_forward", None))
    if (
        strategy == "fsdp2"
        and (world_size or 1) > 1
        and section_get(cfg.get("checkpoint", None), "save_consolidated", False)
    ):
        raise ValueError(
            "checkpoint.save_consolidated: true fails with an FSDP2 draft on more than one rank in nemo_automodel "
            "0.7.0 (KeyError on the split expert keys while writing the index); set it false: the recipe exports "
            "the last checkpoint's draft itself (python -m nemo_automodel_ext.export RUN for any other)"
        )
    draft_ep = int(args["draft_ep_size"])
    if draft_ep > 1 and world_size is not None and world_size % draft_ep:
        raise ValueError(
            f"recipe_args.draft_ep_size={draft_ep} places the draft's experts on groups of that many ranks: it must "
            f"divide the number of ranks ({world_size})" + ("; set it to 1 on one rank" if world_size == 1 else "")
        )
    if draft_ep > 1 and strategy != "fsdp2":
        raise ValueError(
            f"recipe_args.draft_ep_size={draft_ep} places the draft's experts on groups of that many ranks: it needs "
            f"distributed.strategy: fsdp2 (got {strategy})"
        )
    defer = section_get(distributed, "defer_fsdp_grad_sync", False)
    if not isinstance(defer, bool):
        raise ValueError(f"distributed.defer_fsdp_grad_sync must be true or false, got {defer!r}")
    args["defer_fsdp_grad_sync"] = defer
    return args


def _float_rule(value: Any) -> str | None:
    """Why ``value`` cannot be a float setting of the run (None when it can): not a number, not finite, or
    beyond float32's range (the optimizer's state and the scheduled learning rate are float32 tensors)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number"
    if not math.isfinite(value):
        return "must be finite"
    if abs(value) > FLOAT32_MAX:
        return f"is beyond float32's range (|x| <= {FLOAT32_MAX:.4g})"
    return None


def validate_optimizer(section: Any) -> None:
    """Refuse an ``optimizer`` section whose numbers cannot train: every number (and every entry of a
    list such as ``betas``) finite and within float32's range, ``lr`` above 0.

    Raises:
        ValueError: naming the key, its value and the rule.
    """
    if section is None:
        return
    raw = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    if "lr" in raw and (rule := _float_rule(raw["lr"])) is not None:
        raise ValueError(f"optimizer.lr {rule}, got {raw['lr']!r}")
    for key, value in raw.items():
        if key.startswith("_") or isinstance(value, (str, bool, type(None), dict)):
            continue  # the class path and switches (foreach, fused, amsgrad)
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, item in items:
            rule = _float_rule(item)
            if rule is not None:
                name = f"optimizer.{key}" + (f"[{index}]" if index is not None else "")
                raise ValueError(f"{name} {rule}, got {item!r}")
    if "lr" in raw and not raw["lr"] > 0:
        raise ValueError(f"optimizer.lr must be above 0, got {raw['lr']!r}")


def require_target_reshard(value: Any) -> None:
    """Refuse ``distributed.reshard_after_forward: false``: the frozen target would never re-shard."""
    if value is False:
        raise ValueError(
            "distributed.reshard_after_forward: false keeps the frozen DSpark target's gathered FSDP2 parameters "
            "on every rank after its first forward (it never runs a backward to free them); remove the key or "
            "set it to true"
        )


def _validate_numbers(args: dict[str, Any]) -> None:
    """Every integer, loss-weight and choice key of ``recipe_args``: a ValueError naming the first bad one."""
    for key, minimum in INTEGER_KEYS.items():
        value = args[key]
        if value is None and RECIPE_ARGS[key] is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"recipe_args.{key} must be an integer >= {minimum}, got {value!r}")
    for key in (*LOSS_WEIGHTS, "max_grad_norm", "loss_decay_gamma"):
        value = args[key]
        if value is None and key in ("max_grad_norm", "loss_decay_gamma"):
            continue
        if _float_rule(value) is not None or value < 0:
            raise ValueError(f"recipe_args.{key} must be a finite number >= 0 within float32's range, got {value!r}")
    if args["max_grad_norm"] == 0:
        raise ValueError(
            "recipe_args.max_grad_norm=0 clips every gradient to zero, so nothing would train; set a positive norm, "
            "or null to switch clipping off (upstream's convention)"
        )
    if args["shuffle_seed"] > MAX_SEED:
        raise ValueError(
            f"recipe_args.shuffle_seed must be at most {MAX_SEED} (a 32-bit seed), got {args['shuffle_seed']}"
        )
    for key, allowed in CHOICES.items():
        if args[key] not in allowed:
            raise ValueError(f"recipe_args.{key} must be one of {allowed}, got {args[key]!r}")
    for key in ("chat_template", "train_split", "val_split"):
        if args[key] is not None and not isinstance(args[key], str):
            raise ValueError(f"recipe_args.{key} must be a string (or null), got {args[key]!r}")
    for key in ("target_model_name_or_path", "train_data_path", "output_dir", "val_data_path", "tiny_assets_dir"):
        if args[key] is not None and not (isinstance(args[key], str) and args[key]):
            raise ValueError(f"recipe_args.{key} must be a path string, got {args[key]!r}")
    if args["ce_loss_alpha"] == 0 and args["l1_loss_alpha"] == 0:
        raise ValueError("recipe_args.ce_loss_alpha and l1_loss_alpha are both 0: the draft would learn nothing")
    if args["markov_head_type"] not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"recipe_args.markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {args['markov_head_type']!r}"
        )
    layers = args["target_layer_ids"]
    if layers is not None:
        layers = list(layers) if isinstance(layers, (list, tuple)) else None
        if not layers or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers):
            raise ValueError(
                f"recipe_args.target_layer_ids must be a non-empty list of integers, got {args['target_layer_ids']!r}"
            )
        if any(later <= earlier for earlier, later in zip(layers, layers[1:])) or layers[0] < 0:
            raise ValueError(f"recipe_args.target_layer_ids must be strictly increasing layer ids >= 0, got {layers}")


__all__ = [
    "RECIPE_ARGS",
    "TARGET_BUILDERS",
    "require_target_reshard",
    "section_get",
    "validate_optimizer",
    "validate_recipe_config",
]
