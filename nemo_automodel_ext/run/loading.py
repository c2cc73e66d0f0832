"""Loading what a run of the packed V4.1 DSpark recipe trains on: its target (checked) and its draft.

The recipe builds with these; the evaluator rebuilds a finished run with the same ones. Each takes
validated ``recipe_args`` (``config.validate_recipe_config``) and returns one object.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from nemo_automodel.components.models.common.utils import cast_model_to_dtype
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41DSparkConfig
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.speculative.dspark.target_utils import DEEPSEEK_V41_MODEL_TYPE, read_target_model_type
from safetensors.torch import load_file

from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend
from nemo_automodel_ext.registry import resolve_dspark_draft


def require_target_path(path: str, builder: str) -> None:
    """Refuse a target path that names nothing: a missing local folder, or one without ``config.json``.

    A Hugging Face id (``org/name``, not a local path) is left to the hub loader unless
    ``builder`` is ``local``, which reads local folders only.
    """
    local = pathlib.Path(path)
    hub_like = path.count("/") == 1 and not path.startswith((".", "/", "~")) and all(path.split("/"))
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"recipe_args.target_model_name_or_path={path} has no config.json: not a model folder")
        return
    if builder == "local" or not hub_like:
        raise ValueError(
            f"recipe_args.target_model_name_or_path={path} does not exist"
            + (
                " (target_builder: local reads a local folder with config.json + model.safetensors)"
                if builder == "local"
                else ""
            )
        )


def require_v41_checkpoint(path: str, trust_remote_code: bool = False) -> None:
    """Raise a ValueError unless ``path`` holds a DeepSeek V4.1 config (``model_type`` deepseek_v41)."""
    model_type = read_target_model_type(path, trust_remote_code)
    if model_type != DEEPSEEK_V41_MODEL_TYPE:
        raise ValueError(
            f"recipe_args.target_model_name_or_path must be a DeepSeek V4.1 checkpoint "
            f"(model_type {DEEPSEEK_V41_MODEL_TYPE!r}), got model_type {model_type!r} at {path}; "
            "use nemo_automodel.recipes.llm.train_dspark.TrainDSparkRecipe for other targets"
        )


def target_text_config(path: str):
    """The target's ``DeepseekV41TextConfig``, read from its ``config.json`` only (no weights)."""
    return DeepseekV41Config.from_pretrained(path, vision_config={"num_hidden_layers": 0}).text_config


def check_target_contract(path: str, args: dict[str, Any]) -> None:
    """Check the keys that index the target (its ``config.json`` only) before anything is built.

    Raises:
        ValueError: ``recipe_args.mask_token_id`` outside the target's vocabulary, or a
            ``recipe_args.target_layer_ids`` entry the target does not have.
    """
    text = target_text_config(path)
    if not 0 <= int(args["mask_token_id"]) < text.vocab_size:
        raise ValueError(
            f"recipe_args.mask_token_id={args['mask_token_id']} is outside the target's vocabulary "
            f"[0, {text.vocab_size}) ({path})"
        )
    layers = list(args["target_layer_ids"] or ())
    if layers and layers[-1] >= text.num_hidden_layers:
        raise ValueError(
            f"recipe_args.target_layer_ids={layers} names layer {layers[-1]}, but the target has "
            f"{text.num_hidden_layers} layers ({path})"
        )


def load_local_target(path: str | pathlib.Path, backend, device: torch.device, dtype: torch.dtype):
    """Build a V4.1 target from ``config.json`` + ``model.safetensors`` in ``path`` (no hub access).

    Args:
        path: Folder written by ``config.save_pretrained`` and ``safetensors.save_file``.
        backend: ``BackendConfig`` of the target.
        device: Device to place the target on.
        dtype: Parameter dtype of the frozen target.

    Returns:
        The frozen ``DeepseekV41ForCausalLM`` in eval mode.
    """
    path = pathlib.Path(path)
    config = DeepseekV41Config.from_pretrained(path, vision_config={"num_hidden_layers": 0})
    model = DeepseekV41ForCausalLM(config, backend=backend)
    missing, unexpected = model.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}/model.safetensors does not match its config: missing {missing}, unexpected {unexpected}"
        )
    cast_model_to_dtype(model, dtype)
    install_packed_indexer(model)
    return model.to(device).eval().requires_grad_(False)


def build_packed_draft(
    args: dict[str, Any],
    text,
    architectures: list[str],
    target_layer_ids: list[int],
    block_size: int,
    num_anchors: int,
    mask_token_id: int,
) -> DeepseekV41PackedDSparkModel:
    """Build the registered packed draft for ``architectures`` from validated recipe args.

    Upstream's ``DeepseekV41DSparkConfig`` checks the recipe against the target's released
    DSpark contract first (draft depth, block size, mask token, Markov rank, feature layers).

    Args:
        args: ``validate_recipe_config`` output.
        text: The target's ``DeepseekV41TextConfig``.
        architectures: The target's HF architectures, for the draft registry.
        target_layer_ids: Feature layers of the target.
        block_size: Draft block size.
        num_anchors: Anchor blocks of an unpacked row (and the default per-document budget of a packed one).
        mask_token_id: Token filling non-anchor block slots.

    Returns:
        A new draft (on the current default device).
    """
    options = DeepseekV41DSparkConfig(
        text_config=text,
        num_draft_layers=int(args["draft_num_hidden_layers"] or text.num_nextn_predict_layers),
        target_layer_ids=tuple(target_layer_ids),
        block_size=block_size,
        num_anchors=num_anchors,
        mask_token_id=mask_token_id,
        markov_rank=int(args["markov_rank"] or text.dspark_markov_rank),
        markov_head_type=str(args["markov_head_type"]),
        confidence_head_alpha=float(args["confidence_head_alpha"]),
        confidence_head_with_markov=bool(args["confidence_head_with_markov"]),
        confidence_head_stop_gradient=bool(args["confidence_head_stop_gradient"]),
    )
    draft_cls = resolve_dspark_draft(architectures)
    if not issubclass(draft_cls, DeepseekV41PackedDSparkModel):
        raise ValueError(f"no packed DSpark draft is registered for {architectures}; reinstall the plugin")
    return draft_cls.from_options(
        options,
        anchors_per_document=args["num_anchors_per_document"],
        max_anchors_per_row=args["max_anchors_per_row"],
        backend=cpu_backend(attn=str(args["draft_attn_backend"]), experts="torch"),
    )


__all__ = [
    "build_packed_draft",
    "check_target_contract",
    "load_local_target",
    "require_target_path",
    "require_v41_checkpoint",
    "target_text_config",
]
