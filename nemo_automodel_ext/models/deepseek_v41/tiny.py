"""A tiny, randomly initialised DeepSeek V4.1 target for CPU tests and the CPU demo recipe.

The config ships with the package (``configs/tiny_target.json``): 6 layers, hidden 16,
compress_ratios [0, 0, 4, 4, 1, 1] (packed alignment 4), one DSpark draft layer.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41DSparkConfig
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer

TINY_TARGET_CONFIG = "configs/tiny_target.json"


def cpu_backend(**overrides: Any) -> BackendConfig:
    """A torch-only ``BackendConfig`` (no TE, TileLang or HybridEP kernels), runnable on CPU.

    Eager attention and the torch dispatcher unless overridden; the CPU tests, the tiny recipe
    and the draft (``attn="sdpa", experts="torch"``, upstream's draft default) use it.
    """
    settings = dict(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch_mm", dispatcher="torch")
    settings.update(overrides)
    return BackendConfig(**settings)


def tiny_target_config(**text_overrides: Any) -> DeepseekV41Config:
    """The shipped tiny V4.1 config, with optional ``text_config`` overrides."""
    raw = json.loads(resources.files(__package__).joinpath(TINY_TARGET_CONFIG).read_text())
    raw.pop("model_type")
    raw["text_config"].update(text_overrides)
    return DeepseekV41Config(**raw)


def build_tiny_target(
    seed: int = 0,
    config: DeepseekV41Config | None = None,
    backend: BackendConfig | None = None,
    packed_indexer: bool = True,
) -> DeepseekV41ForCausalLM:
    """Build and randomly initialise the tiny fp32 target in eval mode.

    Args:
        seed: Seed for the weight initialisation; equal seeds give equal weights on every rank.
        config: Config to build (defaults to ``tiny_target_config()``).
        backend: Backend (defaults to ``cpu_backend()``).
        packed_indexer: Switch its indexers to the plugin's ``PackedIndexer``, as every plugin
            builder does; False keeps upstream's ``_Indexer`` (the benchmarks' reference).

    Returns:
        A new ``DeepseekV41ForCausalLM`` on CPU.
    """
    config = tiny_target_config() if config is None else config
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DeepseekV41ForCausalLM(config, backend=backend or cpu_backend())
        model.initialize_weights(dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    if packed_indexer:
        install_packed_indexer(model)
    return model.eval()


def released_draft_options(text, num_anchors: int, confidence_head_alpha: float = 1.0) -> DeepseekV41DSparkConfig:
    """Upstream's draft options for a target's released DSpark contract (its ``text_config`` fields).

    Args:
        text: The target's ``DeepseekV41TextConfig`` (draft depth, block, feature layers, mask token, Markov rank).
        num_anchors: Anchor blocks of an unpacked row.
        confidence_head_alpha: Weight of the confidence head's loss.
    """
    return DeepseekV41DSparkConfig(
        text_config=text,
        num_draft_layers=text.num_nextn_predict_layers,
        target_layer_ids=tuple(text.dspark_target_layer_ids),
        block_size=text.dspark_block_size,
        num_anchors=num_anchors,
        mask_token_id=text.dspark_noise_token_id,
        markov_rank=text.dspark_markov_rank,
        markov_head_type="vanilla",
        confidence_head_alpha=confidence_head_alpha,
        confidence_head_with_markov=True,
    )


__all__ = ["TINY_TARGET_CONFIG", "build_tiny_target", "cpu_backend", "released_draft_options", "tiny_target_config"]
