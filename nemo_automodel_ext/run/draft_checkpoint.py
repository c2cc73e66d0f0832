"""What a checkpoint's draft must hold: its released keys and global shapes, and the check against them.

A checkpoint's ``model/`` holds the draft in the released V4.1 layout (``mtp.{layer}.*``,
``embed.weight``, ``head.weight``) as one safetensors file per rank. Nothing in those files says
which tensors, or how large, the whole draft has: a missing rank file simply leaves its slices
out. The expected layout therefore comes from the draft's own config:

- ``expected_draft_shapes(checkpoint)``: the draft the run built, rebuilt on the meta device from
  the checkpoint's run config and the draft config the checkpoint recorded
  (``model/.hf_metadata/config.json``, else the run's target config), through upstream's state-dict
  adapter: released key -> global shape, no weights read or allocated;
- ``check_draft_structure(found, expected, where)``: one ValueError naming what differs, structural
  settings first (draft layers, routed experts a layer), then missing, unknown and mis-shaped tensors.

The export (``export.py``) checks the assembled rank slices against the first; the evaluator checks a
checkpoint against the draft it built for the run's target with the second.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping, Sequence

import torch

from nemo_automodel_ext.run.config import validate_recipe_config
from nemo_automodel_ext.run.loading import build_packed_draft, target_text_config
from nemo_automodel_ext.run.run_record import load_run_record, resolve_run_paths

#: Released keys copied from the target when a checkpoint does not hold them (frozen embedding and head).
FROM_TARGET = ("embed.weight", "head.weight")
_LAYER = re.compile(r"^mtp\.(\d+)\.")
_EXPERT = re.compile(r"^mtp\.(\d+)\.ffn\.experts\.(\d+)\.")
#: The recorded draft config's model type (upstream's checkpointer saves the draft's text config).
_DRAFT_CONFIG_TYPE = "deepseek_v41_text"

Shapes = Mapping[str, Sequence[int]]


def released_draft_shapes(draft: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Released key -> global shape of a built draft (any device, meta included), by upstream's adapter."""
    return {key: tuple(value.shape) for key, value in draft.state_dict_adapter.to_hf(draft.state_dict()).items()}


def _draft_text_config(checkpoint: Path, args: dict):
    """The draft config the checkpoint recorded, else the run's target config (read from config.json only)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    recorded = checkpoint / "model" / ".hf_metadata" / "config.json"
    try:
        model_type = json.loads(recorded.read_text()).get("model_type") if recorded.is_file() else None
    except ValueError:
        model_type = None
    if model_type == _DRAFT_CONFIG_TYPE:
        return DeepseekV41TextConfig.from_pretrained(str(recorded.parent))
    target = Path(str(args["target_model_name_or_path"]))
    if not (target / "config.json").is_file():
        raise ValueError(
            f"{checkpoint}: cannot tell which tensors the draft holds: no recorded draft config ({recorded}) and the "
            f"run's target config ({target / 'config.json'}) is not here"
        )
    return target_text_config(str(target))


def expected_draft_shapes(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """Released key -> global shape of the draft a checkpoint's run trained (built on meta, nothing allocated).

    Args:
        checkpoint: A checkpoint folder (``run_config.yaml`` or ``config.yaml``, ``model/``).

    Returns:
        A new dict, every key of the released layout (``FROM_TARGET`` included).

    Raises:
        ValueError: naming the file when the run config or the draft config cannot be read or built.
    """
    checkpoint = Path(checkpoint)
    cfg, launch_dir, _ = load_run_record(checkpoint)
    # "cuda": the device only gates refusals of what runs where, none of which changes the draft's tensors.
    args = resolve_run_paths(validate_recipe_config(cfg, None, "cuda", require_packages=False), launch_dir)
    text = _draft_text_config(checkpoint, args)
    layer_ids = list(args["target_layer_ids"] or text.dspark_target_layer_ids)
    architectures = ["DeepseekV41ForCausalLM"]
    with torch.device("meta"):
        draft = build_packed_draft(
            args,
            text,
            architectures,
            layer_ids,
            int(args["block_size"] or text.dspark_block_size),
            int(args["num_anchors"]),
            int(args["mask_token_id"]),
        )
    return released_draft_shapes(draft)


def _counts(keys, pattern: re.Pattern) -> dict[str, int]:
    """Distinct values of the pattern's last group, per value of its first (or overall)."""
    seen: dict[str, set[str]] = {}
    for key in keys:
        match = pattern.match(key)
        if match:
            seen.setdefault(match.group(1) if pattern.groups > 1 else "", set()).add(match.group(pattern.groups))
    return {group: len(values) for group, values in seen.items()}


def check_draft_structure(found: Shapes, expected: Shapes, where: str, optional: Sequence[str] = FROM_TARGET) -> None:
    """Refuse a draft state whose structure or shapes differ from the expected released layout.

    Args:
        found: Released key -> shape the checkpoint holds.
        expected: Released key -> shape of the draft it must be (``expected_draft_shapes`` or a built draft's).
        where: The checkpoint or file, for the message.
        optional: Keys that may be absent (copied from the target).

    Raises:
        ValueError: one line naming the setting and both values (draft layers, routed experts a layer), or the
            first missing, unknown or mis-shaped tensors.
    """
    layers = (len(_counts(found, _LAYER)), len(_counts(expected, _LAYER)))
    if layers[0] != layers[1]:
        raise ValueError(
            f"{where}: the checkpoint's draft has {layers[0]} layers, this config builds {layers[1]} "
            "(recipe_args.draft_num_hidden_layers, else the target's num_nextn_predict_layers)"
        )
    experts = (_counts(found, _EXPERT), _counts(expected, _EXPERT))
    for layer, count in sorted(experts[1].items()):
        if experts[0].get(layer, 0) != count:
            raise ValueError(
                f"{where}: the checkpoint's draft layer {layer} has {experts[0].get(layer, 0)} routed experts, this "
                f"config builds {count} (dspark_n_routed_experts of the target's config): the draft was trained for "
                "another config"
            )
    missing = sorted(set(expected) - set(found) - set(optional))
    if missing:
        raise ValueError(f"{where}: draft tensors missing: {missing[:4]}" + (" ..." if len(missing) > 4 else ""))
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise ValueError(f"{where}: tensors the draft does not have: {unknown[:4]}")
    for key in sorted(found):
        if tuple(found[key]) != tuple(expected[key]):
            raise ValueError(
                f"{where}: {key} is {list(found[key])} in the checkpoint but {list(expected[key])} for this config "
                "(shape differs): the draft was trained for another target or draft config"
            )


__all__ = ["FROM_TARGET", "check_draft_structure", "expected_draft_shapes", "released_draft_shapes"]
