"""What a V4.1 target and its DSpark draft hold: parameter counts and the widths the memory terms read.

``model_counts(text)`` counts, from the target's config alone, the target's parameters (routed experts
and Engram tables by formula, tested equal to meta-device counts; the rest by building the model on the
meta device without its Engram tables: no memory, ~0.2 s), the draft's trainable and frozen parameters
(its layers, its experts, its FSDP2 units) and the widths (hidden, experts, heads) every memory and
traffic term of ``memory_model.py`` and every fit of ``calibration.py`` reads. Both import it; neither
imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 2**30


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts and widths of a target and its DSpark draft.

    Attributes:
        experts: Routed-expert parameters of the target.
        engram: Engram table parameters (row-owner sharded over all ranks).
        dense: Every other target parameter (the Engram blocks' projections and norms included).
        expert_layer: Routed-expert parameters of one MoE layer.
        dense_unit: The largest non-expert FSDP unit (embedding, head or one layer's dense part).
        moe_layers: Target layers with routed experts.
        compressed_layers: Target layers with compressed (sparse) attention.
        draft_trainable: Trainable draft parameters (embedding and head frozen).
        draft_frozen: Frozen draft parameters (embedding and head copies).
        draft_layer: Parameters of the draft's largest layer (its FSDP unit).
        draft_root: Draft parameters outside its layers (embedding, head, fc, norms, Markov and confidence
            heads: FSDP2's root unit).
        target_active: Target parameters a token is multiplied by (every matrix but the embedding, the head
            and the Engram tables, whose rows are looked up; routed experts by top-k / experts).
        draft_active: Draft layer parameters a draft token is multiplied by (routed experts by top-k / experts).
        draft_projection: The draft's feature projection (``main_proj``), applied to every feature column.
        routed_experts: Routed experts of a target MoE layer (an EP size must divide them).
        draft_experts: Routed-expert parameters of every draft layer (placed on ``draft_ep`` ranks).
        draft_layer_experts: Routed-expert parameters of the draft's largest layer.
        draft_routed_experts: Routed experts of a draft layer (``draft_ep`` must divide them).
        engram_lookups: Table rows one token looks up in one Engram layer (n-gram sizes x heads; 0 without Engram).
        engram_head_dim: Width of an Engram table row.
        widths: Config widths the calibration must match.
    """

    experts: int
    engram: int
    dense: int
    expert_layer: int
    dense_unit: int
    moe_layers: int
    compressed_layers: int
    draft_trainable: int
    draft_frozen: int
    draft_layer: int
    draft_root: int = 0
    target_active: int = 0
    draft_active: int = 0
    draft_projection: int = 0
    routed_experts: int = 0
    draft_experts: int = 0
    draft_layer_experts: int = 0
    draft_routed_experts: int = 0
    engram_lookups: int = 0
    engram_head_dim: int = 0
    widths: dict[str, int] = field(default_factory=dict)

    @property
    def target(self) -> int:
        return self.experts + self.engram + self.dense


def routed_expert_parameters(text: Any) -> int:
    """Routed-expert parameters of one MoE layer: gate+up [hidden, 2 * inter] and down [inter, hidden] per expert."""
    return int(text.n_routed_experts) * 3 * int(text.hidden_size) * int(text.moe_intermediate_size)


def engram_table_parameters(text: Any) -> int:
    """Engram table parameters: one [rows, engram_head_dim] table per Engram layer below num_hidden_layers."""
    rows = [
        rows
        for layer, rows in zip(text.engram_layer_ids, text.engram_num_embeddings, strict=True)
        if layer < text.num_hidden_layers
    ]
    return sum(int(r) for r in rows) * int(text.engram_head_dim)


def _engram_layers(text: Any) -> list[int]:
    """The Engram layers below num_hidden_layers (the active ones)."""
    return [int(layer) for layer in text.engram_layer_ids if layer < text.num_hidden_layers]


def _engram_lookups(text: Any) -> int:
    """Table rows one token looks up in one Engram layer: n-gram sizes 2..max x heads."""
    return (int(text.engram_max_ngram_size) - 1) * int(text.engram_n_heads)


def _engram_block_layer_parameters(text: Any) -> int:
    """One Engram block besides its table: the key/value projection [lookups x engram_head_dim, hidden x
    (hc_mult + 1)] and the two [hc_mult, hidden] branch-norm weights."""
    hidden, streams = int(text.hidden_size), int(text.hc_mult)
    return _engram_lookups(text) * int(text.engram_head_dim) * hidden * (streams + 1) + 2 * streams * hidden


def engram_block_parameters(text: Any) -> int:
    """Engram parameters besides the tables, over the Engram layers below num_hidden_layers."""
    return len(_engram_layers(text)) * _engram_block_layer_parameters(text)


def model_counts(text: Any, num_anchors: int = 512) -> ModelCounts:
    """Count a V4.1 target (``DeepseekV41TextConfig``) and its released DSpark draft.

    Args:
        text: The target's text config.
        num_anchors: Draft option (does not change parameter counts).

    Returns:
        ModelCounts. Builds the target without its Engram layers (their tables and blocks are counted by formula,
        tested against meta-device modules) and the draft on the meta device.
    """
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend, released_draft_options

    values = text.to_dict()
    values.update(engram_layer_ids=[], engram_num_embeddings=[])
    config = DeepseekV41Config(text_config=values, vision_config={"num_hidden_layers": 0})
    with torch.device("meta"):
        target = DeepseekV41ForCausalLM(config, backend=cpu_backend())
        draft = released_draft_options(text, num_anchors=num_anchors).build()
    layers = int(text.num_hidden_layers)
    expert_layer = routed_expert_parameters(text)
    experts = sum(p.numel() for name, p in target.named_parameters() if ".experts." in name)
    moe_layers = experts // expert_layer if expert_layer else 0
    dense_units = [target.model.embed_tokens.weight.numel(), target.lm_head.weight.numel()]
    engram_layers, engram_blocks = _engram_layers(text), engram_block_parameters(text)
    engram_block = _engram_block_layer_parameters(text)
    for index, layer in target.model.layers.items():
        own = sum(p.numel() for name, p in layer.named_parameters() if ".experts." not in name)
        dense_units.append(own + (engram_block if int(index) in engram_layers else 0))
    frozen = draft.embed_tokens.weight.numel() + draft.lm_head.weight.numel()
    draft_total = sum(p.numel() for p in draft.parameters())
    ratios = list(text.compress_ratios[:layers])
    return ModelCounts(
        experts=experts,
        engram=engram_table_parameters(text),
        dense=sum(p.numel() for p in target.parameters()) - experts + engram_blocks,
        expert_layer=expert_layer,
        dense_unit=max(dense_units),
        moe_layers=moe_layers,
        compressed_layers=sum(1 for r in ratios if r),
        draft_trainable=draft_total - frozen,
        draft_frozen=frozen,
        draft_layer=max(sum(p.numel() for p in layer.parameters()) for layer in draft.layers),
        draft_root=draft_total - sum(p.numel() for layer in draft.layers for p in layer.parameters()),
        target_active=sum(p.numel() for p in target.parameters())
        - experts
        - dense_units[0]
        - dense_units[1]
        + engram_blocks
        + experts * int(text.num_experts_per_tok) // int(text.n_routed_experts),
        draft_active=sum(
            p.numel()
            * (int(text.dspark_num_experts_per_tok) / int(text.dspark_n_routed_experts) if ".experts." in n else 1)
            for layer in draft.layers
            for n, p in layer.named_parameters()
        ),
        draft_projection=sum(p.numel() for n, p in draft.named_parameters() if "main_proj" in n),
        routed_experts=int(text.n_routed_experts),
        draft_experts=sum(p.numel() for n, p in draft.named_parameters() if ".experts." in n),
        draft_layer_experts=max(
            sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n) for layer in draft.layers
        ),
        draft_routed_experts=int(text.dspark_n_routed_experts),
        engram_lookups=_engram_lookups(text) if engram_layers else 0,
        engram_head_dim=int(text.engram_head_dim),
        widths={
            "hidden": int(text.hidden_size),
            "hc_mult": int(text.hc_mult),
            "heads": int(text.num_attention_heads),
            "head_dim": int(text.head_dim),
            "o_lora_rank": int(text.o_lora_rank),
            "o_groups": int(text.o_groups),
            "topk": int(text.num_experts_per_tok),
            "moe_inter": int(text.moe_intermediate_size),
            "draft_topk": int(text.dspark_num_experts_per_tok),
            "draft_experts": int(text.dspark_n_routed_experts),
            "shared_experts": int(text.n_shared_experts or 0),
            "vocab": int(text.vocab_size),
            "window": int(text.sliding_window),
            "block": int(text.dspark_block_size),
            "feature_layers": len(text.dspark_target_layer_ids),
            "draft_layers": len(draft.layers),
            "min_ratio": min((r for r in ratios if r), default=1),
        },
    )


__all__ = [
    "GIB",
    "ModelCounts",
    "engram_block_parameters",
    "engram_table_parameters",
    "model_counts",
    "routed_expert_parameters",
]
